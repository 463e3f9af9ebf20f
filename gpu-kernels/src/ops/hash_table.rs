//! The device hash table (`cuda/hash_table.cu`): a multimap from row hashes to build-side
//! rows, built with atomicCAS and probed in two passes (count, then emit).

use super::{BLOCK, RowIndices, Word, check_rows, scan};
use crate::device::{Arg, Device, LaunchConfig};
use crate::kernels::Kernel;
use crate::memory::DeviceBuffer;
use crate::{KernelError, Result};

/// A built table: slots of (hash, build row).
#[derive(Debug)]
pub struct HashTable {
    keys: DeviceBuffer,
    rows: DeviceBuffer,
    capacity: u64,
    build_rows: usize,
}

/// Candidate pairs from a probe: equal hashes, to be confirmed by comparing keys.
#[derive(Debug)]
pub struct ProbeResult {
    /// Build-side rows.
    pub build: RowIndices,
    /// Probe-side rows, in probe order.
    pub probe: RowIndices,
}

fn check_hashes(hashes: &DeviceBuffer, valid: Option<&DeviceBuffer>, n: usize) -> Result<()> {
    check_rows(n)?;
    if hashes.len() < n * 8 || valid.is_some_and(|v| v.len() < n.div_ceil(8)) {
        return Err(KernelError::Unsupported(format!(
            "hashes or validity shorter than {n} rows"
        )));
    }
    Ok(())
}

impl HashTable {
    /// Builds a table of the `n` rows whose `hashes` are given; rows whose bit in `valid`
    /// is clear (NULL keys) are left out.
    pub fn build(
        device: &Device,
        hashes: &DeviceBuffer,
        valid: Option<&DeviceBuffer>,
        n: usize,
    ) -> Result<Self> {
        check_hashes(hashes, valid, n)?;
        // Load factor at most 1/2 keeps probe chains short and guarantees a free slot.
        let capacity = ((n as u64) * 2).max(16).next_power_of_two();
        let keys = device.alloc(capacity as usize * 8)?;
        let rows = device.alloc(capacity as usize * 4)?;
        // SAFETY: `keys` holds `capacity` u64 and `rows` `capacity` u32; `hashes` holds n
        // u64 and `valid` ceil(n/8) bytes (checked); capacity is a power of two > n, so
        // every insert finds a free slot, and mask == capacity - 1.
        unsafe {
            device.launch(
                Kernel::hash_table_init,
                LaunchConfig::for_items(device, capacity, BLOCK),
                &[Arg::buf(&keys), Arg::buf(&rows), Arg::U64(capacity)],
            )?;
            device.launch(
                Kernel::hash_table_insert,
                LaunchConfig::for_items(device, n as u64, BLOCK),
                &[
                    Arg::buf(&keys),
                    Arg::buf(&rows),
                    Arg::U64(capacity - 1),
                    Arg::buf(hashes),
                    Arg::opt(valid),
                    Arg::U64(n as u64),
                ],
            )?;
        }
        Ok(Self {
            keys,
            rows,
            capacity,
            build_rows: n,
        })
    }

    /// Finds, for each of the `n` probe rows, every build row with the same hash. Probe rows
    /// whose bit in `valid` is clear find nothing. One host wait, for the number of pairs.
    pub fn probe(
        &self,
        hashes: &DeviceBuffer,
        valid: Option<&DeviceBuffer>,
        n: usize,
    ) -> Result<ProbeResult> {
        let device = self.keys.device();
        let (offsets, total) = self.probe_offsets(hashes, valid, n, None)?;
        let total = total.unwrap_or_default() as usize;
        check_rows(total)?;
        let out_build = device.alloc(total * 4)?;
        let out_probe = device.alloc(total * 4)?;
        self.emit(hashes, valid, n, &offsets, &out_build, &out_probe, total)?;
        Ok(ProbeResult {
            build: RowIndices::new(out_build, total, self.build_rows, false),
            probe: RowIndices::new(out_probe, total, n, false),
        })
    }

