//! A batch added straight from an expression program's registers (`cuda/fused.cu`): the
//! group keys, the row selection and every accumulator's value and filter are outputs of
//! one program, which `agg_fused` evaluates per row and feeds to the accumulators in the
//! same kernel. No argument column, selection, row hash or group id is ever written, so a
//! batch's input columns are read once (Crystal's fused tiles).
//!
//! ```text
//! upload: status, program, spec, descriptors ─► agg_fused ─► wait: status ─► agg_merge_delta
//!                                                 (into per-batch deltas)      (apply or discard)
//! ```
//!
//! The kernel finds groups but never inserts one, and adds into per-batch deltas; only once
//! the one host wait has shown that no row was left to the CPU and that every row's key had
//! its group does the merge apply the deltas to the table. Otherwise it only resets them,
//! and the table is as it was: the caller then adds the batch the ordinary way
//! ([`GroupTable::update_with`], which inserts groups), or on the CPU. A table without
//! groups first takes the keys of a batch's first rows ([`GroupTable::insert_groups`],
//! which reads only the key columns).

use super::*;
use crate::ops::expr::{self, OutKind, Program};

/// Most registers (program outputs) a fused program may have (`FUSED_MAX_REGS`).
pub const MAX_REGISTERS: usize = 32;
/// Most accumulators a fused update may feed (`FUSED_MAX_ACCS`).
pub const MAX_FUSED_ACCS: usize = 32;
/// Most groups a fused update takes: its per-block tables live in shared memory.
const MAX_FUSED_GROUPS: usize = 4096;
/// Rows a keyed table must have had per group, on average, before it tries fused batches.
pub const FUSED_ROWS_PER_GROUP: u64 = 16;
/// Most ordinary batches a keyed table goes through after fused tries that met new keys.
const MAX_FUSED_BACKOFF: u32 = 64;
/// No register (`FUSED_NO_REG`).
const NO_REG: u64 = u64::MAX;

/// Which register (program output) feeds what, for [`GroupTable::update_fused`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FusedSpec {
    /// The register of each group key, in the table's key order; each of the key's type.
    pub keys: Vec<usize>,
    /// The register of the row selection (a boolean: a fused filter's predicate), if any.
    pub rows: Option<usize>,
    /// Each accumulator's inputs, in the table's order.
    pub accs: Vec<FusedInput>,
}

/// One accumulator's registers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FusedInput {
    /// Its values; `None` counts rows (`count(*)`).
    pub value: Option<usize>,
    /// A boolean: only rows where it is true contribute (`FILTER (WHERE …)`).
    pub filter: Option<usize>,
}

/// What became of a batch offered to [`GroupTable::update_fused`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fused {
    /// The batch is in the table.
    Added,
    /// Some row's key has no group yet: nothing was added. Add the batch with
    /// [`GroupTable::update_with`], which inserts groups.
    NewGroups,
    /// Some row met a case the program leaves to the CPU: nothing was added.
    LeftToCpu,
}

/// The accumulators' per-batch deltas, for `groups` groups.
#[derive(Debug)]
pub(super) struct Deltas {
    groups: usize,
    accs: Vec<Acc>,
    /// Just allocated: a reset (`agg_merge_delta` applying nothing) must run first.
    fresh: bool,
}

impl GroupTable {
    /// Bytes of the per-block tables a fused update of `groups` groups keeps in shared
    /// memory: each accumulator's counts and state words.
    fn fused_shared_bytes(&self, groups: usize) -> usize {
        let per_group: usize = self.accs.iter().map(|a| (1 + a.op.words()) * 8).sum();
        groups * per_group
    }

    /// Whether the table can take fused batches at all, now: no accumulator that updates
    /// under a lock (decimal minimum and maximum), and few enough groups for the kernel's
    /// per-block tables.
    pub fn fused_possible(&self) -> bool {
        self.fused_possible_with(if self.keyed { self.groups } else { 1 })
    }

    fn fused_possible_with(&self, groups: usize) -> bool {
        !self.accs.iter().any(|a| a.op.locked())
            && self.accs.len() <= MAX_FUSED_ACCS
            && groups <= MAX_FUSED_GROUPS
            && self.fused_shared_bytes(groups) <= SHARED_BYTES
    }

