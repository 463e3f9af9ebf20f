//! The device hash table (`cuda/hash_table.cu`): a multimap from row hashes to build-side
//! rows, built with atomicCAS and probed in two passes (count, then emit), which compare
//! the keys themselves when given a [`KeyCheck`] (a join's).

use super::{BLOCK, RowIndices, Word, check_rows, scan};
use crate::column::DeviceColumn;
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

/// How a probe compares the keys of the rows whose hashes are equal (a join's,
/// [`JoinTable`](super::join::JoinTable)): only the pairs whose keys are equal and, unless
/// `nulls_match`, not NULL on either side are kept. Made inside the crate only, where its
/// tables are known to describe the table's build rows and the probe's rows.
#[derive(Debug, Clone, Copy)]
pub struct KeyCheck<'a> {
    /// The build side's key descriptors (a table of `KeyCol`, `key_descriptors`).
    pub(crate) build: &'a DeviceBuffer,
    /// The probe side's, alike.
    pub(crate) probe: &'a DeviceBuffer,
    /// Key columns on each side.
    pub(crate) ncols: usize,
    /// Whether NULL keys equal each other (`IS NOT DISTINCT FROM`).
    pub(crate) nulls_match: bool,
    /// Whether the probe's row hashes are still to be computed: the count pass computes
    /// each valid probe row's from `probe` (as `hash_many` would) and writes it into the
    /// hashes given, for the emit and any later pass to read.
    pub(crate) hash_probe: bool,
    /// The buffers the descriptors point into whose work may still be queued on another
    /// stream (the probe's key columns, which the count hashes): the launches reach them,
    /// so they wait for that work first.
    pub(crate) reached: &'a [&'a DeviceBuffer],
}

/// The kernels' four `check` arguments (nulls: no check).
fn check_args(check: Option<&KeyCheck<'_>>) -> [Arg; 4] {
    match check {
        Some(c) => [
            Arg::buf(c.build),
            Arg::buf(c.probe),
            Arg::U32(c.ncols as u32),
            Arg::U32(u32::from(c.nulls_match)),
        ],
        None => [Arg::Ptr(0), Arg::Ptr(0), Arg::U32(0), Arg::U32(0)],
    }
}

/// Pairs from a probe: equal hashes (candidates, to be confirmed by comparing keys), or,
/// with a [`KeyCheck`], equal keys.
#[derive(Debug)]
pub struct ProbeResult {
    /// Build-side rows.
    pub build: RowIndices,
    /// Probe-side rows, in probe order.
    pub probe: RowIndices,
}

