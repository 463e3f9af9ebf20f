//! Device memory: buffers drawn from a per-device pool with a byte budget.
//!
//! Freed buffers go back to the pool by size class and are reused by later allocations of
//! that class (on a GPU this saves the driver call, which costs far more than a kernel),
//! each with the point each stream of the device had reached when it was let go: another
//! stream reuses it only once the host knows each has passed that point.
//! Cached bytes do not count against the budget; when an allocation would pass it, the
//! cache is emptied first, and only then is the allocation refused with
//! [`KernelError::OutOfDeviceMemory`].

use std::collections::HashMap;
use std::fmt;
use std::sync::Mutex;

use crate::device::Device;
use crate::{KernelError, Result};

/// Allocations are rounded up to a size class: a power of two, or a multiple of 1 MiB
/// above 1 MiB, so that reuse works without wasting much.
pub(crate) fn size_class(len: usize) -> usize {
    const MIB: usize = 1 << 20;
    let len = len.max(256);
    if len <= MIB {
        len.next_power_of_two()
    } else {
        len.next_multiple_of(MIB)
    }
}

/// Bookkeeping of one device's memory.
#[derive(Default)]
pub(crate) struct Pool {
    state: Mutex<PoolState>,
}

#[derive(Default)]
struct PoolState {
    in_use: usize,
    peak: usize,
    cached_bytes: usize,
    /// By size class: each block, and for each stream (by index) the ops queued on it when
    /// the block was let go.
    cached: HashMap<usize, Vec<(u64, Vec<u64>)>>,
}

impl Pool {
    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes `class` bytes: a cached block of that class that `reusable` allows (from the
    /// stream points it was let go at), or a new one from `fresh`. When the device would
    /// otherwise hold more than its budget, `settle` waits for every stream (so that every
    /// cached block may be reused or freed) and cached blocks of other classes are handed
    /// to `release`.
    #[allow(clippy::too_many_arguments)]
    pub fn take(
        &self,
        device: &str,
        class: usize,
        budget: usize,
        reusable: impl Fn(&[u64]) -> bool,
        settle: impl Fn() -> Result<()>,
        fresh: impl Fn() -> Result<u64>,
        release: impl Fn(u64),
    ) -> Result<u64> {
        let mut s = self.lock();
        if s.in_use + class > budget {
            return Err(KernelError::OutOfDeviceMemory {
                device: device.to_string(),
                requested: class,
                in_use: s.in_use,
                budget,
            });
        }
        let over = s.in_use + s.cached_bytes + class > budget;
        // The latest let go first (the likeliest to be warm), among those allowed; any
        // once the streams are settled, when the device is short of memory.
        let cached = s.cached.get(&class).map_or(&[][..], Vec::as_slice);
        let at = match cached.iter().rposition(|(_, clock)| reusable(clock)) {
            Some(at) => Some(at),
            None if over && !cached.is_empty() => {
                settle()?;
                Some(cached.len() - 1)
            }
            None => None,
        };
        let ready = at.and_then(|at| s.cached.get_mut(&class).map(|b| b.swap_remove(at).0));
        let addr = match ready {
            Some(addr) => {
                s.cached_bytes -= class;
                addr
            }
            None => {
                if over {
                    settle()?;
                    for (_, blocks) in s.cached.drain() {
                        blocks.into_iter().for_each(|(addr, _)| release(addr));
                    }
                    s.cached_bytes = 0;
                }
                fresh()?
            }
        };
        s.in_use += class;
        s.peak = s.peak.max(s.in_use);
        Ok(addr)
    }

    /// Returns a block to the cache, let go when the streams had queued `clock` ops.
    pub fn give_back(&self, class: usize, addr: u64, clock: Vec<u64>) {
        let mut s = self.lock();
        s.in_use -= class;
        s.cached_bytes += class;
        s.cached.entry(class).or_default().push((addr, clock));
    }

    /// Empties the cache, handing each block to `release`.
    pub fn trim(&self, release: impl Fn(u64)) {
        let blocks: Vec<u64> = {
            let mut s = self.lock();
            s.cached_bytes = 0;
            s.cached
                .drain()
                .flat_map(|(_, b)| b.into_iter().map(|(addr, _)| addr))
                .collect()
        };
        blocks.into_iter().for_each(release);
    }

    /// (bytes in use, peak bytes in use).
    pub fn usage(&self) -> (usize, usize) {
        let s = self.lock();
        (s.in_use, s.peak)
    }
}

/// Bytes in one device's memory. Dropping the buffer returns them to the device's pool.
pub struct DeviceBuffer {
    pub(crate) device: Device,
    pub(crate) addr: u64,
    pub(crate) len: usize,
    pub(crate) class: usize,
    /// The index of the stream it was made on: work on another stream that uses it waits
    /// for that one first (see `Device::after`).
    pub(crate) stream: usize,
}

impl DeviceBuffer {
    /// The device that holds the bytes.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The bytes the buffer holds of its device's budget: its length rounded up to the
    /// pool's size class (what the device's memory usage counts for it).
    pub fn reserved(&self) -> usize {
        self.class
    }

    /// Usable length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The index of the stream of its device it was made on (see `Device::on_stream`).
    pub fn stream(&self) -> usize {
        self.stream
    }

    /// The device address, as kernels see it.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Copies the whole buffer to the host.
    pub fn to_host(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.len];
        self.device.read(self, 0, &mut out)?;
        Ok(out)
    }

    /// Copies the first `len` bytes (at most the buffer's) to the host.
    pub fn prefix_to_host(&self, len: usize) -> Result<Vec<u8>> {
        let mut out = vec![0u8; len.min(self.len)];
        self.device.read(self, 0, &mut out)?;
        Ok(out)
    }

    /// Copies the whole buffer to the host into an Arrow buffer (aligned as Arrow needs).
    pub fn to_arrow_buffer(&self) -> Result<arrow::buffer::Buffer> {
        let mut out = arrow::buffer::MutableBuffer::from_len_zeroed(self.len);
        self.device.read(self, 0, out.as_slice_mut())?;
        Ok(out.into())
    }

    /// Copies `bytes` into the buffer at `offset`.
    pub fn write(&self, offset: usize, bytes: &[u8]) -> Result<()> {
        self.device.write(self, offset, bytes)
    }

    /// Reads a little-endian u64 at element `index` (for totals the host needs).
    pub fn read_u64(&self, index: usize) -> Result<u64> {
        let mut out = [0u8; 8];
        self.device.read(self, index * 8, &mut out)?;
        Ok(u64::from_le_bytes(out))
    }
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DeviceBuffer({} bytes at {:#x} on {})",
            self.len, self.addr, self.device
        )
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        self.device.release(self.addr, self.class);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_round_up_with_little_waste() {
        assert_eq!(size_class(0), 256);
        assert_eq!(size_class(257), 512);
        assert_eq!(size_class(1 << 20), 1 << 20);
        assert_eq!(size_class((1 << 20) + 1), 2 << 20);
        assert_eq!(size_class(5 * (1 << 20) + 3), 6 << 20);
    }
}
