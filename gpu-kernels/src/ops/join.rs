//! Hash join matching on a device (`cuda/hash_table.cu`): a [`JoinTable`] holds the build
//! side's keys and hash table; each probe counts, then writes, the (build, probe) row pairs
//! whose hashes and keys are equal, in probe order: the key comparison happens in both
//! passes, so no candidate list is verified and compacted afterwards. Rows with a NULL key
//! are left out on both sides (SQL's `=`); the caller passes their validity.

use std::sync::atomic::{AtomicU64, Ordering};

use super::hash_table::{HashTable, KeyCheck};
use super::{
    PendingIndices, RowIndices, Word, check_rows, expr, key_descriptors, u32s_of, words_of,
};
use crate::column::DeviceColumn;
use crate::cost::H200;
use crate::device::Device;
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
    /// The most matches per probe row seen so far, in 1/1024ths: it sizes the next
    /// probe's outputs, so that the host waits once per probe (see `probe_queued`).
    matches_per_row: AtomicU64,
    /// The last probe's matches per probe row, in 1/1024ths (`UNSEEN` before the first):
    /// how many pairs a probe bringing its pairs to the host reads in its one wait (see
    /// [`QueuedProbe::pairs_to_host`]).
    last_per_row: AtomicU64,
}

/// `JoinTable::last_per_row` before any probe finished.
const UNSEEN: u64 = u64::MAX;

/// Matching row pairs of a probe: in probe order, and within one probe row in build order
/// (the order DataFusion's hash join gives them in).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Matches {
    /// Build-side rows.
    pub build: Vec<u32>,
    /// Probe-side rows.
    pub probe: Vec<u32>,
}

impl Matches {
    /// The pairs of a probe's outputs brought to the host (in probe order, a probe row's
    /// first 64 matches in build order), each probe row's longer run (a hot key) put in
    /// build order here.
    pub fn from_probe(mut build: Vec<u32>, probe: Vec<u32>) -> Self {
        let total = build.len().min(probe.len());
        let mut start = 0;
        while start < total {
            let mut end = start + 1;
            while end < total && probe[end] == probe[start] {
                end += 1;
            }
            build[start..end].sort_unstable();
            start = end;
        }
        Self { build, probe }
    }
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
        let descriptors = key_descriptors(device, &refs)?;
        // The insert hashes the keys (no launch of their own), as the probes will.
        let table = HashTable::build_over_keys(device, &refs, &descriptors, valid, rows)?;
        Ok(Self {
            table,
            nulls_match,
            keys,
            descriptors,
            rows,
            matches_per_row: AtomicU64::new(1024),
            last_per_row: AtomicU64::new(UNSEEN),
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
    /// host: one host wait, most often (see [`QueuedProbe::pairs_to_host`]).
    pub fn probe(
        &self,
        keys: &[&DeviceColumn],
        valid: Option<&DeviceBuffer>,
        n: usize,
    ) -> Result<Matches> {
        match self.probe_queued(keys, valid, n, 0)? {
            Some(queued) => queued.pairs_to_host(),
            None => Ok(Matches::default()),
        }
    }

    /// The matching pairs left on the device as row indices (build rows into the build
    /// side, probe rows into the probe batch), in probe order and, within a probe row of
    /// at most 64 matches, in build order; `None` when nothing matches. One host wait (more
    /// when a build key is more duplicated than in earlier probes).
    pub fn probe_on_device(
        &self,
        keys: &[&DeviceColumn],
        valid: Option<&DeviceBuffer>,
        n: usize,
    ) -> Result<Option<(RowIndices, RowIndices)>> {
        match self.probe_queued(keys, valid, n, 0)? {
            Some(queued) => Ok(queued.finish()?.pairs),
            None => Ok(None),
        }
    }

    /// Queues a probe without waiting for the host (`None`: no probe row or no build row,
    /// so nothing can match): its matches go into outputs sized by the most matches per
    /// probe row seen so far, and the host waits once, in [`QueuedProbe::finish`], for the
    /// matches' total and `extra` words of the caller's (the byte totals of string gathers
    /// queued over the pending matches) together.
    pub fn probe_queued<'a>(
        &'a self,
        keys: &[&DeviceColumn],
        valid: Option<&'a DeviceBuffer>,
        n: usize,
        extra: usize,
    ) -> Result<Option<QueuedProbe<'a>>> {
        self.probe_queued_into(keys, valid, n, extra, None)
    }