    /// As [`Self::probe`] without a host wait: the pairs go into outputs of `cap` slots (a
    /// guess), their total to the word `total_to`; when the total is above `cap` the pairs
    /// past it were dropped and the caller probes again with [`Self::probe`].
    pub fn probe_bounded(
        &self,
        hashes: &DeviceBuffer,
        valid: Option<&DeviceBuffer>,
        n: usize,
        cap: usize,
        total_to: Word<'_>,
    ) -> Result<(DeviceBuffer, DeviceBuffer)> {
        check_rows(cap)?;
        let device = self.keys.device();
        let (offsets, _) = self.probe_offsets(hashes, valid, n, Some(total_to))?;
        let out_build = device.alloc((cap * 4).max(1))?;
        let out_probe = device.alloc((cap * 4).max(1))?;
        self.emit(hashes, valid, n, &offsets, &out_build, &out_probe, cap)?;
        Ok((out_build, out_probe))
    }

    /// The candidates of each probe row counted and scanned into offsets, with their total
    /// read by the host (a wait), or queued to `total_to` instead (`None`).
    fn probe_offsets(
        &self,
        hashes: &DeviceBuffer,
        valid: Option<&DeviceBuffer>,
        n: usize,
        total_to: Option<Word<'_>>,
    ) -> Result<(DeviceBuffer, Option<u64>)> {
        check_hashes(hashes, valid, n)?;
        let device = self.keys.device();
        let cfg = LaunchConfig::for_items(device, n as u64, BLOCK);
        let counts = device.alloc(n * 8)?;
        // SAFETY: the table's buffers hold `capacity` slots with mask capacity - 1; the
        // probe inputs hold n rows (checked); `counts` holds n u64.
        unsafe {
            device.launch(
                Kernel::hash_table_probe_count,
                cfg,
                &[
                    Arg::buf(&self.keys),
                    Arg::U64(self.capacity - 1),
                    Arg::buf(hashes),
                    Arg::opt(valid),
                    Arg::U64(n as u64),
                    Arg::buf(&counts),
                ],
            )?;
        }
        match total_to {
            Some(to) => Ok((scan::exclusive_scan_queued(device, &counts, n, to)?, None)),
            None => scan::exclusive_scan(device, &counts, n).map(|(o, t)| (o, Some(t))),
        }
    }

    /// Writes each probe row's candidates at its offset into outputs of `cap` slots.
    #[allow(clippy::too_many_arguments)]
    fn emit(
        &self,
        hashes: &DeviceBuffer,
        valid: Option<&DeviceBuffer>,
        n: usize,
        offsets: &DeviceBuffer,
        out_build: &DeviceBuffer,
        out_probe: &DeviceBuffer,
        cap: usize,
    ) -> Result<()> {
        let device = self.keys.device();
        if out_build.len() < cap * 4 || out_probe.len() < cap * 4 {
            return Err(KernelError::Unsupported(format!(
                "probe outputs too small for {cap} pairs"
            )));
        }
        // SAFETY: `offsets` is the exclusive scan of the counts, so row i writes its
        // counts[i] pairs from offsets[i] on, and the kernel writes none at or past `cap`,
        // which both outputs hold (checked).
        unsafe {
            device.launch(
                Kernel::hash_table_probe_emit,
                LaunchConfig::for_items(device, n as u64, BLOCK),
                &[
                    Arg::buf(&self.keys),
                    Arg::buf(&self.rows),
                    Arg::U64(self.capacity - 1),
                    Arg::buf(hashes),
                    Arg::opt(valid),
                    Arg::U64(n as u64),
                    Arg::buf(offsets),
                    Arg::buf(out_build),
                    Arg::buf(out_probe),
                    Arg::U64(cap as u64),
                ],
            )?;
        }
        Ok(())
    }

    /// Slots in the table.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }
}
