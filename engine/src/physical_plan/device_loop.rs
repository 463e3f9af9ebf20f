//! The one loop every GPU operator runs its input through (the filter and projection
//! stream, the aggregate, the join's probe, on the device or assembled on the host):
//!
//! ```text
//!   input ─▶ DeviceBatches: coalesce to fulmen.gpu.batch_bytes/_rows ─▶ one_chunk
//!         ─▶ run_pieces: the batch, or its halves when the device has no memory for it
//!              ├─ PieceWork::run_on_device ─▶ Out ..................... gpu_batches
//!              ├─ "left to the CPU" by a rule ─▶ run_on_cpu ........... cpu_rule_batches
//!              └─ device error ─▶ recover (or fail, by fulmen.gpu.on_error)
//!                   ├─ ON_FAILURE = Some: that piece ─▶ run_on_cpu ...... cpu_batches
//!                   └─ ON_FAILURE = None: stop; the operator takes the rest to the CPU
//! ```
//!
//! Coalescing and splitting are [`Coalescer`] and [`Pieces`] (`coalesce.rs`); an operator
//! brings only its device work and its CPU twin ([`PieceWork`]). An operator that holds
//! device state across batches (the aggregate's group table) cannot take one piece to the
//! CPU alone: at a device failure the loop stops and hands back what was not run
//! ([`Stopped::Device`]), and the operator finishes on the CPU from there.

use std::collections::VecDeque;

use datafusion::arrow::compute::concat_batches;
use datafusion::common::internal_datafusion_err;
use datafusion::error::{DataFusionError, Result};
use fulmen_kernels::KernelError;
use futures::{Stream, StreamExt};

use super::coalesce::{BatchLimit, Coalescer, Pending, Pieces};
use super::gpu_stream::{BatchOn, Chunk, GpuMetrics, count_batch};

/// Input waiting to make up device batches, and the device batches it has made up, oldest
/// first.
#[derive(Debug)]
pub struct DeviceBatches<T> {
    pending: Coalescer<T>,
    ready: VecDeque<Vec<T>>,
    ended: bool,
}

impl<T: Pending> DeviceBatches<T> {
    /// Nothing waiting, batches closed at `limit`.
    pub fn new(limit: BatchLimit) -> Self {
        Self {
            pending: Coalescer::new(limit),
            ready: VecDeque::new(),
            ended: false,
        }
    }

    /// Adds `next`: what waited becomes a device batch first when `next` cannot join it
    /// (another schema, or a chunk that goes alone), and what waits becomes one when full.
    /// An item without rows is dropped: it costs the device nothing.
    pub fn push(&mut self, next: T) {
        if next.rows() == 0 {
            return;
        }
        if self.pending.closes_before(&next) {
            self.ready.push_back(self.pending.take());
        }
        self.pending.push(next);
        if self.pending.is_full() {
            self.ready.push_back(self.pending.take());
        }
    }

    /// The input has ended: what waits is the last device batch.
    pub fn finish(&mut self) {
        self.ended = true;
        if !self.pending.is_empty() {
            self.ready.push_back(self.pending.take());
        }
    }

    /// The oldest device batch made up.
    pub fn pop(&mut self) -> Option<Vec<T>> {
        self.ready.pop_front()
    }

    /// Everything not run yet, in order: the batches made up, then what waits (for an
    /// operator that stops and goes on on the CPU).
    pub fn drain(&mut self) -> Vec<T> {
        let mut rest: Vec<T> = self.ready.drain(..).flatten().collect();
        rest.extend(self.pending.take());
        rest
    }

    /// The next device batch of `input` (each item made a `T` by `item`); `None` once the
    /// input has ended and everything has been handed out.
    pub async fn next_from<I, S>(
        &mut self,
        input: &mut S,
        mut item: impl FnMut(I) -> T,
    ) -> Result<Option<Vec<T>>>
    where
        S: Stream<Item = Result<I>> + Unpin,
    {
        loop {
            if let Some(batch) = self.pop() {
                return Ok(Some(batch));
            }
            if self.ended {
                return Ok(None);
            }
            match input.next().await {
                Some(next) => self.push(item(next?)),
                None => self.finish(),
            }
        }
    }
}

