//! A cached table's rows read again from its source, for chunks whose device is gone.

use std::sync::{Arc, Mutex};

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::compute::concat_batches;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::ExecutionPlan;
use futures::StreamExt;

use super::{Sharding, deal};

/// A source's rows read again on the host, for chunks whose device is gone: the source
/// scan is executed once per cached scan, the first time a chunk needs it, partitions in
/// order as when it was cached (and dealt into the same parts when the table is sharded),
/// and its rows are kept on the host for the scan's other chunks while any of its
/// partitions runs.
///
/// The read runs on a thread of its own with a runtime of its own, so that it never waits
/// for the caller's runtime (a chunk's CPU redo is not async and may block the only thread
/// of a current-thread runtime).
#[derive(Debug)]
pub struct Reread {
    plan: Arc<dyn ExecutionPlan>,
    task: Arc<TaskContext>,
    /// How the cached rows were dealt into parts (the key's place among `plan`'s columns).
    sharding: Option<Sharding>,
    /// The columns kept of the rows read (all when `None`).
    projection: Option<Vec<usize>>,
    /// The rows of each part.
    rows: Mutex<Option<Arc<Vec<Vec<RecordBatch>>>>>,
}

impl Reread {
    /// Rows of `plan`, read on demand: dealt into `sharding`'s parts when it is given (its
    /// `column` is the key's place among `plan`'s columns), and cut to `projection`.
    pub fn new(
        plan: Arc<dyn ExecutionPlan>,
        task: Arc<TaskContext>,
        sharding: Option<Sharding>,
        projection: Option<Vec<usize>>,
    ) -> Self {
        Self {
            plan,
            task,
            sharding,
            projection,
            rows: Mutex::new(None),
        }
    }

    /// Rows `first .. first + len` of `part`, as one batch, without blocking the caller's
    /// runtime.
    pub async fn rows_async(
        self: Arc<Self>,
        part: usize,
        first: usize,
        len: usize,
    ) -> Result<RecordBatch> {
        tokio::task::spawn_blocking(move || self.rows(part, first, len))
            .await
            .map_err(|e| DataFusionError::Execution(format!("re-reading a cached table: {e}")))?
    }

    /// Rows `first .. first + len` of `part` (of the whole source when not sharded), as
    /// one batch, blocking while the source is read.
    pub fn rows(&self, part: usize, first: usize, len: usize) -> Result<RecordBatch> {
        let all = {
            // Held while the source is read: the other chunks wait for the one read.
            let mut held = self.rows.lock().unwrap_or_else(|p| p.into_inner());
            match &*held {
                Some(all) => Arc::clone(all),
                None => {
                    let all = Arc::new(self.read()?);
                    *held = Some(Arc::clone(&all));
                    all
                }
            }
        };
        let rows = self.slice(all.get(part).map_or(&[], Vec::as_slice), first, len)?;
        match &self.projection {
            Some(p) => Ok(rows.project(p)?),
            None => Ok(rows),
        }
    }

    /// The source's rows by part, in the order they were cached.
    fn read(&self) -> Result<Vec<Vec<RecordBatch>>> {
        let (plan, task) = (Arc::clone(&self.plan), Arc::clone(&self.task));
        let sharding = self.sharding.clone();
        let reader = std::thread::spawn(move || -> Result<Vec<Vec<RecordBatch>>> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let mut partitioner = sharding.as_ref().map(Sharding::partitioner).transpose()?;
            let mut parts = vec![Vec::new(); sharding.as_ref().map_or(1, |s| s.parts)];
            runtime.block_on(async move {
                for p in 0..plan.properties().partitioning.partition_count() {
                    let mut stream = plan.execute(p, Arc::clone(&task))?;
                    while let Some(batch) = stream.next().await {
                        deal(partitioner.as_mut(), batch?, |part, piece| {
                            parts[part].push(piece);
                            Ok(())
                        })?;
                    }
                }
                Ok(parts)
            })
        });
        reader.join().unwrap_or_else(|_| {
            Err(DataFusionError::Execution(
                "reading a cached table's source panicked".into(),
            ))
        })
    }

    fn slice(&self, all: &[RecordBatch], first: usize, len: usize) -> Result<RecordBatch> {
        let mut pieces = Vec::new();
        let (mut at, end) = (0usize, first + len);
        for batch in all {
            let (from, to) = (at, at + batch.num_rows());
            at = to;
            if to <= first || from >= end {
                continue;
            }
            let start = first.max(from) - from;
            let stop = end.min(to) - from;
            pieces.push(batch.slice(start, stop - start));
        }
        let got: usize = pieces.iter().map(RecordBatch::num_rows).sum();
        if got != len {
            return Err(DataFusionError::Execution(format!(
                "a cached table's source no longer has the rows {first}..{end} of the cache's \
                 (it has {at}); REFRESH CACHE takes a new snapshot"
            )));
        }
        Ok(concat_batches(&self.plan.schema(), &pieces)?)
    }
}
