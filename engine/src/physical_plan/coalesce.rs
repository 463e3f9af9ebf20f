//! How host batches become device batches, for every GPU operator's input loop (the
//! filter and projection stream, the aggregate's run, the join's probe): DataFusion's
//! batches (8 192 rows by default) wait until they hold `fulmen.gpu.batch_bytes` of column
//! data or `fulmen.gpu.batch_rows` rows, whichever comes first, and go to the device as one.
//! A device batch's fixed cost (launches, waits, descriptor uploads) is paid per batch, so a
//! batch is sized by what it moves: a narrow input makes batches of many rows, a wide one
//! batches of fewer.
//!
//! A batch whose schema differs from the waiting ones' (DataFusion's streams may vary in
//! field metadata or nullability) closes the waiting batch first; a device chunk (a GPU
//! child's output) goes on alone; one host batch larger than the limit is not cut here. A
//! host batch the device runs out of memory for is split in halves ([`Pieces`]), down to
//! [`MIN_SPLIT_ROWS`]; a piece that still fails goes to the operator's CPU path. Every GPU
//! operator (the filter and projection stream, the aggregate, the join's probe) runs both
//! through one loop, `device_loop.rs`; the cache's loader sizes its chunks here too.

use std::collections::VecDeque;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, RecordBatch};
use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::physical_plan::metrics::Count;
use fulmen_kernels::KernelError;

use super::gpu_stream::Chunk;

/// The smallest piece a batch that does not fit in device memory is split into.
pub const MIN_SPLIT_ROWS: usize = 4096;

/// The two halves of a host chunk the device had no memory for, when it is long enough to
/// split (`None` for a device chunk or one of fewer than 2 × [`MIN_SPLIT_ROWS`] rows: it
/// goes to the CPU instead).
pub fn halves(chunk: &Chunk) -> Option<[Chunk; 2]> {
    match chunk {
        Chunk::Host(b) if b.num_rows() >= 2 * MIN_SPLIT_ROWS => {
            let half = b.num_rows() / 2;
            Some([
                Chunk::Host(b.slice(0, half)),
                Chunk::Host(b.slice(half, b.num_rows() - half)),
            ])
        }
        _ => None,
    }
}

/// The pieces of one device batch, in order: the batch itself at first; a host piece the
/// device had no memory for is replaced by its two halves (see [`halves`]), which run next.
/// The loop every GPU operator shares runs through this (`device_loop::run_pieces`):
///
/// ```text
/// while let Some(piece) = pieces.next() {
///     match on_device(&piece) {
///         Ok(out) => …,
///         Err(e) if pieces.split(&piece, &e) => continue,  // its halves come next
///         Err(e) => … the piece on the CPU, or stop and keep pieces.rest(piece)
///     }
/// }
/// ```
pub struct Pieces {
    waiting: VecDeque<Chunk>,
    split: Count,
}

impl Pieces {
    /// The pieces of `chunk`; each split is counted in `split` (an operator's
    /// `split_batches`).
    pub fn new(chunk: Chunk, split: &Count) -> Self {
        Self {
            waiting: VecDeque::from([chunk]),
            split: split.clone(),
        }
    }

    /// After `piece` failed with `error`: when the device ran out of memory and the piece
    /// is long enough, its halves are the next pieces, and this says true; otherwise the
    /// failure is the caller's.
    pub fn split(&mut self, piece: &Chunk, error: &KernelError) -> bool {
        if !matches!(error, KernelError::OutOfDeviceMemory { .. }) {
            return false;
        }
        let Some([first, second]) = halves(piece) else {
            return false;
        };
        log::debug!(
            "splitting a device batch of {} rows: {error}",
            piece.num_rows()
        );
        self.split.add(1);
        self.waiting.push_front(second);
        self.waiting.push_front(first);
        true
    }

    /// `piece` and the pieces not run yet, in order (for a caller that stops at a failure).
    pub fn rest(mut self, piece: Chunk) -> Vec<Chunk> {
        self.waiting.push_front(piece);
        self.waiting.into()
    }
}

/// The next piece to run (a split's halves come before the pieces that waited).
impl Iterator for Pieces {
    type Item = Chunk;

    fn next(&mut self) -> Option<Chunk> {
        self.waiting.pop_front()
    }
}

use crate::FulmenConfig;