    /// Whether [`update_fused`](Self::update_fused) may take the next batch: it can
    /// ([`fused_possible`](Self::fused_possible)) and, with keys, the table has groups
    /// (the kernel inserts none; [`insert_groups`](Self::insert_groups) of a first batch's
    /// keys gives it some) that look complete: each has had at least
    /// [`FUSED_ROWS_PER_GROUP`] rows so far on average. An aggregation by order or by
    /// customer, whose batches keep bringing new keys, has a handful of rows a group and
    /// goes the ordinary way; TPC-H Q1's four groups have had thousands of rows each after
    /// the first batch. Should a fused batch meet keys without a group all the same, it is
    /// done the ordinary way, and the next 1, then 2, 4 … up to 64 batches after misses in
    /// a row go the ordinary way too.
    pub fn fused_ready(&self) -> bool {
        self.fused_possible()
            && (!self.keyed
                || (self.groups > 0
                    && self.rows_seen >= FUSED_ROWS_PER_GROUP * self.groups as u64
                    && self.fused_skips == 0))
    }

    /// Adds a batch of `n` rows whose keys, row selection and accumulator inputs are the
    /// outputs of `program` over `columns` (its load slots), as `spec` says, without writing
    /// any of them to memory: one upload, two launches and one host wait. Nothing is added
    /// unless [`Fused::Added`] comes back.
    pub fn update_fused(
        &mut self,
        program: &Program,
        columns: &[&DeviceColumn],
        n: usize,
        spec: &FusedSpec,
    ) -> Result<Fused> {
        let device = self.device.clone();
        expr::check_inputs(&device, program, columns, n)?;
        if !self.fused_ready() {
            return Err(KernelError::Unsupported(
                "a fused update of a table that is not ready for one".into(),
            ));
        }
        let descriptors = self.fused_descriptors(program, spec)?;
        if n == 0 {
            return Ok(Fused::Added);
        }
        self.carry_exact_sums(n)?;
        let groups = if self.keyed { self.groups } else { 1 };
        if self.deltas.as_ref().is_none_or(|d| d.groups != groups) {
            self.deltas = Some(self.new_deltas(groups)?);
        }
        let outcome = self.run_fused(program, columns, n, spec, &descriptors, groups);
        match outcome {
            Ok(Fused::Added) => {
                self.rows_seen += n as u64;
                self.fused_updates += 1;
                self.new_per_row = Some(0);
                self.fused_backoff = 1;
            }
            Ok(Fused::NewGroups) => {
                self.fused_skips = self.fused_backoff;
                self.fused_backoff = (self.fused_backoff * 2).min(MAX_FUSED_BACKOFF);
            }
            Ok(Fused::LeftToCpu) => {}
            // Deltas a failed launch may have written part of are not used again.
            Err(_) => self.deltas = None,
        }
        outcome
    }

