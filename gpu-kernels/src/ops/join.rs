//! Hash join matching on a device (`cuda/hash_table.cu`, `cuda/join.cu`): a [`JoinTable`]
//! holds the build side's keys and hash table; each probe finds the candidate pairs by
//! hash, keeps those whose keys are equal, and returns the matching (build, probe) row
//! pairs in probe order. Rows with a NULL key are left out on both sides (SQL's `=`); the
//! caller passes their validity.

use std::sync::atomic::{AtomicU64, Ordering};

use super::hash_table::HashTable;
use super::{BLOCK, RowIndices, check_rows, hash, key_descriptors, scan};
use crate::column::DeviceColumn;
use crate::device::{Arg, Device, LaunchConfig};
use crate::kernels::Kernel;
use crate::memory::DeviceBuffer;
use crate::{KernelError, Result};

/// The build side of a join on a device.
#[derive(Debug)]
pub struct JoinTable {
    table: HashTable,
    nulls_match: bool,
    keys: Vec<DeviceColumn>,
    descriptors: DeviceBuffer,
    rows: usize,
    /// The most candidate pairs per probe row seen so far, in 1/1024ths: it sizes the next
    /// probe's outputs, so that the host waits once per probe (see `probe_on_device`).
    candidates_per_row: AtomicU64,
}

/// Matching row pairs of a probe: in probe order, and within one probe row in build order
/// (the order DataFusion's hash join gives them in).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Matches {
    /// Build-side rows.
    pub build: Vec<u32>,
    /// Probe-side rows.
    pub probe: Vec<u32>,
}

impl JoinTable {
    /// Builds the table over `keys` (the build side's key columns, `rows` rows);
    /// `valid` (a bitmap, `None`: all) marks the rows that can match. Unless
    /// `nulls_match` (`IS NOT DISTINCT FROM` keys), a NULL key matches nothing.
    pub fn build(
        device: &Device,
        keys: Vec<DeviceColumn>,
        valid: Option<&DeviceBuffer>,
        rows: usize,
        nulls_match: bool,
    ) -> Result<Self> {
        check_rows(rows)?;
        if keys.is_empty() || keys.iter().any(|k| k.len() != rows || k.device() != device) {
            return Err(KernelError::Unsupported(
                "join keys of other lengths or devices than the build side".into(),
            ));
        }
        let refs: Vec<&DeviceColumn> = keys.iter().collect();
        let hashes = hash::hash_columns(device, &refs)?;
        let table = HashTable::build(device, &hashes, valid, rows)?;
        let descriptors = key_descriptors(device, &refs)?;
        Ok(Self {
            table,
            nulls_match,
            keys,
            descriptors,
            rows,
            candidates_per_row: AtomicU64::new(1024),
        })
    }

    /// Build-side rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Device bytes the build side holds.
    pub fn device_bytes(&self) -> usize {
        self.keys
            .iter()
            .map(DeviceColumn::device_bytes)
            .sum::<usize>()
            + self.table.capacity() as usize * 12
    }

    /// The pairs of build and probe rows whose keys are equal, for `n` probe rows, on the
    /// host.
    pub fn probe(
        &self,
        keys: &[&DeviceColumn],
        valid: Option<&DeviceBuffer>,
        n: usize,
    ) -> Result<Matches> {
        let Some((build_rows, probe_rows)) = self.probe_on_device(keys, valid, n)? else {
            return Ok(Matches::default());
        };
        let total = build_rows.len();
        let mut both = RowIndices::all_to_host(&[&build_rows, &probe_rows])?;
        let (probe, mut build) = (
            both.pop().unwrap_or_default(),
            both.pop().unwrap_or_default(),
        );
        // The device sorts short runs; a longer one (a hot key) is sorted here.
        let mut start = 0;
        while start < total {
            let mut end = start + 1;
            while end < total && probe[end] == probe[start] {
                end += 1;
            }
            build[start..end].sort_unstable();
            start = end;
        }
        Ok(Matches { build, probe })
    }