/// The size at which waiting host batches go to the device as one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimit {
    /// Rows (at least 1).
    pub rows: usize,
    /// Bytes of column data, as Arrow holds them on the host (at least 1).
    pub bytes: usize,
}

impl BatchLimit {
    /// A limit of `rows` rows or `bytes` bytes, whichever is reached first.
    pub fn new(rows: usize, bytes: usize) -> Self {
        Self {
            rows: rows.max(1),
            bytes: bytes.max(1),
        }
    }

    /// The session's `fulmen.gpu.batch_rows` and `fulmen.gpu.batch_bytes`.
    pub fn of(config: &FulmenConfig) -> Self {
        Self::new(config.gpu_batch_rows, config.gpu_batch_bytes)
    }
}

/// What waits to make up a device batch: a host batch or a chunk.
pub trait Pending {
    /// Rows.
    fn rows(&self) -> usize;
    /// Bytes of column data on the host (0 for a device chunk, which goes on alone).
    fn bytes(&self) -> usize;
    /// The schema its rows have.
    fn schema(&self) -> SchemaRef;
    /// Whether it goes to the device on its own, never merged with others.
    fn alone(&self) -> bool {
        false
    }
}

/// The bytes of a batch's column data: the slices of the buffers its rows use (a slice of a
/// larger batch counts its own rows, not the whole buffers).
pub fn host_bytes(batch: &RecordBatch) -> usize {
    batch.columns().iter().map(column_bytes).sum()
}

/// The bytes of one column's rows. A string or binary view counts its 16-byte views and the
/// bytes of the values longer than 12 (kept out of line), which Arrow's slice size leaves
/// out but an upload moves.
pub fn column_bytes(column: &ArrayRef) -> usize {
    let slice = column
        .to_data()
        .get_slice_memory_size()
        .unwrap_or_else(|_| column.get_array_memory_size());
    let out_of_line = |views: &[u128]| -> usize {
        views
            .iter()
            .map(|&v| v as u32 as usize)
            .filter(|&len| len > 12)
            .sum()
    };
    slice
        + match column.data_type() {
            DataType::Utf8View => out_of_line(column.as_string_view().views()),
            DataType::BinaryView => out_of_line(column.as_binary_view().views()),
            _ => 0,
        }
}

impl Pending for RecordBatch {
    fn rows(&self) -> usize {
        self.num_rows()
    }

    fn bytes(&self) -> usize {
        host_bytes(self)
    }

    fn schema(&self) -> SchemaRef {
        RecordBatch::schema(self)
    }
}

/// A host batch of which only some columns go to the device (a join's probe keys): sized
/// by those.
#[derive(Debug)]
pub struct PartlyUploaded {
    /// The batch.
    pub batch: RecordBatch,
    bytes: usize,
}

impl PartlyUploaded {
    /// `batch`, of which `columns` go to the device.
    pub fn new(batch: RecordBatch, columns: &[usize]) -> Self {
        let bytes = columns.iter().map(|&c| column_bytes(batch.column(c))).sum();
        Self { batch, bytes }
    }
}

impl From<PartlyUploaded> for Chunk {
    fn from(p: PartlyUploaded) -> Self {
        Chunk::Host(p.batch)
    }
}

impl Pending for PartlyUploaded {
    fn rows(&self) -> usize {
        self.batch.num_rows()
    }

    fn bytes(&self) -> usize {
        self.bytes
    }

    fn schema(&self) -> SchemaRef {
        self.batch.schema()
    }
}

impl Pending for Chunk {
    fn rows(&self) -> usize {
        self.num_rows()
    }

    fn bytes(&self) -> usize {
        match self {
            Chunk::Host(b) => host_bytes(b),
            Chunk::Device(..) => 0,
        }
    }

    fn schema(&self) -> SchemaRef {
        Chunk::schema(self)
    }

    fn alone(&self) -> bool {
        matches!(self, Chunk::Device(..))
    }
}

/// Host batches (or chunks) waiting to make up one device batch, with their rows and bytes.
#[derive(Debug)]
pub struct Coalescer<T> {
    limit: BatchLimit,
    waiting: Vec<T>,
    rows: usize,
    bytes: usize,
}

impl<T: Pending> Coalescer<T> {
    /// Nothing waiting yet.
    pub fn new(limit: BatchLimit) -> Self {
        Self {
            limit,
            waiting: Vec::new(),
            rows: 0,
            bytes: 0,
        }
    }