    /// Queues the fused kernel, waits for its status and merges or resets the deltas.
    fn run_fused(
        &mut self,
        program: &Program,
        columns: &[&DeviceColumn],
        n: usize,
        spec: &FusedSpec,
        descriptors: &[[u64; 4]],
        groups: usize,
    ) -> Result<Fused> {
        let device = self.device.clone();
        let deltas = self
            .deltas
            .as_ref()
            .ok_or_else(|| KernelError::InvalidData("a fused update without deltas".into()))?;
        let mut accs = Vec::with_capacity(8 * self.accs.len());
        for ((acc, delta), words) in self.accs.iter().zip(&deltas.accs).zip(descriptors) {
            accs.extend(words.iter().map(|&w| w as i64));
            accs.extend(
                [
                    delta.state.as_ref().map_or(0, DeviceBuffer::addr),
                    delta.counts.addr(),
                    acc.state.as_ref().map_or(0, DeviceBuffer::addr),
                    acc.counts.addr(),
                ]
                .map(|w| w as i64),
            );
        }
        let mut spec_words = vec![
            spec.keys.len() as i64,
            spec.rows.map_or(NO_REG, |r| r as u64) as i64,
        ];
        spec_words.extend(spec.keys.iter().map(|&k| k as i64));
        // The key store: every committed chunk's key descriptors, and where each starts.
        let mut store = Vec::new();
        for chunk in &self.chunks {
            for key in chunk {
                store.extend(super::super::key_descriptor(key)?.map(|w| w as i64));
            }
        }
        let starts: Vec<i64> = self.starts.iter().map(|&s| s as i64).collect();
        // One upload: the status words (zero), the program, the spec, the descriptors, the
        // key store and its starts.
        let packed = expr::pack(
            program,
            columns,
            &[0, 0],
            &[&spec_words, &accs, &store, &starts],
        );
        let upload = device.upload(&packed.bytes)?;
        let part = |k: usize| {
            let (offset, len) = packed.ranges[k];
            Arg::part(&upload, offset, len)
        };
        let mut reached = expr::reached_columns(columns);
        for chunk in &self.chunks {
            for key in chunk {
                reached.push(key.values());
                reached.extend(key.validity());
                reached.extend(key.offsets());
                reached.extend(key.dictionary().into_iter().flat_map(|d| d.buffers()));
            }
        }
        reached.extend(self.slots.as_ref().filter(|_| self.keyed));
        for delta in &deltas.accs {
            reached.extend(delta.state.as_ref());
            reached.push(&delta.counts);
        }
        let mut merge_reached: Vec<&DeviceBuffer> = Vec::new();
        for (acc, delta) in self.accs.iter().zip(&deltas.accs) {
            merge_reached.extend(delta.state.as_ref());
            merge_reached.push(&delta.counts);
            merge_reached.extend(acc.state.as_ref());
            merge_reached.push(&acc.counts);
        }
        let merge = |apply: bool| {
            // SAFETY: the descriptors (in the upload, after the spec) name each
            // accumulator's deltas, sized for `groups` groups, and its state and counts,
            // sized for at least `group_capacity` >= `groups`; with `apply` false the
            // deltas are only written.
            unsafe {
                device.launch_reaching(
                    Kernel::agg_merge_delta,
                    LaunchConfig::for_items(&device, groups as u64, BLOCK),
                    &[
                        part(5),
                        Arg::U32(self.accs.len() as u32),
                        Arg::U64(groups as u64),
                        Arg::U32(u32::from(apply)),
                    ],
                    &merge_reached,
                )
            }
        };
        if deltas.fresh {
            merge(false)?;
        }
        let mut cfg = LaunchConfig::for_items(&device, n as u64, BLOCK);
        cfg.shared_bytes = self.fused_shared_bytes(groups).max(8) as u32;
        let (slots, mask) = match (&self.slots, self.keyed) {
            (Some(slots), true) => (Some(slots), self.capacity - 1),
            _ => (None, 0),
        };
        // SAFETY: `check_inputs` validated the program (opcodes, stack depth, loads of
        // columns of the layouts they read, constants, outputs written in order) and that
        // every column holds n rows on this device; `fused_descriptors` checked that every
        // register the spec and the descriptors name is an output of the program (at most
        // MAX_REGISTERS), of the type its use needs (the keys the table's key types, the
        // selection and filters booleans, values an input kind the accumulator takes), that
        // there is a register per key and a descriptor per accumulator (at most
        // MAX_FUSED_ACCS, none locked); the deltas hold `groups` groups of each
        // accumulator's state and counts, the shared tables fit `shared_bytes` (at most
        // SHARED_BYTES); with keys, the slots hold `capacity` committed entries (no pending
        // one between batches), fewer than half full, so every probe meets an empty slot,
        // and the store's descriptors and starts give every committed group id a chunk; the
        // status words are the first 16 bytes of the upload, zero.
        unsafe {
            device.launch_reaching(
                Kernel::agg_fused,
                cfg,
                &[
                    part(1),
                    Arg::U64(program.len() as u64),
                    part(2),
                    part(8),
                    part(3),
                    Arg::U64(n as u64),
                    part(4),
                    part(5),
                    Arg::U32(self.accs.len() as u32),
                    Arg::opt(slots),
                    Arg::U64(mask),
                    part(6),
                    part(7),
                    Arg::U32(self.chunks.len() as u32),
                    Arg::U64(groups as u64),
                    part(0),
                ],
                &reached,
            )?;
        }
        // The one host wait: rows left to the CPU (word 1) and rows without a group (word 0).
        let outcome = match super::super::read_status(&upload)? {
            None => Fused::LeftToCpu,
            Some(0) => Fused::Added,
            Some(_) => Fused::NewGroups,
        };
        merge(outcome == Fused::Added)?;
        if let Some(deltas) = &mut self.deltas {
            deltas.fresh = false;
        }
        Ok(outcome)
    }