/// Where a build takes its rows' hashes from: given, or computed by the insert over key
/// columns (their descriptors, and how many).
#[derive(Clone, Copy)]
enum Hashes<'a> {
    Given(&'a DeviceBuffer),
    /// The descriptors, the number of columns, and the buffers they point into.
    OfKeys(&'a DeviceBuffer, usize, &'a [&'a DeviceBuffer]),
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
        Self::insert(device, Hashes::Given(hashes), valid, n)
    }

    /// [`build`](Self::build) over the rows' key columns `keys`, which `descriptors` (their
    /// `key_descriptors`) describes: the insert hashes each row as `hash_many` would, with
    /// no launch of its own for the hashes (and waits for the columns' streams).
    pub(crate) fn build_over_keys(
        device: &Device,
        keys: &[&DeviceColumn],
        descriptors: &DeviceBuffer,
        valid: Option<&DeviceBuffer>,
        n: usize,
    ) -> Result<Self> {
        check_rows(n)?;
        if descriptors.len() < keys.len() * 32
            || keys.iter().any(|k| k.len() != n)
            || valid.is_some_and(|v| v.len() < n.div_ceil(8))
        {
            return Err(KernelError::Unsupported(format!(
                "key columns or their descriptors other than {n} rows, or a shorter validity"
            )));
        }
        let reached = super::expr::reached_columns(keys);
        Self::insert(
            device,
            Hashes::OfKeys(descriptors, keys.len(), &reached),
            valid,
            n,
        )
    }

    fn insert(
        device: &Device,
        hashes: Hashes<'_>,
        valid: Option<&DeviceBuffer>,
        n: usize,
    ) -> Result<Self> {
        // Load factor at most 1/2 keeps probe chains short and guarantees a free slot.
        let capacity = ((n as u64) * 2).max(16).next_power_of_two();
        let keys = device.alloc(capacity as usize * 8)?;
        let rows = device.alloc(capacity as usize * 4)?;
        let (given, key_cols, ncols, reached) = match hashes {
            Hashes::Given(h) => (Arg::buf(h), Arg::Ptr(0), 0, &[][..]),
            Hashes::OfKeys(d, ncols, reached) => (Arg::Ptr(0), Arg::buf(d), ncols as u32, reached),
        };
        // SAFETY: `keys` holds `capacity` u64 and `rows` `capacity` u32; the given hashes
        // hold n u64, or the descriptors describe `ncols` key columns of n rows (the
        // caller's `key_descriptors`); `valid` holds ceil(n/8) bytes (checked); capacity is
        // a power of two > n, so every insert finds a free slot, and mask == capacity - 1.
        unsafe {
            device.launch(
                Kernel::hash_table_init,
                LaunchConfig::for_items(device, capacity, BLOCK),
                &[Arg::buf(&keys), Arg::buf(&rows), Arg::U64(capacity)],
            )?;
            device.launch_reaching(
                Kernel::hash_table_insert,
                LaunchConfig::for_items(device, n as u64, BLOCK),
                &[
                    Arg::buf(&keys),
                    Arg::buf(&rows),
                    Arg::U64(capacity - 1),
                    given,
                    Arg::opt(valid),
                    Arg::U64(n as u64),
                    key_cols,
                    Arg::U32(ncols),
                ],
                reached,
            )?;
        }
        Ok(Self {
            keys,
            rows,
            capacity,
            build_rows: n,
        })
    }

    /// Finds, for each of the `n` probe rows, every build row with the same hash (and, with
    /// `check`, equal keys). Probe rows whose bit in `valid` is clear find nothing. One host
    /// wait, for the number of pairs.
    pub fn probe(
        &self,
        hashes: &DeviceBuffer,
        valid: Option<&DeviceBuffer>,
        n: usize,
        check: Option<&KeyCheck<'_>>,
    ) -> Result<ProbeResult> {
        let device = self.keys.device();
        let (offsets, total) = self.probe_offsets(hashes, valid, n, None, check)?;
        let total = total.unwrap_or_default() as usize;
        check_rows(total)?;
        let out_build = device.alloc(total * 4)?;
        let out_probe = device.alloc(total * 4)?;
        self.emit(
            hashes,
            valid,
            n,
            &offsets,
            (&out_build, &out_probe),
            total,
            check,
        )?;
        Ok(ProbeResult {
            build: RowIndices::new(out_build, total, self.build_rows, false),
            probe: RowIndices::new(out_probe, total, n, false),
        })
    }

    /// As [`Self::probe`] without a host wait: the pairs go into outputs of `cap` slots (a
    /// guess), their total to the word `total_to`; when the total is above `cap` the pairs
    /// past it were dropped and the caller probes again with [`Self::probe`]. One launch
    /// (`hash_table_probe`: count, scan and emit chained by the look-back) for up to
    /// [`LOOKBACK_TILES`](scan::LOOKBACK_TILES) tiles of probe rows (16 Mi rows), three
    /// launches and more past that.
    pub fn probe_bounded(
        &self,
        hashes: &DeviceBuffer,
        valid: Option<&DeviceBuffer>,
        n: usize,
        cap: usize,
        total_to: Word<'_>,
        check: Option<&KeyCheck<'_>>,
    ) -> Result<(DeviceBuffer, DeviceBuffer)> {
        check_rows(cap)?;
        check_hashes(hashes, valid, n)?;
        let device = self.keys.device();
        let out_build = device.alloc((cap * 4).max(1))?;
        let out_probe = device.alloc((cap * 4).max(1))?;
        if n == 0 {
            return Ok((out_build, out_probe));
        }
        let tiles = (n as u64).div_ceil(scan::TILE);
        let one_pass = scan::one_pass(device, tiles, |cfg, state, epoch| {
            let own = [
                state,
                Arg::U64(scan::LOOKBACK_TILES),
                Arg::U64(epoch),
                Arg::buf(&out_build),
                Arg::buf(&out_probe),
                Arg::U64(cap as u64),
                total_to.arg(),
            ];
            let mut args = self.probe_args(hashes, valid, n, &own, check);
            args.push(Arg::U32(u32::from(check.is_some_and(|c| c.hash_probe))));
            // SAFETY: as in `probe_offsets` and `emit` together: the table's buffers hold
            // `capacity` slots with mask capacity - 1; the probe inputs hold n rows
            // (checked), `hashes` n u64 (set, or written here from the check's probe keys
            // when it says so); both outputs hold `cap` u32 and the kernel writes no pair
            // at or past `cap`; `total_to` is one u64; the look-back state and epoch are
            // `one_pass`'s, a block of SCAN_THREADS per tile of n rows; a check's
            // descriptor tables describe `ncols` key columns of the build rows and of the n
            // probe rows (`KeyCheck`'s contract).
            unsafe {
                device.launch_reaching(
                    Kernel::hash_table_probe,
                    cfg,
                    &args,
                    check.map_or(&[], |c| c.reached),
                )
            }
        })?;
        if !one_pass {
            let (offsets, _) = self.probe_offsets(hashes, valid, n, Some(total_to), check)?;
            self.emit(
                hashes,
                valid,
                n,
                &offsets,
                (&out_build, &out_probe),
                cap,
                check,
            )?;
        }
        Ok((out_build, out_probe))
    }

    /// Sets, in `marks` (u32 words, a bit per build row), the bit of every build row whose
    /// keys equal one of the `n` probe rows' (those whose bit in `valid` is set; all
    /// without it), the probe keys hashed in the kernel: no pairs, counts or host wait. One
    /// launch (`hash_table_probe_mark`).
    pub fn probe_mark(
        &self,
        valid: Option<&DeviceBuffer>,
        n: usize,
        marks: &DeviceBuffer,
        check: &KeyCheck<'_>,
    ) -> Result<()> {
        check_rows(n)?;
        if marks.len() < self.build_rows.div_ceil(32) * 4 {
            return Err(KernelError::Unsupported(format!(
                "marks of {} bytes for {} build rows",
                marks.len(),
                self.build_rows
            )));
        }
        if valid.is_some_and(|v| v.len() < n.div_ceil(8)) {
            return Err(KernelError::Unsupported(format!(
                "a validity bitmap of {} bytes for {n} probe rows",
                valid.map_or(0, DeviceBuffer::len)
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let device = self.keys.device();
        let mut args = vec![
            Arg::buf(&self.keys),
            Arg::buf(&self.rows),
            Arg::U64(self.capacity - 1),
            Arg::opt(valid),
            Arg::U64(n as u64),
            Arg::buf(marks),
            Arg::U64(self.build_rows as u64),
        ];
        args.extend(check_args(Some(check)));
        // SAFETY: the table's buffers hold `capacity` slots with mask capacity - 1, whose
        // rows are build rows (the kernel marks none at or past `build_rows` all the same);
        // `marks` holds a bit per build row (checked), `valid` a bit per probe row (checked);
        // the check's descriptor tables describe `ncols` key columns of the build rows and
        // of the n probe rows (`KeyCheck`'s contract).
        unsafe {
            device.launch_reaching(
                Kernel::hash_table_probe_mark,
                LaunchConfig::for_items(device, n as u64, BLOCK),
                &args,
                check.reached,
            )
        }
    }

    /// The pairs of each probe row counted and scanned into offsets, with their total read
    /// by the host (a wait), or queued to `total_to` instead (`None`).
    fn probe_offsets(
        &self,
        hashes: &DeviceBuffer,
        valid: Option<&DeviceBuffer>,
        n: usize,
        total_to: Option<Word<'_>>,
        check: Option<&KeyCheck<'_>>,
    ) -> Result<(DeviceBuffer, Option<u64>)> {
        check_hashes(hashes, valid, n)?;
        let device = self.keys.device();
        let cfg = LaunchConfig::for_items(device, n as u64, BLOCK);
        let counts = device.alloc(n * 8)?;
        let mut args = self.probe_args(hashes, valid, n, &[Arg::buf(&counts)], check);
        args.push(Arg::U32(u32::from(check.is_some_and(|c| c.hash_probe))));
        // SAFETY: the table's buffers hold `capacity` slots with mask capacity - 1, whose
        // rows are build rows; the probe inputs hold n rows (checked), `hashes` n u64 (set,
        // or written here from the check's probe keys when it says so); `counts` holds n
        // u64; a check's descriptor tables describe `ncols` key columns of the build rows
        // and of the n probe rows (`KeyCheck`'s contract).
        unsafe {
            device.launch_reaching(
                Kernel::hash_table_probe_count,
                cfg,
                &args,
                check.map_or(&[], |c| c.reached),
            )?;
        }
        match total_to {
            Some(to) => Ok((scan::exclusive_scan_queued(device, &counts, n, to)?, None)),
            None => scan::exclusive_scan(device, &counts, n).map(|(o, t)| (o, Some(t))),
        }
    }

    /// A probe kernel's arguments: the table, the probe rows (`hashes`, `valid`, `n`), the
    /// pass's own (`own`), then the key check's four.
    fn probe_args(
        &self,
        hashes: &DeviceBuffer,
        valid: Option<&DeviceBuffer>,
        n: usize,
        own: &[Arg],
        check: Option<&KeyCheck<'_>>,
    ) -> Vec<Arg> {
        let mut args = vec![
            Arg::buf(&self.keys),
            Arg::buf(&self.rows),
            Arg::U64(self.capacity - 1),
            Arg::buf(hashes),
            Arg::opt(valid),
            Arg::U64(n as u64),
        ];
        args.extend_from_slice(own);
        args.extend(check_args(check));
        args
    }

    /// Writes each probe row's pairs at its offset into outputs of `cap` slots.
    #[allow(clippy::too_many_arguments)]
    fn emit(
        &self,
        hashes: &DeviceBuffer,
        valid: Option<&DeviceBuffer>,
        n: usize,
        offsets: &DeviceBuffer,
        (out_build, out_probe): (&DeviceBuffer, &DeviceBuffer),
        cap: usize,
        check: Option<&KeyCheck<'_>>,
    ) -> Result<()> {
        let device = self.keys.device();
        if out_build.len() < cap * 4 || out_probe.len() < cap * 4 {
            return Err(KernelError::Unsupported(format!(
                "probe outputs too small for {cap} pairs"
            )));
        }
        let outputs = [
            Arg::buf(offsets),
            Arg::buf(out_build),
            Arg::buf(out_probe),
            Arg::U64(cap as u64),
        ];
        let args = self.probe_args(hashes, valid, n, &outputs, check);
        // SAFETY: `offsets` is the exclusive scan of the counts made with the same check,
        // so row i writes its counts[i] pairs from offsets[i] on, and the kernel writes
        // none at or past `cap`, which both outputs hold (checked); a check's tables as in
        // `probe_offsets`.
        unsafe {
            device.launch_reaching(
                Kernel::hash_table_probe_emit,
                LaunchConfig::for_items(device, n as u64, BLOCK),
                &args,
                check.map_or(&[], |c| c.reached),
            )?;
        }
        Ok(())
    }

    /// Slots in the table.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use arrow::array::Int64Array;

    use super::*;
    use crate::column::DeviceColumn;
    use crate::device::EmulatorOptions;
    use crate::ops::key_descriptors;

    /// With every row's hash the same, every pair of rows is a candidate: a probe with a
    /// key check must keep exactly the pairs whose keys are equal, NULLs pairing only when
    /// `nulls_match`, counted and written alike.
    #[test]
    fn a_key_check_keeps_only_equal_keys_among_equal_hashes() {
        let d = Device::emulated(0, &EmulatorOptions::default());
        let build: Int64Array = (0..300).map(|i| (i % 7 != 0).then_some(i % 40)).collect();
        let probe: Int64Array = (0..500).map(|i| (i % 5 != 0).then_some(i % 60)).collect();
        let zeros = |n: usize| d.upload(&vec![0u8; n * 8]).unwrap();
        let table = HashTable::build(&d, &zeros(300), None, 300).unwrap();
        let (b, p) = (
            DeviceColumn::upload(&d, &build).unwrap(),
            DeviceColumn::upload(&d, &probe).unwrap(),
        );
        let (bd, pd) = (
            key_descriptors(&d, &[&b]).unwrap(),
            key_descriptors(&d, &[&p]).unwrap(),
        );
        for nulls_match in [false, true] {
            let check = KeyCheck {
                build: &bd,
                probe: &pd,
                ncols: 1,
                nulls_match,
                hash_probe: false,
                reached: &[],
            };
            let got = table.probe(&zeros(500), None, 500, Some(&check)).unwrap();
            let got: Vec<(u32, u32)> = (got.probe.to_host().unwrap().into_iter())
                .zip(got.build.to_host().unwrap())
                .collect();
            let mut want = Vec::new();
            for (pi, pv) in probe.iter().enumerate() {
                for (bi, bv) in build.iter().enumerate() {
                    let pairs = match (pv, bv) {
                        (Some(x), Some(y)) => x == y,
                        (None, None) => nulls_match,
                        _ => false,
                    };
                    if pairs {
                        want.push((pi as u32, bi as u32));
                    }
                }
            }
            assert!(!want.is_empty());
            assert!(
                got == want,
                "nulls_match {nulls_match}: {} pairs, {} wanted",
                got.len(),
                want.len()
            );
        }
    }

    /// A probe that hashes its own keys (`hash_probe`: `key_row_hash` in the count pass)
    /// computes the hashes `hash_many` computes over the same columns, for every key kind
    /// (integers of each width, wide and narrow decimals, floats with -0.0 and NaN,
    /// strings with 32- and 64-bit offsets, NULLs) alone and combined: a build side hashed
    /// by one must meet a probe hashed by the other.
    #[test]
    fn a_probe_hashing_its_own_keys_agrees_with_hash_many() {
        use arrow::array::{
            ArrayRef, Date32Array, Decimal128Array, Float32Array, Float64Array, Int8Array,
            Int16Array, LargeStringArray, StringArray,
        };
        use std::sync::Arc;
        let d = Device::emulated(0, &EmulatorOptions::default());
        let n = 1000;
        let nulls = |i: usize| i % 11 != 3;
        let floats = [0.0, -0.0, f64::NAN, -f64::NAN, 1.5, -2.25, f64::INFINITY];
        let columns: Vec<ArrayRef> = vec![
            Arc::new(
                (0..n)
                    .map(|i| nulls(i).then_some(i as i8))
                    .collect::<Int8Array>(),
            ),
            Arc::new(
                (0..n)
                    .map(|i| nulls(i).then_some(i as i16 * 7))
                    .collect::<Int16Array>(),
            ),
            Arc::new(
                (0..n)
                    .map(|i| nulls(i).then_some(i as i32 - 500))
                    .collect::<Date32Array>(),
            ),
            Arc::new(
                (0..n)
                    .map(|i| nulls(i).then_some(i as i64 * 1_000_003))
                    .collect::<Int64Array>(),
            ),
            Arc::new(
                (0..n)
                    .map(|i| nulls(i).then_some(i as i128 * 10_i128.pow(30) - 7))
                    .collect::<Decimal128Array>()
                    .with_precision_and_scale(38, 2)
                    .unwrap(),
            ),
            Arc::new(
                (0..n)
                    .map(|i| nulls(i).then_some(i as i128 * 99 - 50_000))
                    .collect::<Decimal128Array>()
                    .with_precision_and_scale(12, 2)
                    .unwrap(),
            ),
            Arc::new(
                (0..n)
                    .map(|i| nulls(i).then_some(floats[i % 7] as f32))
                    .collect::<Float32Array>(),
            ),
            Arc::new(
                (0..n)
                    .map(|i| nulls(i).then_some(floats[i % 7]))
                    .collect::<Float64Array>(),
            ),
            Arc::new(
                (0..n)
                    .map(|i| nulls(i).then(|| format!("s{}", i % 97)))
                    .collect::<StringArray>(),
            ),
            Arc::new(
                (0..n)
                    .map(|i| nulls(i).then(|| "x".repeat(i % 13)))
                    .collect::<LargeStringArray>(),
            ),
        ];
        let on_device: Vec<DeviceColumn> = columns
            .iter()
            .map(|c| DeviceColumn::upload(&d, c.as_ref()).unwrap())
            .collect();
        let mut sets: Vec<Vec<&DeviceColumn>> = on_device.iter().map(|c| vec![c]).collect();
        sets.push(vec![&on_device[3], &on_device[8], &on_device[7]]);
        sets.push(on_device.iter().collect());
        let words = |b: &DeviceBuffer| -> Vec<u64> {
            let bytes = b.to_host().unwrap();
            bytes[..n * 8]
                .chunks_exact(8)
                .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
                .collect()
        };
        for set in sets {
            let what: Vec<String> = set.iter().map(|c| c.data_type().to_string()).collect();
            let hashed = crate::ops::hash::hash_columns(&d, &set).unwrap();
            let want = words(&hashed);
            let table = HashTable::build(&d, &hashed, None, n).unwrap();
            let descriptors = key_descriptors(&d, &set).unwrap();
            let check = KeyCheck {
                build: &descriptors,
                probe: &descriptors,
                ncols: set.len(),
                nulls_match: true,
                hash_probe: true,
                reached: &[],
            };
            let mine = d.upload(&vec![0u8; n * 8]).unwrap();
            let pairs = table.probe(&mine, None, n, Some(&check)).unwrap();
            assert_eq!(words(&mine), want, "{what:?}");
            // Every row meets itself (NULLs match here) at least.
            assert!(
                pairs.probe.len() >= n,
                "{what:?}: {} pairs",
                pairs.probe.len()
            );
        }
    }
}