    /// Whether what waits must go to the device before `next` joins it: `next` goes on
    /// alone, or has another schema.
    pub fn closes_before(&self, next: &T) -> bool {
        !self.waiting.is_empty()
            && (next.alone()
                || self.waiting[0].alone()
                || self.waiting[0].schema() != next.schema())
    }

    /// Adds `next` (after [`Self::closes_before`] has been honoured).
    pub fn push(&mut self, next: T) {
        self.rows += next.rows();
        self.bytes += next.bytes();
        self.waiting.push(next);
    }

    /// Whether what waits makes up a device batch: a chunk that goes alone, or the limit
    /// reached in rows or bytes.
    pub fn is_full(&self) -> bool {
        self.waiting.first().is_some_and(Pending::alone)
            || self.rows >= self.limit.rows
            || self.bytes >= self.limit.bytes
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// The rows waiting.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The bytes waiting.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Takes what waits, leaving nothing.
    pub fn take(&mut self) -> Vec<T> {
        self.rows = 0;
        self.bytes = 0;
        std::mem::take(&mut self.waiting)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use datafusion::arrow::array::{Int32Array, Int64Array, StringArray, StringViewArray};
    use datafusion::arrow::datatypes::{DataType, Field, Schema};

    use super::*;

    fn ints(n: usize) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, false)]));
        let values = Int64Array::from_iter_values(0..n as i64);
        RecordBatch::try_new(schema, vec![Arc::new(values)]).unwrap()
    }

    #[test]
    fn a_batch_counts_the_bytes_of_its_own_rows() {
        let batch = ints(1000);
        assert_eq!(host_bytes(&batch), 8000);
        // A slice counts its rows, not the buffer it shares.
        assert_eq!(host_bytes(&batch.slice(100, 10)), 80);
        let schema = Arc::new(Schema::new(vec![
            Field::new("s", DataType::Utf8, true),
            Field::new("i", DataType::Int32, true),
        ]));
        let s = StringArray::from(vec![Some("abc"), None, Some("de")]);
        let i = Int32Array::from(vec![Some(1), None, Some(3)]);
        let batch = RecordBatch::try_new(schema, vec![Arc::new(s), Arc::new(i)]).unwrap();
        // Strings: 4 offsets, 5 bytes, a validity byte; ints: 12 bytes and a validity byte.
        assert_eq!(host_bytes(&batch), 16 + 5 + 1 + 12 + 1);
        // Views: 16 bytes each, and the values longer than 12 bytes, which live apart.
        let long = "a string longer than twelve bytes";
        let views: ArrayRef = Arc::new(StringViewArray::from(vec![long, "short", long]));
        assert_eq!(column_bytes(&views), 3 * 16 + 2 * long.len());
        assert_eq!(column_bytes(&views.slice(1, 1)), 16);
    }

    #[test]
    fn the_first_limit_reached_closes_a_device_batch() {
        // 8 192 rows of 8 bytes are 64 KiB: a 100 KiB limit fills after two batches.
        let mut by_bytes = Coalescer::new(BatchLimit::new(1 << 30, 100 << 10));
        by_bytes.push(ints(8192));
        assert!(!by_bytes.is_full());
        by_bytes.push(ints(8192));
        assert!(by_bytes.is_full());
        assert_eq!(by_bytes.rows(), 16384);
        assert_eq!(by_bytes.take().len(), 2);
        assert!(by_bytes.is_empty() && by_bytes.rows() == 0);
        // The row limit, when it comes first.
        let mut by_rows = Coalescer::new(BatchLimit::new(10_000, 1 << 30));
        by_rows.push(ints(8192));
        assert!(!by_rows.is_full());
        by_rows.push(ints(8192));
        assert!(by_rows.is_full());
    }

    #[test]
    fn another_schema_closes_what_waits() {
        let mut c = Coalescer::new(BatchLimit::new(1 << 20, 1 << 30));
        let a = ints(10);
        assert!(!c.closes_before(&a));
        c.push(a);
        let other = Arc::new(Schema::new(vec![Field::new("a", DataType::Int64, true)]));
        let b = RecordBatch::try_new(other, vec![Arc::new(Int64Array::from(vec![1, 2]))]).unwrap();
        assert!(c.closes_before(&b));
        assert!(!c.closes_before(&ints(3)));
    }
}
