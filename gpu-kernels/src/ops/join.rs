//! Hash join matching on a device (`cuda/hash_table.cu`, `cuda/join.cu`): a [`JoinTable`]
//! holds the build side's keys and hash table; each probe finds the candidate pairs by
//! hash, keeps those whose keys are equal, and returns the matching (build, probe) row
//! pairs in probe order. Rows with a NULL key are left out on both sides (SQL's `=`); the
//! caller passes their validity.

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
        let candidates = self.table.probe(&hashes, valid, n)?;
        let pairs = candidates.build.len();
        if pairs == 0 {
            return Ok(None);
        }
        let probe_descriptors = key_descriptors(device, keys)?;
        let flags = device.alloc(pairs * 8)?;
        let cfg = LaunchConfig::for_items(device, pairs as u64, BLOCK);
        // SAFETY: the candidate indices are below the build rows and n (RowIndices), and
        // both descriptor tables hold `keys.len()` columns of those lengths; `flags` holds
        // one u64 per pair.
        unsafe {
            device.launch(
                Kernel::join_verify,
                cfg,
                &[
                    Arg::buf(&self.descriptors),
                    Arg::buf(&probe_descriptors),
                    Arg::U32(keys.len() as u32),
                    Arg::buf(candidates.build.buffer()),
                    Arg::buf(candidates.probe.buffer()),
                    Arg::U64(pairs as u64),
                    Arg::U32(u32::from(self.nulls_match)),
                    Arg::buf(&flags),
                ],
            )?;
        }
        let (offsets, total) = scan::exclusive_scan(device, &flags, pairs)?;
        let total = total as usize;
        if total == 0 {
            return Ok(None);
        }
        let out_build = device.alloc(total * 4)?;
        let out_probe = device.alloc(total * 4)?;
        // SAFETY: offsets are the exclusive scan of the 0/1 flags, so flagged pair i lands
        // at offsets[i] < total in each output.
        unsafe {
            device.launch(
                Kernel::join_compact,
                cfg,
                &[
                    Arg::buf(candidates.build.buffer()),
                    Arg::buf(candidates.probe.buffer()),
                    Arg::buf(&flags),
                    Arg::buf(&offsets),
                    Arg::U64(pairs as u64),
                    Arg::buf(&out_build),
                    Arg::buf(&out_probe),
                ],
            )?;
        }
        Ok(Some((
            RowIndices::new(out_build, total, self.rows, false),
            RowIndices::new(out_probe, total, n, false),
        )))
    }
}
