//! The device's streams: uploads through the pinned staging halves, reads, copies between
//! buffers, waits, waits for another stream, and the emulated device's queues (see
//! `emu_queue.rs` and the module notes of `device.rs`).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{Arg, Backend, Device, DeviceCounts, STAGING_BYTES, UPLOAD_HALF_BYTES};
use crate::emu_queue::{EmuQueue, Op};
use crate::memory::DeviceBuffer;
use crate::ops::scan::LOOKBACK_TILES;
use crate::{KernelError, Result};

thread_local! {
    /// The stream index work on this thread goes on, inside [`in_stream`].
    static SCOPE: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// The thread's stream index, inside [`in_stream`].
pub(super) fn scoped() -> Option<usize> {
    SCOPE.with(std::cell::Cell::get)
}

/// Runs `work` with every device call it makes on this thread, through any handle, queued
/// on stream `index` of that handle's device (its own otherwise): an operator partition's
/// work goes on the partition's stream even where an op takes its device from an input
/// another stream made. Scopes nest; the innermost wins.
pub fn in_stream<T>(index: usize, work: impl FnOnce() -> T) -> T {
    struct Restore(Option<usize>);
    impl Drop for Restore {
        fn drop(&mut self) {
            SCOPE.with(|s| s.set(self.0));
        }
    }
    let _restore = Restore(SCOPE.with(|s| s.replace(Some(index))));
    work()
}

/// One stream of a device: its queue on the emulator (a GPU's driver keeps its own), and
/// how far along it the host knows it to be. Work on one stream runs in the order it was
/// queued; work on two streams is ordered by a wait of one for the other on the device, or
/// by a host wait (see [`Device::after`]).
#[derive(Default)]
pub(crate) struct Stream {
    /// Its index among the device's streams (0: the device's own, the one every handle
    /// starts on).
    pub(super) index: usize,
    /// The emulated device's queue of this stream.
    pub(super) queue: EmuQueue,
    /// Ops queued so far (a sequence number).
    enqueued: AtomicU64,
    /// The last op known to have finished: queued before one of the host's waits on the
    /// stream began.
    passed: AtomicU64,
    /// The stream's look-back scan state (see [`Device::with_lookback`]).
    lookback: Mutex<Lookback>,
    /// For each other stream, by index: how many of its ops this stream was made to wait
    /// for on the device ([`Device::after`]), so that it does not wait for them again, and
    /// how many ops this stream had queued then (a host wait past them has passed those).
    waited: Mutex<Vec<Waited>>,
}

/// What a stream was made to wait for of another (see `Stream::waited`).
#[derive(Debug, Default, Clone, Copy)]
struct Waited {
    /// The other stream's ops waited for.
    through: u64,
    /// This stream's ops queued before the wait.
    at: u64,
}

/// A stream's look-back scan state: its device address (0 until the first scan that needs
/// it) and the epoch of the last scan that used it.
#[derive(Debug, Default)]
struct Lookback {
    addr: u64,
    epoch: u64,
}

impl Stream {
    pub(super) fn new(index: usize) -> Self {
        Self {
            index,
            ..Self::default()
        }
    }

    /// Ops queued so far.
    pub(super) fn enqueued(&self) -> u64 {
        self.enqueued.load(Ordering::Acquire)
    }

    /// The last op known to have finished.
    pub(super) fn passed(&self) -> u64 {
        self.passed.load(Ordering::Acquire)
    }

    /// Notes one more op queued; returns its number.
    pub(super) fn queued(&self) -> u64 {
        self.enqueued.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// Whether work queued on it may still be running.
    pub(super) fn busy(&self) -> bool {
        self.passed() < self.enqueued()
    }

    fn passed_through(&self, op: u64) {
        self.passed.fetch_max(op, Ordering::AcqRel);
    }

    fn waited(&self) -> std::sync::MutexGuard<'_, Vec<Waited>> {
        self.waited.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether this stream may still have to wait for the first `through` ops of stream
    /// `other` (it has not been made to wait for them, nor has the host passed them).
    fn must_wait(&self, other: &Stream, through: u64) -> bool {
        other.passed() < through
            && self
                .waited()
                .get(other.index)
                .is_none_or(|w| w.through < through)
    }

    /// Notes that this stream waits, from here on, for the first `through` ops of stream
    /// `other`.
    fn waits_for(&self, other: usize, through: u64) {
        let at = self.enqueued();
        let mut waited = self.waited();
        if waited.len() <= other {
            waited.resize(other + 1, Waited::default());
        }
        if waited[other].through < through {
            waited[other] = Waited { through, at };
        }
    }
}

/// The two halves of pinned upload staging, each [`UPLOAD_HALF_BYTES`], shared by the
/// device's streams: uploads fill one while the streams copy out of the other. A half is
/// refilled only once every stream has passed its copies out of it, which the host knows
/// from its own waits; for a stream it has not waited on since, it waits then (a counted
/// sync each).
#[derive(Debug, Default)]
pub(super) struct UploadRing {
    /// The half being filled, and the bytes of it used since it was last started.
    half: usize,
    fill: usize,
    /// For each half, by stream index: the number of the last op copying out of it.
    last: [Vec<u64>; 2],
}

impl Device {
    /// Queues work on this handle's stream of the emulated device (which may run it, if
    /// it has grown past its bounds: a failure then loses the device, see `emu_queue.rs`).
    pub(super) fn enqueue(&self, op: Op) -> Result<()> {
        let Backend::Emulated(memory) = &self.inner.backend else {
            return Err(KernelError::Unsupported("queueing on a GPU".into()));
        };
        let device = self.to_string();
        let stream = self.current();
        stream.queued();
        stream
            .queue
            .push(op, memory, &device)
            .map_err(|e| self.sticky(e))
    }

    /// A failure of queued work: as a GPU's sticky error, it takes the device out of use.
    fn sticky(&self, error: KernelError) -> KernelError {
        self.quarantine(&error.to_string());
        error
    }

    /// Runs `launch` with this handle's stream's look-back scan state (an argument for
    /// `scan_lookback`'s `state`, [`LOOKBACK_TILES`] its capacity) and a new epoch for it,
    /// holding the state until `launch` returns, so that the stream's scans queue in the
    /// order of their epochs. The state is made the first time, outside the pool (it is not
    /// counted against the budget or a quota, and lives as long as the device), and zeroed
    /// by a launch (one per stream: no upload, so that a query over resident data uploads
    /// nothing); it is never reset after that (see `scan.cu`).
    pub(crate) fn with_lookback<T>(&self, launch: impl FnOnce(Arg, u64) -> Result<T>) -> Result<T> {
        self.usable()?;
        let stream = self.current();
        let mut state = stream.lookback.lock().unwrap_or_else(|p| p.into_inner());
        let bytes = 3 * LOOKBACK_TILES as usize * 8;
        let arg = |addr| Arg::Buf(addr, bytes, stream.index);
        if state.addr == 0 {
            let addr = self.backend_alloc(bytes)?;
            let words = 3 * LOOKBACK_TILES;
            // SAFETY: the state holds `words` u64, on this stream; the arguments follow
            // agg.cu's signature of agg_fill_u64 (buffer, words, value).
            unsafe {
                self.launch(
                    crate::kernels::Kernel::agg_fill_u64,
                    super::LaunchConfig::for_items(self, words, crate::ops::BLOCK),
                    &[arg(addr), Arg::U64(words), Arg::U64(0)],
                )?;
            }
            state.addr = addr;
        }
        state.epoch += 1;
        launch(arg(state.addr), state.epoch)
    }

    /// Waits until this handle's stream has done everything queued on it so far (a
    /// counted sync): the host needs this only before touching what queued work produces
    /// outside a read, which waits by itself.
    pub fn synchronize(&self) -> Result<()> {
        self.usable()?;
        self.record(DeviceCounts {
            syncs: 1,
            ..DeviceCounts::default()
        });
        self.wait_on(&self.current())
    }

    /// Waits (uncounted: the caller counts) for everything queued on `stream` so far.
    pub(super) fn wait_on(&self, stream: &Stream) -> Result<()> {
        let through = stream.enqueued();
        match &self.inner.backend {
            Backend::Emulated(memory) => stream
                .queue
                .run(memory, &self.to_string())
                .map_err(|e| self.sticky(e)),
            Backend::Cuda(cuda) => cuda.sync(stream.index).map_err(|e| self.lost(e)),
        }?;
        self.passed(stream, through);
        Ok(())
    }

    /// Notes that the host has waited for `stream`'s first `through` ops, and so for what
    /// the stream was made to wait for of other streams before its op `through` (a wait
    /// noted with a later op queued after it: one queued alongside it may not be covered).
    fn passed(&self, stream: &Stream, through: u64) {
        stream.passed_through(through);
        let waited: Vec<(usize, Waited)> = stream.waited().iter().copied().enumerate().collect();
        for (index, w) in waited {
            if w.through > 0 && w.at < through && index != stream.index {
                self.inner.stream(index).passed_through(w.through);
            }
        }
    }

    /// Before work on this handle's stream uses buffers made through handles on other
    /// streams (`streams`: their indices), makes it wait, on the device, for what each of
    /// those streams has queued so far (a counted stream wait each: an event recorded
    /// there and waited for here; the host goes on). A stream the host has passed, or that
    /// this one already waits for as far, costs nothing.
    pub(crate) fn after(&self, streams: impl IntoIterator<Item = usize>) -> Result<()> {
        let me = self.current_index();
        let mine = self.inner.stream(me);
        let mut seen: Vec<usize> = Vec::new();
        for index in streams {
            if index == me || seen.contains(&index) {
                continue;
            }
            seen.push(index);
            let other = self.inner.stream(index);
            let through = other.enqueued();
            if !mine.must_wait(&other, through) {
                continue;
            }
            log::debug!("{self}: stream {me} waits for stream {index}");
            self.record(DeviceCounts {
                stream_waits: 1,
                ..DeviceCounts::default()
            });
            match &self.inner.backend {
                // The emulator runs the other stream's queue now, which is one order a GPU
                // may run them in; the host does not take that stream as passed (it did not
                // wait for it), as it cannot on a GPU.
                Backend::Emulated(memory) => other
                    .queue
                    .run(memory, &self.to_string())
                    .map_err(|e| self.sticky(e)),
                Backend::Cuda(cuda) => cuda.join(me, index).map_err(|e| self.lost(e)),
            }?;
            mine.waits_for(index, through);
        }
        Ok(())
    }

    /// Waits for every stream of the device that may still be running queued work (a
    /// counted sync each): before memory goes back to the driver, which any of them may
    /// still be using.
    pub(crate) fn settle(&self) -> Result<()> {
        for index in 0..self.inner.stream_count() {
            let stream = self.inner.stream(index);
            if stream.busy() {
                self.record(DeviceCounts {
                    syncs: 1,
                    ..DeviceCounts::default()
                });
                self.wait_on(&stream)?;
            }
        }
        Ok(())
    }

    /// Fails unless `len` bytes at `offset` lie inside `buffer` (`way`: into, out of).
    fn within(buffer: &DeviceBuffer, offset: usize, len: usize, way: &str) -> Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > buffer.len) {
            return Err(KernelError::Unsupported(format!(
                "copy of {len} bytes at offset {offset} {way} a buffer of {}",
                buffer.len
            )));
        }
        Ok(())
    }

    fn uploads(&self) -> std::sync::MutexGuard<'_, UploadRing> {
        self.inner.uploads.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn write(&self, buffer: &DeviceBuffer, offset: usize, bytes: &[u8]) -> Result<()> {
        self.write_with(buffer, offset, bytes.len(), &|start, out| {
            out.copy_from_slice(&bytes[start..start + out.len()])
        })
    }

    /// Writes `len` bytes into `buffer` at `offset`, which `fill(start, out)` produces piece
    /// by piece (`out` is bytes `start..start + out.len()` of the whole) straight into the
    /// pinned staging half the piece goes through: a conversion of the data on its way up
    /// (decimals narrowed to 64 bits) costs no copy of its own.
    pub(crate) fn write_with(
        &self,
        buffer: &DeviceBuffer,
        offset: usize,
        len: usize,
        fill: &dyn Fn(usize, &mut [u8]),
    ) -> Result<()> {
        Self::within(buffer, offset, len, "into")?;
        self.usable()?;
        self.after([buffer.stream])?;
        let stream = self.current();
        // The ring's lock is held for the whole upload, waits included: no other upload
        // fills a half this one is about to refill.
        let mut ring = self.uploads();
        for k in 0..len.div_ceil(UPLOAD_HALF_BYTES) {
            let start = k * UPLOAD_HALF_BYTES;
            let piece_len = UPLOAD_HALF_BYTES.min(len - start);
            if ring.fill + piece_len > UPLOAD_HALF_BYTES {
                let other = ring.half ^ 1;
                // The other half's copies may still be running on some stream: wait for
                // each such stream.
                for (index, &last) in ring.last[other].iter().enumerate() {
                    let stream = self.inner.stream(index);
                    if stream.passed() < last {
                        self.record(DeviceCounts {
                            syncs: 1,
                            ..DeviceCounts::default()
                        });
                        self.wait_on(&stream)?;
                    }
                }
                ring.last[other].clear();
                ring.half = other;
                ring.fill = 0;
            }
            self.record(DeviceCounts {
                h2d_copies: 1,
                h2d_bytes: piece_len as u64,
                ..DeviceCounts::default()
            });
            let at = offset + start;
            match &self.inner.backend {
                Backend::Emulated(_) => {
                    // As a driver stages pageable memory: the bytes are taken at enqueue.
                    let mut bytes = vec![0; piece_len];
                    fill(start, &mut bytes);
                    self.enqueue(Op::Write {
                        addr: buffer.addr,
                        offset: at,
                        bytes,
                    })
                }
                Backend::Cuda(cuda) => cuda
                    .stage_write(
                        stream.index,
                        ring.half,
                        ring.fill,
                        buffer.addr + at as u64,
                        piece_len,
                        &|out| fill(start, out),
                    )
                    .map(|()| {
                        stream.queued();
                    })
                    .map_err(|e| self.lost(e)),
            }?;
            let (half, me, op) = (ring.half, stream.index, stream.enqueued());
            let last = &mut ring.last[half];
            if last.len() <= me {
                last.resize(me + 1, 0);
            }
            last[me] = op;
            ring.fill += piece_len;
        }
        Ok(())
    }

    /// Reads `out.len()` bytes of `buffer` from `offset` (see [`Self::read_at`]).
    pub(crate) fn read(&self, buffer: &DeviceBuffer, offset: usize, out: &mut [u8]) -> Result<()> {
        self.read_at(&mut [(buffer, offset, out)])
    }

    /// Reads several buffers (the first `out.len()` bytes of each) in as few host waits as
    /// the staging buffer allows (see [`Self::read_at`]): the columns of a batch come down
    /// in one wait.
    pub(crate) fn read_many(&self, reads: &mut [(&DeviceBuffer, &mut [u8])]) -> Result<()> {
        let mut at: Vec<(&DeviceBuffer, usize, &mut [u8])> = reads
            .iter_mut()
            .map(|(b, out)| (*b, 0, &mut **out))
            .collect();
        self.read_at(&mut at)
    }

    /// Reads `out.len()` bytes of each buffer from its offset (see [`Self::read_at`]).
    pub(crate) fn read_ranges(
        &self,
        reads: &mut [(&DeviceBuffer, usize, &mut [u8])],
    ) -> Result<()> {
        self.read_at(reads)
    }

    /// Reads `out.len()` bytes of each buffer from its offset: the copies are queued back
    /// to back into the staging buffer and the host waits once per [`STAGING_BYTES`] they
    /// fill (a read larger than what is left of a fill goes on into the next), once the
    /// stream has run everything queued before. Counted as the pieces copied and the waits.
    fn read_at(&self, reads: &mut [(&DeviceBuffer, usize, &mut [u8])]) -> Result<()> {
        for (buffer, offset, out) in reads.iter() {
            if buffer.device() != self {
                return Err(KernelError::Unsupported(format!(
                    "a read on {self} of a buffer on {}",
                    buffer.device()
                )));
            }
            Self::within(buffer, *offset, out.len(), "out of")?;
        }
        self.usable()?;
        self.after(reads.iter().map(|(b, ..)| b.stream))?;
        let stream = self.current();
        let fills = staging_fills(reads.iter().map(|(_, _, out)| out.len()));
        if fills.is_empty() {
            // No copy, so no wait: nothing may be taken as passed.
            return Ok(());
        }
        self.record(DeviceCounts {
            d2h_copies: fills.iter().map(|f| f.len() as u64).sum(),
            d2h_bytes: reads.iter().map(|(_, _, out)| out.len() as u64).sum(),
            syncs: fills.len() as u64,
            ..DeviceCounts::default()
        });
        let through = stream.enqueued();
        match &self.inner.backend {
            // The host reads once the stream has run everything queued before the reads,
            // and before anything queued after them.
            Backend::Emulated(memory) => stream
                .queue
                .run_then(memory, &self.to_string(), || {
                    for (buffer, offset, out) in reads.iter_mut() {
                        if !out.is_empty() {
                            memory.read(buffer.addr, *offset, out)?;
                        }
                    }
                    Ok(())
                })
                .map_err(|e| self.sticky(e)),
            Backend::Cuda(cuda) => cuda.read_many(stream.index, &fills, reads),
        }
        .map_err(|e| self.lost(e))?;
        self.passed(&stream, through);
        Ok(())
    }

    /// Copies all of `src` into the start of `dst` (both on this device).
    pub fn copy(&self, dst: &DeviceBuffer, src: &DeviceBuffer) -> Result<()> {
        self.copy_into(dst, 0, src, src.len)
    }

    /// Copies the first `len` bytes of `src` into `dst` from byte `at` on (both on this
    /// device).
    pub fn copy_into(
        &self,
        dst: &DeviceBuffer,
        at: usize,
        src: &DeviceBuffer,
        len: usize,
    ) -> Result<()> {
        if src.len < len || at.checked_add(len).is_none_or(|end| end > dst.len) {
            return Err(KernelError::Unsupported(format!(
                "copy of {len} of {} bytes into {} from byte {at}",
                src.len, dst.len
            )));
        }
        self.usable()?;
        self.after([dst.stream, src.stream])?;
        let stream = self.current();
        self.record(DeviceCounts {
            d2d_copies: 1,
            d2d_bytes: len as u64,
            ..DeviceCounts::default()
        });
        match &self.inner.backend {
            Backend::Emulated(_) => self.enqueue(Op::Copy {
                dst: dst.addr,
                at,
                src: src.addr,
                len,
            }),
            Backend::Cuda(cuda) => cuda
                .copy(stream.index, dst.addr + at as u64, src.addr, len)
                .map(|()| {
                    stream.queued();
                })
                .map_err(|e| self.lost(e)),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StagedPiece {
    pub read: usize,
    pub from: usize,
    pub len: usize,
    pub at: usize,
}

/// How reads of these lengths pack into fills of the staging buffer, in order (empty
/// reads take no piece; no fill is empty).
pub(crate) fn staging_fills(lens: impl Iterator<Item = usize>) -> Vec<Vec<StagedPiece>> {
    let mut fills: Vec<Vec<StagedPiece>> = Vec::new();
    let mut used = STAGING_BYTES;
    for (read, len) in lens.enumerate() {
        let mut from = 0;
        while from < len {
            if used == STAGING_BYTES {
                fills.push(Vec::new());
                used = 0;
            }
            let take = (len - from).min(STAGING_BYTES - used);
            let fill = fills.last_mut().expect("a fill was just started");
            fill.push(StagedPiece {
                read,
                from,
                len: take,
                at: used,
            });
            from += take;
            used += take;
        }
    }
    fills
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_pack_into_as_few_fills_as_the_staging_buffer_allows() {
        assert!(staging_fills([0, 0].into_iter()).is_empty());
        let small = staging_fills([100, 0, 28].into_iter());
        assert_eq!(small.len(), 1);
        assert_eq!(small[0].len(), 2);
        assert_eq!(
            small[0][1],
            StagedPiece {
                read: 2,
                from: 0,
                len: 28,
                at: 100
            }
        );
        // A read that does not fit what is left goes on into the next fill.
        let s = STAGING_BYTES;
        let big = staging_fills([s - 10, 30, 2 * s].into_iter());
        assert_eq!(big.len(), 4);
        assert_eq!(
            big[0][1],
            StagedPiece {
                read: 1,
                from: 0,
                len: 10,
                at: s - 10
            }
        );
        assert_eq!(
            big[1][0],
            StagedPiece {
                read: 1,
                from: 10,
                len: 20,
                at: 0
            }
        );
        assert_eq!(
            big[1][1],
            StagedPiece {
                read: 2,
                from: 0,
                len: s - 20,
                at: 20
            }
        );
        assert_eq!(
            big[3][0],
            StagedPiece {
                read: 2,
                from: 2 * s - 20,
                len: 20,
                at: 0
            }
        );
        let total: usize = big.iter().flatten().map(|p| p.len).sum();
        assert_eq!(total, 3 * s + 20);
    }
}
