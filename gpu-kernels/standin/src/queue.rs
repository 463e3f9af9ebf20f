//! A context's queue of work: what `cuLaunchKernel`, the `…Async` copies and
//! `cuMemFreeAsync` enqueue runs later, in order, as a GPU's stream runs it — so that a
//! caller that reads a result it has not waited for, refills pinned memory a queued copy
//! has yet to read, or frees memory queued work still uses, gets a wrong answer or a
//! sticky error here rather than only on a GPU.
//!
//! ```text
//! cuLaunchKernel / cuMemcpy*Async / cuMemFreeAsync ─▶ checked, counted, queued
//!                                                     (arguments copied by their sizes;
//!                                                      pageable host sources copied now)
//! cuStreamSynchronize / cuCtxSynchronize / cuMemcpyHtoD / cuMemcpyDtoH / cuMemFree /
//! a device-to-host copy into pageable memory / cuMemFreeHost ─▶ the queue runs first
//! ```
//!
//! - What a driver checks when a call is made (handles, launch shapes, address ranges,
//!   injected failures) is still checked then, and its error returned by that call. What a
//!   GPU finds while running the work (a kernel's fault or out-of-bounds write, the
//!   injected sticky launch, a copy whose memory was freed meanwhile) poisons the context
//!   when the queue runs, and the call that ran it returns the error, as on a GPU.
//! - Pinned host memory (`cuMemHostAlloc`) is read by a host-to-device copy, and written by
//!   a device-to-host copy, only when the copy runs. Pageable sources are copied when the
//!   call is made (a driver stages them), and a copy into pageable memory waits for the
//!   stream (as a driver's does).
//! - The queue also runs on its own past [`RUN_AT_OPS`] items or [`RUN_AT_BYTES`] staged
//!   bytes (a GPU works through its stream without being asked).
//! - One queue per context: the streams of a context run in the order their work was
//!   enqueued. That is stricter than a GPU, which may overlap streams, so a missing
//!   ordering between two streams is not found here (Fulmen gives each partition a stream;
//!   the emulated device, whose streams are queues of their own, finds it).

use std::collections::VecDeque;
use std::ffi::{CStr, c_char, c_void};
use std::sync::Mutex;

use fulmen_kernels::Kernel;
use fulmen_kernels::emu::EmuLaunchConfig;

use crate::{CUresult, Context, ILLEGAL_ADDRESS, LAUNCH_FAILED, SUCCESS, driver, lock};

/// The queue runs on its own once it holds this many items…
pub const RUN_AT_OPS: usize = 512;
/// …or this many bytes of staged pageable host data.
pub const RUN_AT_BYTES: usize = 256 << 20;

/// Where a host-to-device copy's bytes come from.
pub(crate) enum Source {
    /// Pinned host memory, read when the copy runs.
    Pinned(usize),
    /// Pageable host memory, copied when the call was made.
    Staged(Vec<u8>),
}

/// One queued piece of work.
pub(crate) enum Work {
    /// A launch: the kernel, its shape, and its arguments' values (each parameter from the
    /// start of an 8-byte slot).
    Launch {
        kernel: Kernel,
        cfg: EmuLaunchConfig,
        slots: Vec<u64>,
        starts: Vec<usize>,
        number: u64,
    },
    ToDevice {
        dst: u64,
        src: Source,
        len: usize,
    },
    /// Into pinned host memory.
    ToHost {
        dst: usize,
        src: u64,
        len: usize,
    },
    OnDevice {
        dst: u64,
        src: u64,
        len: usize,
    },
    /// A stream-ordered free: the block stays live for the work queued before it.
    Free {
        addr: u64,
    },
}

impl Work {
    fn staged(&self) -> usize {
        match self {
            Self::ToDevice {
                src: Source::Staged(b),
                ..
            } => b.len(),
            _ => 0,
        }
    }

    /// A launch of `kernel` with the arguments `params` points at, copied by the sizes of
    /// the kernel's parameters (as a driver copies them by the cubin's parameter table).
    ///
    /// # Safety
    /// `params` holds one pointer per parameter of `kernel`, each to a value of that
    /// parameter's size.
    pub unsafe fn launch(
        kernel: Kernel,
        cfg: EmuLaunchConfig,
        params: *mut *mut c_void,
        number: u64,
    ) -> Self {
        let sizes = kernel.param_sizes();
        let mut slots = Vec::with_capacity(sizes.len());
        let mut starts = Vec::with_capacity(sizes.len());
        for (i, &size) in sizes.iter().enumerate() {
            starts.push(slots.len());
            let words = size.div_ceil(8).max(1);
            let at = slots.len();
            slots.resize(at + words, 0);
            // SAFETY: the caller's contract: params[i] points at `size` readable bytes; the
            // slots reserved hold `words * 8 >= size` bytes.
            unsafe {
                let from = (*params.add(i)).cast::<u8>();
                std::ptr::copy_nonoverlapping(from, slots.as_mut_ptr().add(at).cast(), size);
            }
        }
        Self::Launch {
            kernel,
            cfg,
            slots,
            starts,
            number,
        }
    }
}

#[derive(Default)]
struct Pending {
    work: VecDeque<Work>,
    staged: usize,
}

/// The queue of one context.
#[derive(Default)]
pub(crate) struct Queue {
    pending: Mutex<Pending>,
    /// Held while work runs, so that it runs one item at a time, in order.
    running: Mutex<()>,
}