    /// [`probe_queued`](Self::probe_queued) with the caller's totals buffer: zeroed, at
    /// least `8 + 8 * extra` bytes, word 0 the matches' count and words 1.. the caller's,
    /// which work queued before the probe may already write (an expression program's error
    /// word, at word 1, when the buffer was its status: the probe's one wait then reads it
    /// too, see [`QueuedProbe::finish_unless_failed`]). `None`: a zeroed buffer is made here.
    pub fn probe_queued_into<'a>(
        &'a self,
        keys: &[&DeviceColumn],
        valid: Option<&'a DeviceBuffer>,
        n: usize,
        extra: usize,
        totals: Option<DeviceBuffer>,
    ) -> Result<Option<QueuedProbe<'a>>> {
        self.check_probe_keys(keys, n)?;
        if n == 0 || self.rows == 0 {
            return Ok(None);
        }
        let device = self.keys[0].device();
        // The probe's count pass hashes its rows (`KeyCheck::hash_probe`): no launch of
        // its own for the hashes. It reaches the key columns through their descriptors.
        let hashes = device.alloc(n * 8)?;
        let probe_descriptors = key_descriptors(device, keys)?;
        let reached = expr::reached_columns(keys);
        let per_row = self.matches_per_row.load(Ordering::Relaxed) as usize;
        let cap = (n.saturating_mul(per_row) / 1024 + n / 8 + 1024).min(super::MAX_ROWS);
        // Word 0 the matches, then the caller's.
        let totals = match totals {
            Some(t) if t.len() >= 8 + 8 * extra && t.device() == device => t,
            Some(_) => {
                return Err(KernelError::Unsupported(format!(
                    "a probe's totals buffer shorter than {} words or on another device",
                    1 + extra
                )));
            }
            None => device.upload(&vec![0; 8 + 8 * extra])?,
        };
        let matches = self.table.probe_bounded(
            &hashes,
            valid,
            n,
            cap,
            Word::of(&totals, 0)?,
            Some(&KeyCheck {
                hash_probe: true,
                reached: &reached,
                ..self.check(&probe_descriptors)
            }),
        )?;
        Ok(Some(QueuedProbe {
            table: self,
            n,
            cap,
            valid,
            extra,
            hashes,
            probe_descriptors,
            totals,
            matches,
            probe_rows_too: false,
        }))
    }

    /// Marks in `marks` the build rows whose keys equal a key of the `n` probe rows whose
    /// bit in `valid` is set (all without it): a left semi or anti join's matches, queued
    /// with no pairs written and no host wait, the keys hashed in the kernel. One launch
    /// (and the probe keys' descriptors going up).
    pub fn mark(
        &self,
        keys: &[&DeviceColumn],
        valid: Option<&DeviceBuffer>,
        n: usize,
        marks: &JoinMarks,
    ) -> Result<()> {
        self.check_probe_keys(keys, n)?;
        if marks.rows != self.rows || marks.bits.device() != self.keys[0].device() {
            return Err(KernelError::Unsupported(
                "marks of another build side or device than the table's".into(),
            ));
        }
        if n == 0 || self.rows == 0 {
            return Ok(());
        }
        let device = self.keys[0].device();
        let probe_descriptors = key_descriptors(device, keys)?;
        let reached = expr::reached_columns(keys);
        let check = KeyCheck {
            reached: &reached,
            ..self.check(&probe_descriptors)
        };
        self.table.probe_mark(valid, n, &marks.bits, &check)
    }

    /// Fails unless `keys` are `n` probe rows of the build keys' number, types and device.
    fn check_probe_keys(&self, keys: &[&DeviceColumn], n: usize) -> Result<()> {
        if keys.len() != self.keys.len()
            || keys.iter().zip(&self.keys).any(|(p, b)| {
                p.len() != n || p.value_type() != b.value_type() || p.device() != b.device()
            })
        {
            return Err(KernelError::Unsupported(
                "probe keys of other types, lengths or devices than the build keys".into(),
            ));
        }
        Ok(())
    }

    /// The key comparison of a probe whose key columns `probe_descriptors` describes, as
    /// many as the build keys (their number, types and lengths checked by the caller).
    fn check<'a>(&'a self, probe_descriptors: &'a DeviceBuffer) -> KeyCheck<'a> {
        KeyCheck {
            build: &self.descriptors,
            probe: probe_descriptors,
            ncols: self.keys.len(),
            nulls_match: self.nulls_match,
            hash_probe: false,
            reached: &[],
        }
    }
}

