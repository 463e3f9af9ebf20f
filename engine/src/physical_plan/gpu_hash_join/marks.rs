//! A left semi or anti join's matches marked on the device (`ProbeMarks`), for the two
//! paths that run such a join without a residual filter: over build rows on the device
//! (`semi.rs`) and over a build side on the host (`Probing`, `run.rs`). Each probe chunk
//! marks the build rows it matches in a bitmap on the device (`JoinTable::mark`, under a
//! fused filter's row mask when the join takes one in): one launch, no pairs, no host wait.
//! The host reads the bitmap, with the fused programs' error words, in one wait at the end
//! of the partition, or sooner once the probe rows it keeps to match again pass
//! [`RETAIN_BATCHES`] device batches.
//!
//! ```text
//!   probe chunk ─▶ (fused filter's mask) ─▶ mark ─▶ (end, or RETAIN_BATCHES kept) read ─▶ visited
//!   lost marks, or a fused program's error word ─▶ the chunks since the last read
//!                                                   matched again on the host
//! ```

use super::*;
use crate::physical_plan::gpu_metrics::count_batch;
use fulmen_kernels::ops::join::JoinMarks;

/// How many device batches' bytes (`fulmen.gpu.batch_bytes`, so 256 MiB by default) of
/// probe rows marked on the device a partition keeps on the host (their lineage: the host
/// batch, or what a device chunk is made again from) before it reads the marks: the price of
/// reading them once, not once per batch. A host chunk counts at its bytes; a device chunk
/// as a whole device batch, whatever its rows: its lineage holds its producer's input (a
/// selective filter's whole input batch, say), of a size not known here.
pub(super) const RETAIN_BATCHES: usize = 4;

/// A partition's build rows marked on the device that the host has not read yet, and how to
/// match again on the host the probe rows that marked them (empty: none marked since the
/// last read, or since the marks were lost).
#[derive(Default)]
pub(super) struct ProbeMarks(Option<Marked>);

struct Marked {
    marks: JoinMarks,
    /// The probe rows of each chunk marked since the last read, on the host.
    unread: Vec<Redo>,
    /// The status buffers of the fused programs whose masks those chunks were marked under.
    statuses: Vec<DeviceBuffer>,
    /// What `unread` holds (see [`RETAIN_BATCHES`]).
    unread_bytes: usize,
}

impl ProbeMarks {
    /// Marks on the device the build rows of `table` that `chunk` matches, under the
    /// join's fused filter's row mask when it takes one in: no wait (see [`Self::read`]).
    /// The chunk's probe rows are kept on the host (its lineage) until the marks are read.
    /// `false`: a per-batch constant the fused program cannot hold leaves the chunk to the
    /// CPU.
    pub(super) fn mark(
        &mut self,
        run: &JoinRun,
        table: &JoinTable,
        chunk: &Chunk,
    ) -> Result<bool, KernelError> {
        let (device, metrics) = (&run.device, &run.metrics);
        let n = chunk.num_rows();
        let mut columns = HashMap::new();
        let (keys, kept, lineage) = match &run.fused {
            Some(fused) => {
                let Some((kept, status)) = fused.select(chunk, device, metrics, 0, &mut columns)?
                else {
                    return Ok(false);
                };
                let keys = fused.input_keys(&run.work.right_keys)?;
                (keys, Some((kept, status)), fused.lineage(chunk))
            }
            None => (run.work.right_keys.clone(), None, chunk.lineage()),
        };
        for &c in &keys {
            if let std::collections::hash_map::Entry::Vacant(slot) = columns.entry(c) {
                slot.insert(chunk.device_column(c, device, metrics)?);
            }
        }
        let keys: Vec<&DeviceColumn> = keys.iter().map(|c| &columns[c]).collect();
        let marked = match &mut self.0 {
            Some(marked) => marked,
            empty => empty.insert(Marked {
                marks: metrics.kernel(|| JoinMarks::new(table))?,
                unread: Vec::new(),
                statuses: Vec::new(),
                unread_bytes: 0,
            }),
        };
        // Kept before the marks are queued: a chunk whose marks are lost with the device
        // is matched again from it (should this chunk also go to the CPU now, matching it
        // twice changes nothing).
        marked.unread.push(lineage);
        marked.unread_bytes += match chunk {
            Chunk::Host(batch) => crate::physical_plan::coalesce::host_bytes(batch),
            Chunk::Device(..) => run.batch.bytes,
        };
        let valid = match kept {
            Some((kept, status)) => {
                marked.statuses.push(status);
                Some(kept)
            }
            None => None,
        };
        // NULL probe keys need no validity: the mark's key check rejects them (unless
        // NULLs match).
        let mask = valid.as_ref().map(DeviceColumn::values);
        metrics.kernel(|| table.mark(&keys, mask, n, &marked.marks))?;
        Ok(true)
    }

    /// Whether the probe rows kept until the next read pass [`RETAIN_BATCHES`] of `run`'s
    /// device batches: time to read the marks.
    pub(super) fn full(&self, run: &JoinRun) -> bool {
        (self.0.as_ref()).is_some_and(|m| m.unread_bytes > RETAIN_BATCHES * run.batch.bytes)
    }

    /// Brings the rows marked on the device into `visited`, in one wait with the error
    /// words of the fused programs that masked the probes. Should the read fail (a lost
    /// device) or one of those programs have left a row to the CPU, the chunks marked since
    /// the last read are matched again on the host instead, against `build()` (each counted
    /// once more, as a batch that fell back, or that went to the CPU by rule, however it ran
    /// the first time; matching one again changes nothing).
    pub(super) fn read(
        &mut self,
        run: &JoinRun,
        build: &dyn Fn() -> Result<RecordBatch>,
        host: &mut Option<HostIndex>,
        visited: &mut [bool],
    ) -> Result<()> {
        let Some(marked) = self.0.as_mut() else {
            return Ok(());
        };
        if marked.unread.is_empty() {
            return Ok(());
        }
        let unread = std::mem::take(&mut marked.unread);
        let statuses = std::mem::take(&mut marked.statuses);
        marked.unread_bytes = 0;
        let metrics = &run.metrics;
        run.extra.mark_reads.add(1);
        let read = {
            let statuses: Vec<&DeviceBuffer> = statuses.iter().collect();
            metrics.kernel(|| marked.marks.read(&statuses))
        };
        let on = match read {
            Ok(Some(bits)) if bits.len() == visited.len() => {
                for (v, b) in visited.iter_mut().zip(bits) {
                    *v |= b;
                }
                return Ok(());
            }
            Ok(Some(bits)) => {
                return datafusion::common::internal_err!(
                    "{} join marks for {} build rows",
                    bits.len(),
                    visited.len()
                );
            }
            // The failed round's marks are void: cleared for the next (or, should that
            // fail, made again by the next chunk).
            Ok(None) => {
                if let Err(e) = marked.marks.clear() {
                    metrics.recover(&e, "clearing the join's marks")?;
                    self.0 = None;
                }
                BatchOn::Rule
            }
            Err(e) => {
                metrics.recover(&e, "matching the join's marked probe batches on the host")?;
                self.0 = None;
                BatchOn::Fallback
            }
        };
        let build = build()?;
        for lineage in unread {
            let probe = lineage.run()?;
            for b in host_matches(host, &run.work, &build, &probe)?.build {
                visited[b as usize] = true;
            }
            count_batch(metrics, on);
        }
        Ok(())
    }
}