impl Queue {
    /// Enqueues `work`, and runs the queue if it has grown past its bounds.
    pub fn push(&self, context: &Context, work: Work) -> Result<(), CUresult> {
        let full = {
            let mut p = lock(&self.pending);
            p.staged += work.staged();
            p.work.push_back(work);
            p.work.len() >= RUN_AT_OPS || p.staged >= RUN_AT_BYTES
        };
        if full {
            self.run(context)?;
        }
        Ok(())
    }

    /// Runs everything queued (and whatever other threads queue meanwhile), then returns
    /// the context's sticky error, if it has one.
    pub fn run(&self, context: &Context) -> Result<(), CUresult> {
        let _running = lock(&self.running);
        loop {
            let work = {
                let mut p = lock(&self.pending);
                let Some(work) = p.work.pop_front() else {
                    break;
                };
                p.staged -= work.staged();
                work
            };
            // After a fault the context runs nothing more; frees still give memory back.
            if context.check().is_err() && !matches!(work, Work::Free { .. }) {
                continue;
            }
            if let Err((error, why)) = execute(context, work) {
                context.poison(error, &why);
            }
        }
        context.check()
    }

    /// Drops everything queued (the context is being made anew).
    pub fn clear(&self) {
        let mut p = lock(&self.pending);
        p.work.clear();
        p.staged = 0;
    }
}

fn execute(context: &Context, work: Work) -> Result<(), (CUresult, String)> {
    let memory = context.memory();
    let locate = |addr: u64, what: &str| {
        memory.locate(addr).ok_or_else(|| {
            (
                ILLEGAL_ADDRESS,
                format!("a queued {what} refers to {addr:#x}, freed before it ran"),
            )
        })
    };
    let bad = |what: &str| {
        (
            ILLEGAL_ADDRESS,
            format!("a queued {what} ran out of bounds"),
        )
    };
    match work {
        Work::Launch {
            kernel,
            cfg,
            mut slots,
            starts,
            number,
        } => {
            if driver().config.sticky_launch == Some(number) {
                return Err((
                    ILLEGAL_ADDRESS,
                    format!("launch {number} (FULMEN_STANDIN_STICKY_LAUNCH)"),
                ));
            }
            let base = slots.as_mut_ptr();
            // SAFETY: every start lies inside `slots`.
            let mut params: Vec<*mut c_void> = starts
                .iter()
                .map(|&s| unsafe { base.add(s) }.cast())
                .collect();
            let mut error = [0 as c_char; 512];
            // SAFETY: `params` holds the launch's arguments, copied by the sizes of the
            // kernel's own parameters; the emulator reads each by its C++ type.
            let rc = unsafe {
                (kernel.emu_entry())(&cfg, params.as_mut_ptr(), error.as_mut_ptr(), error.len())
            };
            if rc != 0 {
                // SAFETY: the emulator writes a NUL-terminated message.
                let message = unsafe { CStr::from_ptr(error.as_ptr()) }.to_string_lossy();
                return Err((LAUNCH_FAILED, format!("{}: {message}", kernel.name())));
            }
            match memory.check_guards() {
                Some(damage) => Err((
                    ILLEGAL_ADDRESS,
                    format!("{} wrote out of bounds: {damage}", kernel.name()),
                )),
                None => Ok(()),
            }
        }
        Work::ToDevice { dst, src, len } => {
            let (block, offset) = locate(dst, "host-to-device copy")?;
            let written = match &src {
                // SAFETY: a pinned range of `len` bytes (checked when queued); pinned memory
                // is freed only after the queues have run (cuMemFreeHost).
                Source::Pinned(p) => memory.write(block, offset, unsafe {
                    std::slice::from_raw_parts(*p as *const u8, len)
                }),
                Source::Staged(bytes) => memory.write(block, offset, bytes),
            };
            written.map_err(|_| bad("host-to-device copy"))
        }
        Work::ToHost { dst, src, len } => {
            let (block, offset) = locate(src, "device-to-host copy")?;
            // SAFETY: as for a pinned source.
            let out = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len) };
            memory
                .read(block, offset, out)
                .map_err(|_| bad("device-to-host copy"))
        }
        Work::OnDevice { dst, src, len } => {
            let (to, to_offset) = locate(dst, "device-to-device copy")?;
            let (from, from_offset) = locate(src, "device-to-device copy")?;
            let mut staged = vec![0u8; len];
            memory
                .read(from, from_offset, &mut staged)
                .and_then(|()| memory.write(to, to_offset, &staged))
                .map_err(|_| bad("device-to-device copy"))
        }
        Work::Free { addr } => {
            if memory.free(addr).is_err() {
                return Err((
                    ILLEGAL_ADDRESS,
                    "a freed buffer's guard zone was overwritten".into(),
                ));
            }
            Ok(())
        }
    }
}

/// Whether `[ptr, ptr + len)` lies in pinned host memory from `cuMemHostAlloc`.
pub(crate) fn pinned(ptr: usize, len: usize) -> bool {
    lock(&driver().host)
        .iter()
        .any(|(&start, layout)| ptr >= start && ptr + len <= start + layout.size())
}

/// Runs every context's queue (before pinned memory is given back, or at a
/// context-wide wait). Returns SUCCESS or the first context's sticky error.
pub(crate) fn run_all() -> CUresult {
    let mut rc = SUCCESS;
    for c in &driver().contexts {
        if let Err(e) = c.queue.run(c)
            && rc == SUCCESS
        {
            rc = e;
        }
    }
    rc
}
