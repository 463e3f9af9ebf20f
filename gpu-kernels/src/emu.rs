//! The emulated device's host side: its memory (allocations with guard zones) and kernel
//! launches through the C++ scheduler in `emu/runtime.cpp`. The stand-in CUDA driver
//! (`gpu-kernels/standin`) is built on the same two pieces.
//!
//! ```text
//! allocation:  [ guard 256 B: 0xFD… ][ data, len bytes ][ guard 256 B + rounding: 0xFD… ]
//!                                     ^ 256-byte aligned, as cuMemAlloc's addresses are
//! ```
//! After every launch every live allocation's guards are checked, so a kernel that writes
//! out of bounds fails with [`KernelError::OutOfBounds`] instead of corrupting memory.

use std::alloc::{Layout, alloc, dealloc};
use std::collections::BTreeMap;
use std::ffi::{c_char, c_void};
use std::sync::Mutex;

use crate::{KernelError, Result};

/// Mirrors `fulmen_emu::LaunchConfig` in `emu/runtime.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EmuLaunchConfig {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
    pub workers: u32,
    pub seed: u64,
}

/// An exported kernel launcher: `fulmen_emu_launch_<kernel>`.
pub type EmuEntry =
    unsafe extern "C" fn(*const EmuLaunchConfig, *mut *mut c_void, *mut c_char, usize) -> i32;

/// Guard bytes before each allocation's data: as many as its alignment, so that data
/// addresses are aligned as a GPU's are (and a kernel that assumes more alignment than
/// the driver gives fails here as it would there).
const GUARD: usize = ALIGN;
/// Bytes past a buffer's end that the check after each launch reads.
const CHECK_WINDOW: usize = 4096;
const GUARD_BYTE: u8 = 0xFD;
const ALIGN: usize = 256;

struct Allocation {
    base: *mut u8,
    layout: Layout,
    /// Bytes the current user of the block asked for; everything after them up to the end
    /// of the layout is guard.
    len: usize,
}

// SAFETY: the pointer is owned by the memory map and only touched under its mutex or by
// kernels the map's owner launches.
unsafe impl Send for Allocation {}

impl Allocation {
    fn data(&self) -> *mut u8 {
        // SAFETY: the layout reserves GUARD bytes before the data.
        unsafe { self.base.add(GUARD) }
    }

    /// The first damaged guard byte, as (offset from the data start, found byte), looking
    /// at most `window` bytes past the data's end (all of the back guard when `None`).
    fn damaged_guard(&self, window: Option<usize>) -> Option<(isize, u8)> {
        // SAFETY: both guards lie inside the allocation made with `self.layout`.
        let front = unsafe { std::slice::from_raw_parts(self.base, GUARD) };
        let back_len = self.layout.size() - GUARD - self.len;
        let back_len = window.map_or(back_len, |w| back_len.min(w));
        let back = unsafe { std::slice::from_raw_parts(self.data().add(self.len), back_len) };
        if let Some(i) = front.iter().position(|&b| b != GUARD_BYTE) {
            return Some((i as isize - GUARD as isize, front[i]));
        }
        back.iter()
            .position(|&b| b != GUARD_BYTE)
            .map(|i| ((self.len + i) as isize, back[i]))
    }
}

/// The memory of one emulated device: host allocations standing for device memory.
#[derive(Default)]
pub struct EmuMemory {
    live: Mutex<BTreeMap<u64, Allocation>>,
}