/// One chunk of a device batch's items: a chunk that went alone as it is, host batches
/// concatenated (under the first one's schema: all share it, see
/// [`Coalescer::closes_before`]).
pub fn one_chunk<T: Into<Chunk>>(items: Vec<T>) -> Result<Chunk> {
    let mut chunks: Vec<Chunk> = items.into_iter().map(Into::into).collect();
    if chunks.len() <= 1 {
        return chunks
            .pop()
            .ok_or_else(|| internal_datafusion_err!("an empty device batch"));
    }
    let batches = chunks
        .into_iter()
        .map(|c| match c {
            Chunk::Host(b) => Ok(b),
            Chunk::Device(..) => Err(internal_datafusion_err!(
                "a device chunk was coalesced with others"
            )),
        })
        .collect::<Result<Vec<_>>>()?;
    concat_batches(&batches[0].schema(), &batches)
        .map(Chunk::Host)
        .map_err(|e| DataFusionError::ArrowError(Box::new(e), None))
}

/// Why a piece's work failed: the device (the loop splits the piece or goes to the CPU),
/// or DataFusion's own evaluation (the query fails, as it would on the CPU).
#[derive(Debug)]
pub enum PieceError {
    /// The device failed (a fault, exhausted memory).
    Device(KernelError),
    /// The query failed.
    Query(DataFusionError),
}

impl From<KernelError> for PieceError {
    fn from(e: KernelError) -> Self {
        Self::Device(e)
    }
}

impl From<DataFusionError> for PieceError {
    fn from(e: DataFusionError) -> Self {
        Self::Query(e)
    }
}

/// What the device made of a piece.
#[derive(Debug)]
pub enum OnDevice<T> {
    /// Its output.
    Out(T),
    /// Nothing: a rule leaves the piece to the CPU (a program met a row it cannot compute
    /// as DataFusion does, such as a division by zero).
    ByRule,
    /// Nothing: the operator has given the device up for this partition (its join table
    /// could not be built), and the piece is the CPU's, as a fallback already recovered
    /// from.
    GivenUp,
}

/// A GPU operator's work on the pieces of its device batches.
pub trait PieceWork {
    /// What one piece makes.
    type Out;
    /// What the operator does after a device failure, for the log (`"redoing a batch on the
    /// CPU"`); `None` when it cannot take one piece to the CPU alone (the loop stops, see
    /// [`Stopped::Device`]).
    const ON_FAILURE: Option<&'static str>;

    /// The operator's metrics (batch counts, splits, device errors).
    fn metrics(&self) -> &GpuMetrics;

    /// Runs `piece` on the device.
    fn run_on_device(&mut self, piece: &Chunk) -> Result<OnDevice<Self::Out>, PieceError>;

    /// Runs `piece` on the CPU (`on`: by rule, or as a fallback).
    fn run_on_cpu(&mut self, piece: &Chunk, on: BatchOn) -> Result<Self::Out, PieceError>;
}

/// Why [`run_pieces`] stopped before the end of a device batch.
#[derive(Debug)]
pub enum Stopped {
    /// The query fails.
    Query(DataFusionError),
    /// The device failed for an operator without a CPU path per piece; `rest` is what was
    /// not run, in order (the failed piece first).
    Device {
        /// The failure.
        error: KernelError,
        /// The pieces not run.
        rest: Vec<Chunk>,
    },
}

impl From<Stopped> for DataFusionError {
    fn from(stopped: Stopped) -> Self {
        match stopped {
            Stopped::Query(e) => e,
            Stopped::Device { error, .. } => DataFusionError::External(Box::new(error)),
        }
    }
}