/// A bitmap over a join table's build rows on its device, set by probes
/// ([`JoinTable::mark`]): the rows a left semi or anti join has matched, which the host
/// reads once for many probes ([`JoinMarks::read`]).
#[derive(Debug)]
pub struct JoinMarks {
    bits: DeviceBuffer,
    rows: usize,
}

impl JoinMarks {
    /// A bitmap for `table`'s build rows, none marked (one launch, no upload).
    pub fn new(table: &JoinTable) -> Result<Self> {
        let device = table.keys[0].device();
        let words = table.rows.div_ceil(64).max(1);
        let bits = device.alloc(words * 8)?;
        super::aggregate::fill_u64(device, &bits, words, 0)?;
        Ok(Self {
            bits,
            rows: table.rows,
        })
    }

    /// Unmarks every row (one launch, queued).
    pub fn clear(&self) -> Result<()> {
        super::aggregate::fill_u64(self.bits.device(), &self.bits, self.bits.len() / 8, 0)
    }

    /// The marked rows, a flag per build row, and the error words (word 1) of `statuses`
    /// (status buffers of the programs whose outputs masked the probes, see
    /// [`status_bytes`](super::status_bytes)), all in one host wait: `None` when one of
    /// those words is set (a program left a row to the CPU: the marks its mask let in are
    /// not the join's).
    pub fn read(&self, statuses: &[&DeviceBuffer]) -> Result<Option<Vec<bool>>> {
        let mut bits = vec![0u8; self.rows.div_ceil(8)];
        let mut words = vec![[0u8; super::STATUS_BYTES]; statuses.len()];
        let mut reads: Vec<(&DeviceBuffer, &mut [u8])> = vec![(&self.bits, &mut bits[..])];
        for (status, out) in statuses.iter().zip(words.iter_mut()) {
            if status.len() < super::STATUS_BYTES {
                return Err(KernelError::Unsupported(format!(
                    "a status buffer of {} bytes",
                    status.len()
                )));
            }
            reads.push((status, &mut out[..]));
        }
        self.bits.device().read_many(&mut reads)?;
        if words.iter().any(|w| w[8..16].iter().any(|&b| b != 0)) {
            return Ok(None);
        }
        Ok(Some(
            (0..self.rows)
                .map(|b| bits[b / 8] & (1 << (b % 8)) != 0)
                .collect(),
        ))
    }
}

/// A probe queued on the device ([`JoinTable::probe_queued`]) whose totals the host has
/// not read: its matches are pending indices that kernels queued now may read.
#[derive(Debug)]
pub struct QueuedProbe<'a> {
    table: &'a JoinTable,
    n: usize,
    cap: usize,
    valid: Option<&'a DeviceBuffer>,
    extra: usize,
    hashes: DeviceBuffer,
    probe_descriptors: DeviceBuffer,
    totals: DeviceBuffer,
    matches: (DeviceBuffer, DeviceBuffer),
    probe_rows_too: bool,
}

/// What a queued probe found.
#[derive(Debug)]
pub struct Probed {
    /// The matching build and probe rows (`None`: nothing matched).
    pub pairs: Option<(RowIndices, RowIndices)>,
    /// The caller's extra words, read in the probe's wait; `None` when the probe had more
    /// matches than its outputs had room for and ran again with exact sizes: the work
    /// queued over the pending matches then counts for nothing.
    pub words: Option<Vec<u64>>,
    /// The matches' probe rows, read in the probe's wait when the caller asked for them
    /// ([`QueuedProbe::read_probe_rows_too`]) and the guess held them all; else `None`.
    pub probe_rows: Option<Vec<u32>>,
}