    /// The first four words of each accumulator's `FusedAcc` descriptor (op, input kind,
    /// value and filter registers), after checking every register `spec` names.
    fn fused_descriptors(&self, program: &Program, spec: &FusedSpec) -> Result<Vec<[u64; 4]>> {
        fn bad<T>(what: String) -> Result<T> {
            Err(KernelError::Unsupported(format!("a fused update: {what}")))
        }
        let count = program.output_count();
        if count > MAX_REGISTERS {
            return bad(format!("{count} registers (at most {MAX_REGISTERS})"));
        }
        let register = |k: usize| -> Result<&(OutKind, DataType)> {
            match program.output_at(k) {
                Some(output) => Ok(output),
                None => bad(format!("register {k} of {count}")),
            }
        };
        let boolean = |k: usize| -> Result<()> {
            match register(k)? {
                (OutKind::Bool, _) => Ok(()),
                (_, t) => bad(format!("a {t} register as a row selection or filter")),
            }
        };
        if spec.keys.len() != self.key_types.len() {
            return bad(format!(
                "{} key registers for {} keys",
                spec.keys.len(),
                self.key_types.len()
            ));
        }
        for (&k, t) in spec.keys.iter().zip(&self.key_types) {
            let (_, have) = register(k)?;
            if have != t {
                return bad(format!("a {have} register for a {t} key"));
            }
        }
        if let Some(rows) = spec.rows {
            boolean(rows)?;
        }
        if spec.accs.len() != self.accs.len() {
            return bad(format!(
                "{} inputs for {} accumulators",
                spec.accs.len(),
                self.accs.len()
            ));
        }
        let mut descriptors = Vec::with_capacity(self.accs.len());
        for (acc, input) in self.accs.iter().zip(&spec.accs) {
            if let Some(filter) = input.filter {
                boolean(filter)?;
            }
            let kind = match input.value {
                None if acc.op == AccOp::Count => INPUT_NONE,
                None => return bad(format!("{:?} without values", acc.op)),
                // A count reads only whether the value is NULL, whatever its type.
                Some(v) if acc.op == AccOp::Count => {
                    register(v)?;
                    INPUT_NONE
                }
                Some(v) => {
                    let (out, t) = register(v)?;
                    if *out == OutKind::Str {
                        return bad(format!("{:?} of strings", acc.op));
                    }
                    let kind = input_kind_of(t)?;
                    let decimal_op = matches!(
                        acc.op,
                        AccOp::SumDecimal | AccOp::MinDecimal | AccOp::MaxDecimal
                    );
                    if matches!(t, DataType::Decimal128(..)) && !decimal_op {
                        return bad(format!("{:?} of decimal values", acc.op));
                    }
                    kind
                }
            };
            descriptors.push([
                acc.op.code(),
                kind,
                input.value.map_or(NO_REG, |v| v as u64),
                input.filter.map_or(NO_REG, |f| f as u64),
            ]);
        }
        Ok(descriptors)
    }

    /// Deltas for `groups` groups, not yet set to their identity (`fresh`).
    fn new_deltas(&self, groups: usize) -> Result<Deltas> {
        let device = &self.device;
        let accs = self
            .accs
            .iter()
            .map(|acc| {
                let words = acc.op.words();
                Ok(Acc {
                    op: acc.op,
                    state: (words > 0)
                        .then(|| device.alloc(groups * words * 8))
                        .transpose()?,
                    counts: device.alloc(groups * 8)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Deltas {
            groups,
            accs,
            fresh: true,
        })
    }
}