impl EmuMemory {
    /// Allocates `len` bytes (contents undefined, as on a GPU: filled with 0xCD) and returns
    /// the device address.
    pub fn alloc(&self, len: usize) -> Result<u64> {
        let size = (GUARD + len + GUARD).next_multiple_of(ALIGN);
        let layout = Layout::from_size_align(size, ALIGN)
            .map_err(|e| KernelError::Unsupported(format!("allocation of {len} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size (at least two guards).
        let base = unsafe { alloc(layout) };
        if base.is_null() {
            return Err(KernelError::Unsupported(format!(
                "host memory for {len} device bytes"
            )));
        }
        // SAFETY: `base` points at `size` writable bytes.
        unsafe {
            std::ptr::write_bytes(base, GUARD_BYTE, size);
            std::ptr::write_bytes(base.add(GUARD), 0xCD, len);
        }
        let allocation = Allocation { base, layout, len };
        let addr = allocation.data() as u64;
        self.lock().insert(addr, allocation);
        Ok(addr)
    }

    /// Frees an allocation; a damaged guard is reported (the kernel that did it already
    /// failed its launch check, so this only catches writes made outside kernels).
    pub fn free(&self, addr: u64) -> Result<()> {
        let Some(a) = self.lock().remove(&addr) else {
            return Err(KernelError::Unsupported(format!(
                "free of unknown address {addr:#x}"
            )));
        };
        let damaged = a.damaged_guard(None);
        // SAFETY: allocated in `alloc` with this layout and removed from the map, so freed once.
        unsafe { dealloc(a.base, a.layout) };
        match damaged {
            None => Ok(()),
            Some((at, byte)) => Err(KernelError::OutOfBounds {
                kernel: "(none)",
                device: "emulated".into(),
                detail: format!("guard byte at offset {at} is {byte:#04x}"),
            }),
        }
    }

    /// Checks every live allocation's guards after a launch; the first damage found is
    /// described, and that allocation's guards are laid anew, so that the next launch is not
    /// blamed for it. The back guard is read up to `CHECK_WINDOW` bytes past each buffer's
    /// end: a reused block's whole remainder is guard too, but reading megabytes of it
    /// after every launch made whole-query tests crawl; `free` still reads all of it.
    pub fn check_guards(&self) -> Option<String> {
        let live = self.lock();
        let (a, at, byte) = live.values().find_map(|a| {
            a.damaged_guard(Some(CHECK_WINDOW))
                .map(|(at, byte)| (a, at, byte))
        })?;
        // SAFETY: the guards lie inside the allocation made with `a.layout`.
        unsafe {
            std::ptr::write_bytes(a.base, GUARD_BYTE, GUARD);
            std::ptr::write_bytes(
                a.data().add(a.len),
                GUARD_BYTE,
                a.layout.size() - GUARD - a.len,
            );
        }
        Some(format!(
            "allocation {:#x} of {} bytes: byte at offset {at} is {byte:#04x}",
            a.data() as u64,
            a.len
        ))
    }

    /// Hands a (possibly reused) block to a buffer of `len` bytes: the bytes past `len`
    /// become guard, and the contents are undefined again (0xCD).
    pub fn lend(&self, addr: u64, len: usize) -> Result<()> {
        let mut live = self.lock();
        let a = live.get_mut(&addr).ok_or_else(|| {
            KernelError::Unsupported(format!("lend of unknown address {addr:#x}"))
        })?;
        let room = a.layout.size() - 2 * GUARD;
        if len > room {
            return Err(KernelError::Unsupported(format!(
                "{len} bytes in a block of {room}"
            )));
        }
        a.len = len;
        // SAFETY: data() .. data() + layout.size() - GUARD lies inside the allocation.
        unsafe {
            std::ptr::write_bytes(a.data(), 0xCD, len);
            std::ptr::write_bytes(a.data().add(len), GUARD_BYTE, a.layout.size() - GUARD - len);
        }
        Ok(())
    }

    /// Copies host bytes into device memory at `addr + offset`.
    pub fn write(&self, addr: u64, offset: usize, bytes: &[u8]) -> Result<()> {
        let live = self.lock();
        let at = Self::checked(&live, addr, offset, bytes.len())?;
        // SAFETY: `checked` bounded the range; host and device memory never overlap.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), at, bytes.len()) };
        Ok(())
    }

    /// Copies `out.len()` bytes from device memory at `addr + offset` to the host.
    pub fn read(&self, addr: u64, offset: usize, out: &mut [u8]) -> Result<()> {
        let live = self.lock();
        let at = Self::checked(&live, addr, offset, out.len())?;
        // SAFETY: as in `write`.
        unsafe { std::ptr::copy_nonoverlapping(at, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// The address of `len` bytes at `offset` in the allocation at `addr`, if they lie in it.
    fn checked(
        live: &BTreeMap<u64, Allocation>,
        addr: u64,
        offset: usize,
        len: usize,
    ) -> Result<*mut u8> {
        let a = live.get(&addr).ok_or_else(|| {
            KernelError::Unsupported(format!("copy at unknown address {addr:#x}"))
        })?;
        if offset.checked_add(len).is_none_or(|end| end > a.len) {
            return Err(KernelError::Unsupported(format!(
                "copy of {len} bytes at offset {offset} in an allocation of {} bytes",
                a.len
            )));
        }
        // SAFETY: offset + len <= a.len, inside the allocation.
        Ok(unsafe { a.data().add(offset) })
    }

    /// The allocation holding device address `addr` (which may point inside it): its start
    /// and `addr`'s offset from there.
    pub fn locate(&self, addr: u64) -> Option<(u64, usize)> {
        let live = self.lock();
        let (&start, a) = live.range(..=addr).next_back()?;
        let offset = (addr - start) as usize;
        (offset < a.len.max(1)).then_some((start, offset))
    }

    /// Whether `len` bytes at device address `addr` lie inside one live allocation, within
    /// the bytes its current user asked for.
    pub fn holds(&self, addr: u64, len: usize) -> bool {
        let live = self.lock();
        let Some((&start, a)) = live.range(..=addr).next_back() else {
            return false;
        };
        let offset = (addr - start) as usize;
        offset.checked_add(len).is_some_and(|end| end <= a.len)
    }

    /// Bytes held by live allocations (what they asked for, not counting guards).
    pub fn bytes_in_use(&self) -> usize {
        self.lock().values().map(|a| a.len).sum()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Allocation>> {
        // A panic while holding the lock leaves the map consistent (every operation on it is
        // a single insert, remove or read), so a poisoned lock is still usable.
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for EmuMemory {
    fn drop(&mut self) {
        for (_, a) in std::mem::take(&mut *self.lock()) {
            // SAFETY: each allocation was made with its layout and is freed once here.
            unsafe { dealloc(a.base, a.layout) };
        }
    }
}

/// Runs `entry` with CUDA-style parameters (`params[i]` points at argument i).
pub fn launch(
    entry: EmuEntry,
    cfg: &EmuLaunchConfig,
    params: &mut [*mut c_void],
) -> Result<(), String> {
    let mut error = vec![0 as c_char; 512];
    // SAFETY: `params` holds one pointer per kernel argument, each to an 8-byte slot whose
    // value has the kernel's argument type (checked by the typed wrappers in `ops`); device
    // pointers among them are live allocations of this device.
    let rc = unsafe { entry(cfg, params.as_mut_ptr(), error.as_mut_ptr(), error.len()) };
    if rc == 0 {
        return Ok(());
    }
    // SAFETY: the runtime writes a NUL-terminated message into `error`.
    let message = unsafe { std::ffi::CStr::from_ptr(error.as_ptr()) };
    Err(message.to_string_lossy().into_owned())
}