impl QueuedProbe<'_> {
    /// The build rows of the matches, while they are being written.
    pub fn pending_build(&self) -> PendingIndices<'_> {
        self.pending(&self.matches.0, self.table.rows)
    }

    /// The probe rows of the matches, while they are being written.
    pub fn pending_probe(&self) -> PendingIndices<'_> {
        self.pending(&self.matches.1, self.n)
    }

    fn pending<'b>(&'b self, buffer: &'b DeviceBuffer, bound: usize) -> PendingIndices<'b> {
        // Word 0 is the matches' count: the probe writes the first min(count, cap) slots,
        // each with rows below the bounds.
        let count = Word {
            buffer: &self.totals,
            index: 0,
        };
        PendingIndices::new(buffer, self.cap, bound, count)
    }

    /// Word `k` of the caller's `extra` words: where work queued over the pending matches
    /// leaves a value for the probe's wait.
    pub fn extra_word(&self, k: usize) -> Result<Word<'_>> {
        if k >= self.extra {
            return Err(KernelError::Unsupported(format!(
                "extra word {k} of a probe queued with {}",
                self.extra
            )));
        }
        Word::of(&self.totals, 1 + k)
    }

    /// Waits once for the probe's total and the caller's words; a probe whose matches
    /// overflowed the outputs runs again with exact sizes (waiting for the total).
    pub fn finish(self) -> Result<Probed> {
        self.finish_with(false)?
            .ok_or_else(|| KernelError::InvalidData("a probe stopped with no cause".into()))
    }

    /// [`finish`](Self::finish) for a probe whose first caller word is the error word of
    /// work queued before it (a fused filter's program, whose output is the probe's row
    /// mask): `None` when that word is set, read in the same one wait — the matches are not
    /// to be used, and the probe does not run again however many there were.
    pub fn finish_unless_failed(self) -> Result<Option<Probed>> {
        self.has_error_word()?;
        self.finish_with(true)
    }

    /// Fails unless the probe has a caller word to carry an error word in.
    fn has_error_word(&self) -> Result<()> {
        match self.extra {
            0 => Err(KernelError::Unsupported(
                "a probe without a caller word cannot carry an error word".into(),
            )),
            _ => Ok(()),
        }
    }

    /// Asks [`finish`](Self::finish) (or [`finish_unless_failed`](Self::finish_unless_failed))
    /// to bring the matches' probe rows to the host in its one wait too, as many as
    /// [`pairs_to_host`](Self::pairs_to_host) would read after the table's first probe
    /// (none on it: the rows are wanted only when they are few, and a first guess would
    /// mostly read them for nothing): for a caller that may take a host batch's matched
    /// rows there ([`Probed::probe_rows`]).
    pub fn read_probe_rows_too(&mut self) {
        self.probe_rows_too = true;
    }

    /// How many matches the table's last probe predicts at its rate of matches per probe
    /// row (none before its first): what a caller weighs before asking for
    /// [`read_probe_rows_too`](Self::read_probe_rows_too).
    pub fn expected_matches(&self) -> usize {
        match self.table.last_per_row.load(Ordering::Relaxed) {
            UNSEEN => 0,
            rate => ((self.n as u64).saturating_mul(rate) / 1024).min(self.cap as u64) as usize,
        }
    }

    fn finish_with(self, stop_on_first_word: bool) -> Result<Option<Probed>> {
        let guess = if self.probe_rows_too {
            self.guess(0)
        } else {
            0
        };
        let read = self.read_total(&[&self.matches.1], guess, stop_on_first_word)?;
        let Some((total, words, mut rows)) = read else {
            return Ok(None);
        };
        let rows = rows.pop().unwrap_or_default();
        let table = self.table;
        if total <= self.cap {
            let (build, probe) = self.matches;
            return Ok(Some(Probed {
                pairs: (total > 0).then(|| {
                    (
                        RowIndices::new(build, total, table.rows, false),
                        RowIndices::new(probe, total, self.n, false),
                    )
                }),
                words: Some(words[1..].to_vec()),
                probe_rows: (guess > 0 && total <= guess).then(|| u32s_of(&rows[..total * 4])),
            }));
        }
        Ok(Some(Probed {
            pairs: self.again()?,
            words: None,
            probe_rows: None,
        }))
    }

    /// How many matches a read in the probe's wait takes: as many as the table's last
    /// probe found per probe row predict, and 1/64 of the probe rows and 256 more, at most
    /// the outputs' room. Before the table's first probe finished, `first_most` (none for
    /// a read of matches wanted only when they are few, as a join's taken rows).
    fn guess(&self, first_most: u64) -> usize {
        let n = self.n as u64;
        match self.table.last_per_row.load(Ordering::Relaxed) {
            UNSEEN => (n + n / 64 + 256).min(first_most),
            _ => self.expected_matches() as u64 + n / 64 + 256,
        }
        .min(self.cap as u64) as usize
    }

    /// Waits once for the status words and the first `guess` matches of each of `lists`
    /// (the matches' build or probe rows, as bytes): the matches' total, noted as the
    /// table's rates of matches per row, the words and the prefixes read. `None`:
    /// `stop_on_first_word` and the first caller word set.
    #[allow(clippy::type_complexity)]
    fn read_total(
        &self,
        lists: &[&DeviceBuffer],
        guess: usize,
        stop_on_first_word: bool,
    ) -> Result<Option<(usize, Vec<u64>, Vec<Vec<u8>>)>> {
        let mut words = vec![0u8; 8 + 8 * self.extra];
        let mut prefixes = vec![vec![0u8; guess * 4]; lists.len()];
        {
            let mut reads: Vec<(&DeviceBuffer, &mut [u8])> = vec![(&self.totals, &mut words)];
            reads.extend(
                lists
                    .iter()
                    .copied()
                    .zip(prefixes.iter_mut().map(Vec::as_mut_slice)),
            );
            self.totals.device().read_many(&mut reads)?;
        }
        let words = words_of(&words);
        let Some(&total) = words.first() else {
            return Err(KernelError::InvalidData("a short probe status read".into()));
        };
        if stop_on_first_word && words.get(1).is_some_and(|&w| w != 0) {
            return Ok(None);
        }
        let seen = (total.saturating_mul(1024)).div_ceil(self.n as u64);
        (self.table.matches_per_row).fetch_max(seen, Ordering::Relaxed);
        (self.table.last_per_row).store(seen, Ordering::Relaxed);
        Ok(Some((total as usize, words, prefixes)))
    }

    /// The probe run again with exact sizes, after its matches overflowed the outputs
    /// (`None`: nothing matched).
    fn again(self) -> Result<Option<(RowIndices, RowIndices)>> {
        drop(self.matches);
        // The first count pass wrote the hashes, after the keys' work: nothing to wait for.
        let table = self.table;
        let check = table.check(&self.probe_descriptors);
        let found = (table.table).probe(&self.hashes, self.valid, self.n, Some(&check))?;
        Ok((!found.build.is_empty()).then_some((found.build, found.probe)))
    }

    /// Waits for the probe and brings its pairs to the host, most often in the one wait
    /// that reads its total: that read takes as many pairs as the table's last probe
    /// found per probe row predict, and 1/64 of the probe rows more (copied whether
    /// written or not; on the table's first probe, one per probe row up to a quarter of a
    /// wait's worth of copying). A probe that found
    /// more reads the rest in a second wait; one whose matches overflowed its outputs runs
    /// again with exact sizes.
    pub fn pairs_to_host(self) -> Result<Matches> {
        self.pairs_to_host_with(false)?
            .ok_or_else(|| KernelError::InvalidData("a probe stopped with no cause".into()))
    }

    /// [`pairs_to_host`](Self::pairs_to_host) for a probe whose first caller word is the
    /// error word of work queued before it (see
    /// [`finish_unless_failed`](Self::finish_unless_failed)): `None` when that word is set.
    pub fn pairs_to_host_unless_failed(self) -> Result<Option<Matches>> {
        self.has_error_word()?;
        self.pairs_to_host_with(true)
    }

    fn pairs_to_host_with(self, stop_on_first_word: bool) -> Result<Option<Matches>> {
        // A table's first probe guesses one match per probe row (a foreign key joined to a
        // unique key), but no more pairs (8 bytes each) than the cost model copies in a
        // quarter of a wait's time (`CostModel::bytes_per_sync`): a probe that matches
        // little then loses at most a quarter of the wait a right guess saves.
        let guess = self.guess(H200.bytes_per_sync() / 4 / 8);
        let lists = [&self.matches.0, &self.matches.1];
        let Some((total, _, mut read)) = self.read_total(&lists, guess, stop_on_first_word)? else {
            return Ok(None);
        };
        let (mut probe, mut build) = (
            read.pop().unwrap_or_default(),
            read.pop().unwrap_or_default(),
        );
        if total > self.cap {
            let Some((build, probe)) = self.again()? else {
                return Ok(Some(Matches::default()));
            };
            let mut both = RowIndices::all_to_host(&[&build, &probe])?;
            let (probe, build) = (
                both.pop().unwrap_or_default(),
                both.pop().unwrap_or_default(),
            );
            return Ok(Some(Matches::from_probe(build, probe)));
        }
        build.resize(total * 4, 0);
        probe.resize(total * 4, 0);
        if total > guess {
            // The pairs past the guess, in a second wait.
            self.totals.device().read_ranges(&mut [
                (&self.matches.0, guess * 4, &mut build[guess * 4..]),
                (&self.matches.1, guess * 4, &mut probe[guess * 4..]),
            ])?;
        }
        Ok(Some(Matches::from_probe(u32s_of(&build), u32s_of(&probe))))
    }
}
