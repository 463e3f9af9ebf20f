//! An emulated device's stream (one queue per stream, see `Device::on_stream`): work the
//! host enqueues runs later, in order, as a GPU's stream runs it — so that code which reads a result without waiting for it, or reuses
//! memory that queued work still uses, fails in tests instead of on a GPU.
//!
//! ```text
//! host:   launch ─▶ write ─▶ lend ─▶ launch ─▶ … ─▶ read (a sync)
//!           └──────────── queued, nothing runs yet ────────┘   │
//! queue:  runs every op in order ◀───────────────────────────────┘ then the read copies
//! ```
//!
//! - The queue runs when the host waits for the device (a read, [`Device::synchronize`]),
//!   and on its own when it grows past [`RUN_AT_OPS`] ops or [`RUN_AT_BYTES`] queued bytes
//!   (a GPU works through its stream without being asked; this bounds the host memory the
//!   queue holds). Which of those points runs it does not change any answer.
//! - Memory bookkeeping is queued too: handing a pooled block to a new buffer (its guard
//!   zones move) and giving a block back to the host allocator happen in stream order,
//!   after the work queued before them — the emulator's stream-ordered allocation.
//! - Before a queued launch runs, each buffer argument must still be a live block lent
//!   with at least the argument's length: queued work that refers to freed memory is a
//!   detected error, not a silent read of whatever took its place.
//! - The first failure (a kernel that faults, writes out of bounds, or refers to freed
//!   memory) is reported to the host call that ran the queue, and loses the device, as a
//!   sticky error loses a GPU's context: the ops after it are dropped (their memory
//!   bookkeeping still runs) and the caller quarantines the device.
//!
//! [`Device::synchronize`]: crate::Device::synchronize

use std::collections::VecDeque;
use std::ffi::c_void;
use std::sync::Mutex;

use crate::emu::{self, EmuLaunchConfig, EmuMemory};
use crate::kernels::Kernel;
use crate::{KernelError, Result};

/// The queue runs on its own once it holds this many ops…
pub const RUN_AT_OPS: usize = 512;
/// …or this many bytes of queued host data.
pub const RUN_AT_BYTES: usize = 256 << 20;

/// One piece of queued device work.
pub(crate) enum Op {
    /// A pooled block handed to a buffer of `len` bytes.
    Lend { addr: u64, len: usize },
    /// A block given back to the host allocator.
    Free { addr: u64 },
    /// Host bytes copied in (taken when enqueued, as a driver stages pageable memory).
    Write {
        addr: u64,
        offset: usize,
        bytes: Vec<u8>,
    },
    /// A copy between two buffers.
    Copy {
        dst: u64,
        at: usize,
        src: u64,
        len: usize,
    },
    /// A kernel launch: its parameter slots, and the (address, length) of each buffer
    /// argument, checked to be live before it runs.
    Launch {
        kernel: Kernel,
        cfg: EmuLaunchConfig,
        slots: Vec<u64>,
        buffers: Vec<(u64, usize)>,
    },
}

impl Op {
    fn bytes(&self) -> usize {
        match self {
            Self::Write { bytes, .. } => bytes.len(),
            _ => 0,
        }
    }
}

#[derive(Default)]
struct Pending {
    ops: VecDeque<Op>,
    bytes: usize,
}

/// The queue of one stream of an emulated device.
#[derive(Default)]
pub(crate) struct EmuQueue {
    pending: Mutex<Pending>,
    /// Held while ops run, so that they run one at a time, in order; it holds the first
    /// failure once there is one, which every later run reports (a sticky error).
    running: Mutex<Option<String>>,
}

impl EmuQueue {
    /// Enqueues `op`; runs the queue when it has grown past its bounds.
    pub fn push(&self, op: Op, memory: &EmuMemory, device: &str) -> Result<()> {
        let full = {
            let mut p = lock(&self.pending);
            p.bytes += op.bytes();
            p.ops.push_back(op);
            p.ops.len() >= RUN_AT_OPS || p.bytes >= RUN_AT_BYTES
        };
        if full {
            self.run(memory, device)?;
        }
        Ok(())
    }

    /// Runs every queued op, in order, until the queue is empty (ops other threads enqueue
    /// meanwhile run too). Returns the first failure; the ops queued after it are dropped,
    /// save their memory bookkeeping.
    pub fn run(&self, memory: &EmuMemory, device: &str) -> Result<()> {
        self.run_then(memory, device, || Ok(()))
    }