/// Runs one device batch, `chunk`, through `work`: on the device, in halves when the device
/// has no memory for it (see [`Pieces`]), a piece on the CPU when a rule or a device failure
/// sends it there; each piece counted where it ran. The outputs come in row order.
pub fn run_pieces<W: PieceWork>(work: &mut W, chunk: Chunk) -> Result<Vec<W::Out>, Stopped> {
    let mut outputs = Vec::new();
    let mut pieces = Pieces::new(chunk, &work.metrics().split_batches);
    while let Some(piece) = pieces.next() {
        let on = match work.run_on_device(&piece) {
            Ok(OnDevice::Out(out)) => {
                count_batch(work.metrics(), BatchOn::Device);
                outputs.push(out);
                continue;
            }
            Ok(OnDevice::ByRule) => BatchOn::Rule,
            Ok(OnDevice::GivenUp) => BatchOn::Fallback,
            Err(PieceError::Query(e)) => return Err(Stopped::Query(e)),
            Err(PieceError::Device(e)) if pieces.split(&piece, &e) => continue,
            Err(PieceError::Device(error)) => match W::ON_FAILURE {
                Some(doing) => {
                    work.metrics()
                        .recover(&error, doing)
                        .map_err(Stopped::Query)?;
                    BatchOn::Fallback
                }
                None => {
                    return Err(Stopped::Device {
                        error,
                        rest: pieces.rest(piece),
                    });
                }
            },
        };
        match work.run_on_cpu(&piece, on) {
            Ok(out) => {
                count_batch(work.metrics(), on);
                outputs.push(out);
            }
            Err(PieceError::Query(e)) => {
                // It went to the CPU, where DataFusion's evaluation fails the query.
                count_batch(work.metrics(), on);
                return Err(Stopped::Query(e));
            }
            // The CPU path's own device work (the aggregate uploads what DataFusion
            // computed) has no memory for the piece: its halves go to the device again.
            Err(PieceError::Device(e)) if pieces.split(&piece, &e) => continue,
            Err(PieceError::Device(error)) => {
                return Err(match W::ON_FAILURE {
                    Some(_) => {
                        count_batch(work.metrics(), on);
                        Stopped::Query(DataFusionError::External(Box::new(error)))
                    }
                    // Not counted: the operator takes it to the CPU with the rest.
                    None => Stopped::Device {
                        error,
                        rest: pieces.rest(piece),
                    },
                });
            }
        }
    }
    Ok(outputs)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use datafusion::arrow::array::{Int64Array, RecordBatch};
    use datafusion::arrow::datatypes::{DataType, Field, Schema};
    use datafusion::execution::TaskContext;
    use datafusion::physical_plan::metrics::ExecutionPlanMetricsSet;
    use fulmen_kernels::{Device, EmulatorOptions};

    use super::*;

    fn ints(from: i64, n: usize) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, false)]));
        let values = Int64Array::from_iter_values(from..from + n as i64);
        RecordBatch::try_new(schema, vec![Arc::new(values)]).unwrap()
    }

    fn first_value(chunk: &Chunk) -> i64 {
        match chunk {
            Chunk::Host(b) => b
                .column(0)
                .as_any()
                .downcast_ref::<Int64Array>()
                .unwrap()
                .value(0),
            Chunk::Device(..) => panic!("a device chunk"),
        }
    }

    #[tokio::test]
    async fn device_batches_close_at_the_limit_and_at_another_schema_and_end_with_the_rest() {
        let mut batches = DeviceBatches::new(BatchLimit::new(20, 1 << 30));
        let nullable = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, true)]));
        let other =
            RecordBatch::try_new(nullable, vec![Arc::new(Int64Array::from(vec![100, 101]))])
                .unwrap();
        let input = vec![
            ints(0, 8),
            ints(8, 0),
            ints(8, 8),
            ints(16, 8),
            ints(24, 8),
            other,
            ints(50, 3),
        ];
        let mut stream = futures::stream::iter(input.into_iter().map(Ok));
        let mut sizes = Vec::new();
        while let Some(items) = batches.next_from(&mut stream, |b| b).await.unwrap() {
            let chunk = one_chunk(items).unwrap();
            sizes.push((chunk.num_rows(), first_value(&chunk)));
        }
        // 24 rows reach the limit of 20; the other schema closes 8; the last 3 at the end.
        assert_eq!(sizes, [(24, 0), (8, 24), (2, 100), (3, 50)]);
        // Nothing more once the input has ended.
        assert!(
            batches
                .next_from(&mut stream, |b| b)
                .await
                .unwrap()
                .is_none()
        );

        // What was not run, in order, for an operator that stops.
        let mut batches = DeviceBatches::new(BatchLimit::new(10, 1 << 30));
        for from in [0, 8, 16] {
            batches.push(ints(from, 8));
        }
        let first = batches.pop().unwrap();
        assert_eq!(first.len(), 2);
        let rest: Vec<usize> = batches.drain().iter().map(RecordBatch::num_rows).collect();
        assert_eq!(rest, [8]);
        assert!(batches.pop().is_none());
    }

    /// Runs pieces of `ints` rows: the device has no memory for more than `fits` rows, a
    /// piece starting at `by_rule` is left to the CPU, one starting at `faulty` fails.
    struct Work {
        metrics: GpuMetrics,
        fits: usize,
        by_rule: i64,
        faulty: i64,
        /// The CPU path's own device work has no memory for more rows than this.
        cpu_fits: usize,
        ran: Vec<(i64, usize, &'static str)>,
    }

    fn fault(what: &'static str) -> KernelError {
        KernelError::InjectedFault {
            device: "emulated:0".into(),
            what,
            number: 1,
        }
    }

    /// The device's (emulated) answer to `piece` when it has room for `fits` rows.
    fn no_memory(piece: &Chunk, fits: usize) -> Result<(), PieceError> {
        match piece.num_rows() > fits {
            true => Err(PieceError::Device(KernelError::OutOfDeviceMemory {
                device: "emulated:0".into(),
                requested: piece.num_rows(),
                in_use: 0,
                budget: fits,
            })),
            false => Ok(()),
        }
    }

    impl Work {
        fn new(fits: usize, by_rule: i64, faulty: i64) -> Self {
            let device = Device::emulated(0, &EmulatorOptions::default());
            let metrics = GpuMetrics::new(
                &ExecutionPlanMetricsSet::new(),
                0,
                &device,
                &TaskContext::default(),
            );
            Self {
                metrics,
                fits,
                by_rule,
                faulty,
                cpu_fits: usize::MAX,
                ran: Vec::new(),
            }
        }

        fn device(&mut self, piece: &Chunk) -> Result<OnDevice<i64>, PieceError> {
            let first = first_value(piece);
            no_memory(piece, self.fits)?;
            if first == self.faulty {
                return Err(PieceError::Device(fault("launch")));
            }
            if first == self.by_rule {
                return Ok(OnDevice::ByRule);
            }
            self.ran.push((first, piece.num_rows(), "device"));
            Ok(OnDevice::Out(first))
        }

        fn cpu(&mut self, piece: &Chunk, on: BatchOn) -> Result<i64, PieceError> {
            no_memory(piece, self.cpu_fits)?;
            let on = match on {
                BatchOn::Rule => "rule",
                BatchOn::Fallback => "fallback",
                BatchOn::Device => "device?",
            };
            self.ran.push((first_value(piece), piece.num_rows(), on));
            Ok(-first_value(piece))
        }
    }

    /// `Work` for an operator with a CPU path per piece (`STOPS` false) or without one.
    struct Loop<const STOPS: bool>(Work);

    impl<const STOPS: bool> PieceWork for Loop<STOPS> {
        type Out = i64;
        const ON_FAILURE: Option<&'static str> = match STOPS {
            true => None,
            false => Some("redoing a piece on the CPU"),
        };
        fn metrics(&self) -> &GpuMetrics {
            &self.0.metrics
        }
        fn run_on_device(&mut self, piece: &Chunk) -> Result<OnDevice<i64>, PieceError> {
            self.0.device(piece)
        }
        fn run_on_cpu(&mut self, piece: &Chunk, on: BatchOn) -> Result<i64, PieceError> {
            self.0.cpu(piece, on)
        }
    }

    fn counts(m: &GpuMetrics) -> [usize; 4] {
        [
            m.gpu_batches.value(),
            m.split_batches.value(),
            m.cpu_rule_batches.value(),
            m.cpu_batches.value(),
        ]
    }

    #[test]
    fn pieces_split_when_the_device_has_no_memory_and_go_to_the_cpu_by_rule_or_failure() {
        // 32 768 rows, room for 8 192: halves, then quarters; the quarter at 16 384 is left
        // to the CPU by rule, the one at 24 576 fails and is redone there.
        let mut work = Loop::<false>(Work::new(8192, 16384, 24576));
        let out = run_pieces(&mut work, Chunk::Host(ints(0, 32768))).unwrap();
        assert_eq!(out, [0, 8192, -16384, -24576]);
        assert_eq!(
            work.0.ran,
            [
                (0, 8192, "device"),
                (8192, 8192, "device"),
                (16384, 8192, "rule"),
                (24576, 8192, "fallback"),
            ]
        );
        // Device, split, by rule, fallback.
        assert_eq!(counts(&work.0.metrics), [2, 3, 1, 1]);

        // A piece that cannot be split further goes to the CPU.
        let mut work = Loop::<false>(Work::new(1000, -1, -1));
        let out = run_pieces(&mut work, Chunk::Host(ints(0, 5000))).unwrap();
        assert_eq!(out, [0]);
        assert_eq!(work.0.ran, [(0, 5000, "fallback")]);
        assert_eq!(counts(&work.0.metrics), [0, 0, 0, 1]);
    }

    #[test]
    fn an_operator_without_a_cpu_path_per_piece_stops_with_what_was_not_run() {
        let mut work = Loop::<true>(Work::new(8192, 16384, 8192));
        let Err(Stopped::Device { error, rest }) =
            run_pieces(&mut work, Chunk::Host(ints(0, 32768)))
        else {
            panic!("the loop went on after a device failure");
        };
        assert!(matches!(error, KernelError::InjectedFault { .. }));
        // The failed quarter, then the half not started, in row order.
        let rest: Vec<(i64, usize)> = rest
            .iter()
            .map(|c| (first_value(c), c.num_rows()))
            .collect();
        assert_eq!(rest, [(8192, 8192), (16384, 16384)]);
        assert_eq!(work.0.ran, [(0, 8192, "device")]);
        assert_eq!(counts(&work.0.metrics), [1, 2, 0, 0]);

        // A rule still sends a piece to the CPU path, which such an operator has for it.
        let mut work = Loop::<true>(Work::new(1 << 20, 0, -1));
        assert_eq!(
            run_pieces(&mut work, Chunk::Host(ints(0, 10))).unwrap(),
            [0]
        );
        assert_eq!(work.0.ran, [(0, 10, "rule")]);

        // A piece whose CPU path has no device memory for it is split too, and its halves
        // go to the device again (counted once each, where they ran).
        let mut work = Loop::<true>(Work::new(1 << 20, 0, -1));
        work.0.cpu_fits = 8192;
        assert_eq!(
            run_pieces(&mut work, Chunk::Host(ints(0, 16384))).unwrap(),
            [0, 8192]
        );
        assert_eq!(work.0.ran, [(0, 8192, "rule"), (8192, 8192, "device")]);
        assert_eq!(counts(&work.0.metrics), [1, 1, 1, 0]);
    }
}