    /// The matching pairs left on the device as row indices (build rows into the build
    /// side, probe rows into the probe batch), in probe order and, within a probe row of
    /// at most 64 matches, in build order; `None` when nothing matches.
    pub fn probe_on_device(
        &self,
        keys: &[&DeviceColumn],
        valid: Option<&DeviceBuffer>,
        n: usize,
    ) -> Result<Option<(RowIndices, RowIndices)>> {
        if keys.len() != self.keys.len()
            || keys.iter().zip(&self.keys).any(|(p, b)| {
                p.len() != n || p.data_type() != b.data_type() || p.device() != b.device()
            })
        {
            return Err(KernelError::Unsupported(
                "probe keys of other types, lengths or devices than the build keys".into(),
            ));
        }
        if n == 0 || self.rows == 0 {
            return Ok(None);
        }
        let device = self.keys[0].device();
        let hashes = hash::hash_columns(device, keys)?;
        let probe_descriptors = key_descriptors(device, keys)?;
        // Everything is queued with outputs sized by the most candidates per probe row seen
        // so far, and the host waits once, for the candidates' and the matches' totals
        // together. More candidates than that (a build key more duplicated than in earlier
        // batches) are probed again with exact sizes, waiting for each total.
        let per_row = self.candidates_per_row.load(Ordering::Relaxed) as usize;
        let cap = (n.saturating_mul(per_row) / 1024 + n / 8 + 1024).min(super::MAX_ROWS);
        let totals = [device.upload(&[0; 8])?, device.upload(&[0; 8])?];
        let (cand_build, cand_probe) = self
            .table
            .probe_bounded(&hashes, valid, n, cap, &totals[0])?;
        let bounded = self.matched(
            &probe_descriptors,
            keys.len(),
            (&cand_build, &cand_probe),
            cap,
            Some(&totals[0]),
            Some(&totals[1]),
        )?;
        let mut words = [[0u8; 8]; 2];
        {
            let [a, b] = &mut words;
            device.read_many(&mut [
                (&totals[0], a.as_mut_slice()),
                (&totals[1], b.as_mut_slice()),
            ])?;
        }
        let [pairs, total] = words.map(|w| u64::from_le_bytes(w) as usize);
        let seen = (pairs.saturating_mul(1024)).div_ceil(n) as u64;
        self.candidates_per_row.fetch_max(seen, Ordering::Relaxed);
        let (out_build, out_probe, total) = if pairs <= cap {
            if total > pairs {
                return Err(KernelError::InvalidData(format!(
                    "{total} matches among {pairs} candidate pairs"
                )));
            }
            (bounded.0, bounded.1, total)
        } else {
            drop((bounded, cand_build, cand_probe));
            let candidates = self.table.probe(&hashes, valid, n)?;
            let pairs = candidates.build.len();
            if pairs == 0 {
                return Ok(None);
            }
            let (out_build, out_probe, total) = self.matched(
                &probe_descriptors,
                keys.len(),
                (candidates.build.buffer(), candidates.probe.buffer()),
                pairs,
                None,
                None,
            )?;
            (out_build, out_probe, total.unwrap_or_default() as usize)
        };
        if total == 0 {
            return Ok(None);
        }
        Ok(Some((
            RowIndices::new(out_build, total, self.rows, false),
            RowIndices::new(out_probe, total, n, false),
        )))
    }

    /// Keeps the candidate pairs (`slots` of them; only the first `*pairs` real when
    /// given) whose keys are equal, in order: the matches' build and probe rows, and their
    /// count when the host waited for it. With `total_to` the count is queued to its word 0
    /// instead, and the outputs have room for `slots` matches.
    fn matched(
        &self,
        probe_descriptors: &DeviceBuffer,
        ncols: usize,
        (build, probe): (&DeviceBuffer, &DeviceBuffer),
        slots: usize,
        pairs: Option<&DeviceBuffer>,
        total_to: Option<&DeviceBuffer>,
    ) -> Result<(DeviceBuffer, DeviceBuffer, Option<u64>)> {
        let device = self.keys[0].device();
        if build.len() < slots * 4 || probe.len() < slots * 4 {
            return Err(KernelError::Unsupported(format!(
                "candidate lists too short for {slots} pairs"
            )));
        }
        let flags = device.alloc((slots * 8).max(1))?;
        let cfg = LaunchConfig::for_items(device, slots as u64, BLOCK);
        // SAFETY: the real candidate indices (the first min(*pairs, slots), or all `slots`)
        // are below the build rows and the probe rows, and both descriptor tables hold
        // `ncols` columns of those lengths; the lists hold `slots` u32 (checked) and `flags`
        // one u64 per slot.
        unsafe {
            device.launch(
                Kernel::join_verify,
                cfg,
                &[
                    Arg::buf(&self.descriptors),
                    Arg::buf(probe_descriptors),
                    Arg::U32(ncols as u32),
                    Arg::buf(build),
                    Arg::buf(probe),
                    Arg::U64(slots as u64),
                    Arg::U32(u32::from(self.nulls_match)),
                    Arg::buf(&flags),
                    Arg::opt(pairs),
                ],
            )?;
        }
        let (offsets, total, room) = match total_to {
            Some(to) => (
                scan::exclusive_scan_queued(device, &flags, slots, to)?,
                None,
                slots,
            ),
            None => {
                let (offsets, total) = scan::exclusive_scan(device, &flags, slots)?;
                (offsets, Some(total), total as usize)
            }
        };
        let out_build = device.alloc((room * 4).max(1))?;
        let out_probe = device.alloc((room * 4).max(1))?;
        // SAFETY: offsets are the exclusive scan of the 0/1 flags, so flagged slot i lands
        // at offsets[i] < the flags' total ≤ `room` in each output; unflagged slots (those
        // past the real pairs among them) are not read.
        unsafe {
            device.launch(
                Kernel::join_compact,
                cfg,
                &[
                    Arg::buf(build),
                    Arg::buf(probe),
                    Arg::buf(&flags),
                    Arg::buf(&offsets),
                    Arg::U64(slots as u64),
                    Arg::buf(&out_build),
                    Arg::buf(&out_probe),
                ],
            )?;
        }
        Ok((out_build, out_probe, total))
    }
}