    /// Runs the queue, then `then` before any op queued meanwhile runs (a read copies
    /// what the stream had made when the read was queued, as a device-to-host copy does).
    /// After a failure, this and every later run fail, for every caller.
    pub fn run_then<T>(
        &self,
        memory: &EmuMemory,
        device: &str,
        then: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let mut failed = lock(&self.running);
        let mut failure: Option<KernelError> = None;
        loop {
            let op = {
                let mut p = lock(&self.pending);
                let Some(op) = p.ops.pop_front() else { break };
                p.bytes -= op.bytes();
                op
            };
            if (failed.is_some() || failure.is_some())
                && !matches!(op, Op::Lend { .. } | Op::Free { .. })
            {
                continue;
            }
            if let Err(e) = execute(op, memory, device)
                && failure.is_none()
            {
                failure = Some(e);
            }
        }
        if let Some(e) = failure {
            if failed.is_none() {
                *failed = Some(e.to_string());
            }
            return Err(e);
        }
        if let Some(first) = failed.as_ref() {
            return Err(KernelError::DeviceLost {
                device: device.to_string(),
                message: format!("queued work failed earlier: {first}"),
            });
        }
        then()
    }

    /// Ops waiting to run.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        lock(&self.pending).ops.len()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn execute(op: Op, memory: &EmuMemory, device: &str) -> Result<()> {
    match op {
        Op::Lend { addr, len } => memory.lend(addr, len),
        Op::Free { addr } => memory.free(addr),
        Op::Write {
            addr,
            offset,
            bytes,
        } => memory.write(addr, offset, &bytes),
        Op::Copy { dst, at, src, len } => {
            let mut bytes = vec![0u8; len];
            memory.read(src, 0, &mut bytes)?;
            memory.write(dst, at, &bytes)
        }
        Op::Launch {
            kernel,
            cfg,
            mut slots,
            buffers,
        } => {
            for (k, &(addr, len)) in buffers.iter().enumerate() {
                if !memory.holds(addr, len) {
                    return Err(KernelError::OutOfBounds {
                        kernel: kernel.name(),
                        device: device.to_string(),
                        detail: format!(
                            "buffer argument {k} ({len} bytes at {addr:#x}) was freed or \
                             reused while the launch was queued"
                        ),
                    });
                }
            }
            let mut params: Vec<*mut c_void> = slots
                .iter_mut()
                .map(|s| s as *mut u64 as *mut c_void)
                .collect();
            emu::launch(kernel.emu_entry(), &cfg, &mut params).map_err(|message| {
                KernelError::LaunchFailed {
                    kernel: kernel.name(),
                    device: device.to_string(),
                    message,
                }
            })?;
            match memory.check_guards() {
                Some(detail) => Err(KernelError::OutOfBounds {
                    kernel: kernel.name(),
                    device: device.to_string(),
                    detail,
                }),
                None => Ok(()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(addr: u64, byte: u8, len: usize) -> Op {
        Op::Write {
            addr,
            offset: 0,
            bytes: vec![byte; len],
        }
    }

    #[test]
    fn writes_wait_in_the_queue_until_it_runs_and_then_run_in_order() {
        let memory = EmuMemory::default();
        let queue = EmuQueue::default();
        let addr = memory.alloc(8).unwrap();
        for value in [1u8, 2, 3] {
            queue
                .push(write(addr, value, 8), &memory, "emulated:0")
                .unwrap();
        }
        assert_eq!(queue.len(), 3);
        let mut out = [0u8; 8];
        memory.read(addr, 0, &mut out).unwrap();
        assert_eq!(out, [0xCD; 8], "nothing ran before the queue did");
        queue.run(&memory, "emulated:0").unwrap();
        memory.read(addr, 0, &mut out).unwrap();
        assert_eq!(out, [3; 8], "the last write queued is the last applied");
        assert_eq!(queue.len(), 0);
    }

    #[test]
    fn a_queued_launch_on_freed_memory_is_detected_and_later_work_dropped() {
        let memory = EmuMemory::default();
        let queue = EmuQueue::default();
        let live = memory.alloc(64).unwrap();
        let freed = memory.alloc(64).unwrap();
        memory.free(freed).unwrap();
        let cfg = EmuLaunchConfig {
            grid: [1, 1, 1],
            block: [32, 1, 1],
            shared_bytes: 0,
            workers: 1,
            seed: 1,
        };
        let launch = Op::Launch {
            kernel: Kernel::agg_fill_u64,
            cfg,
            slots: vec![freed, 8, 0],
            buffers: vec![(freed, 64)],
        };
        queue.push(launch, &memory, "emulated:0").unwrap();
        queue
            .push(write(live, 7, 64), &memory, "emulated:0")
            .unwrap();
        let e = queue.run(&memory, "emulated:0").unwrap_err();
        assert!(
            matches!(
                e,
                KernelError::OutOfBounds {
                    kernel: "agg_fill_u64",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("freed or reused"), "{e}");
        let mut out = [0u8; 64];
        memory.read(live, 0, &mut out).unwrap();
        assert_eq!(out, [0xCD; 64], "work queued after the failure is dropped");
        // Sticky: whoever runs the queue next is told, and its work is dropped too.
        queue
            .push(write(live, 8, 64), &memory, "emulated:0")
            .unwrap();
        let e = queue.run(&memory, "emulated:0").unwrap_err();
        assert!(matches!(e, KernelError::DeviceLost { .. }), "{e}");
        memory.read(live, 0, &mut out).unwrap();
        assert_eq!(out, [0xCD; 64]);
    }
}
