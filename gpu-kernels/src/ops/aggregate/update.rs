//! How a group table takes a batch: its keys found or inserted (new groups numbered and
//! their keys gathered), then every accumulator updated, all or nothing.

use super::*;
use std::sync::Arc;

/// `agg_resolve`'s arguments but its last two (the row count and the group ids): what
/// `agg_update` takes to resolve each row's group itself.
const RESOLVE_ARGS: usize = 10;

impl GroupTable {
    /// Adds a batch of `n` rows: its key columns (in the table's key types) and each
    /// accumulator's input, in the order of the table's accumulators.
    pub fn update(
        &mut self,
        keys: &[&DeviceColumn],
        inputs: &[AccInput<'_>],
        n: usize,
    ) -> Result<()> {
        self.update_with(keys, inputs, n, UpdateWith::default())
            .map(|_| ())
    }

    /// [`update`](Self::update), taking only the rows `with.rows` selects and, when
    /// `with.status` is given, first checking in the same host wait as its own that the
    /// upstream work it names succeeded. `Ok(false)`: the status word was set, and the table
    /// is as it was.
    pub fn update_with(
        &mut self,
        keys: &[&DeviceColumn],
        inputs: &[AccInput<'_>],
        n: usize,
        with: UpdateWith<'_>,
    ) -> Result<bool> {
        self.add_batch(keys, Some(inputs), n, with)
    }

    /// Inserts the groups of a batch's keys (of the rows `with.rows` selects) that the
    /// table does not have yet, and updates no accumulator: what a batch with new keys
    /// does before [`update_fused`](Self::update_fused) adds its values. With
    /// `with.status`, `Ok(false)`: the upstream work failed, and the table is as it was.
    pub fn insert_groups(
        &mut self,
        keys: &[&DeviceColumn],
        n: usize,
        with: UpdateWith<'_>,
    ) -> Result<bool> {
        if !self.keyed {
            return Err(KernelError::Unsupported(
                "inserting groups into a table without keys".into(),
            ));
        }
        self.add_batch(keys, None, n, with)
    }

    /// Adds a batch: inserts its new groups and, with `inputs`, updates the accumulators.
    pub(super) fn add_batch(
        &mut self,
        keys: &[&DeviceColumn],
        inputs: Option<&[AccInput<'_>]>,
        n: usize,
        with: UpdateWith<'_>,
    ) -> Result<bool> {
        if inputs.is_some() {
            // An ordinary batch: one fewer to go before the next fused try.
            self.fused_skips = self.fused_skips.saturating_sub(1);
        }
        check_rows(n)?;
        self.rows_seen += n as u64;
        if let Some(rows) = with.rows
            && (rows.layout() != Layout::Bits || rows.len() != n || rows.device() != &self.device)
        {
            return Err(KernelError::Unsupported(
                "a row selection that is not a boolean column of the batch's rows".into(),
            ));
        }
        if with.status.is_some_and(|s| s.len() < STATUS_BYTES) {
            return Err(KernelError::Unsupported(format!(
                "a status buffer of fewer than {STATUS_BYTES} bytes"
            )));
        }
        if inputs.is_some_and(|inputs| inputs.len() != self.accs.len()) {
            return Err(KernelError::Unsupported(format!(
                "{} accumulator inputs for {} accumulators",
                inputs.map_or(0, <[_]>::len),
                self.accs.len()
            )));
        }
        for input in inputs.unwrap_or_default() {
            for column in input.values.iter().chain(input.filter.iter()) {
                if column.len() != n || column.device() != &self.device {
                    return Err(KernelError::Unsupported(
                        "an aggregate input of another length or device".into(),
                    ));
                }
            }
            if input.filter.is_some_and(|f| f.layout() != Layout::Bits) {
                return Err(KernelError::Unsupported("a non-boolean filter".into()));
            }
        }
        if n == 0 {
            return Ok(true);
        }
        if !self.keyed {
            if with.rows.is_some() {
                return Err(KernelError::Unsupported(
                    "a row selection for an aggregation without keys".into(),
                ));
            }
            if let Some(status) = with.status
                && status.read_u64(1)? != 0
            {
                return Ok(false);
            }
            let inputs = inputs.unwrap_or_default();
            self.carry_exact_sums(n)?;
            let descriptors = self.accumulator_descriptors(&self.accs, inputs)?;
            let reached = reached_by(&self.accs, inputs);
            let shared = self.launch_update(
                &descriptors,
                &reached,
                None,
                None,
                n,
                1,
                self.locks.as_ref(),
            )?;
            self.count_update(shared);
            return Ok(true);
        }
        if n >= MAX_KEYED_ROWS {
            return Err(KernelError::Unsupported(format!(
                "keyed batches of {n} rows (fewer than 2^31 - 1 rows fit)"
            )));
        }
        if keys.len() != self.key_types.len()
            || keys
                .iter()
                .zip(&self.key_types)
                .any(|(k, t)| k.value_type() != t || k.len() != n || k.device() != &self.device)
        {
            return Err(KernelError::Unsupported(
                "group keys of other types, lengths or devices than the table's".into(),
            ));
        }
        if self.groups + n > MAX_GROUPS {
            return Err(KernelError::Unsupported(format!(
                "more than {MAX_GROUPS} groups"
            )));
        }
        let device = self.device.clone();
        let g0 = self.groups;
        let cfg = LaunchConfig::for_items(&device, n as u64, BLOCK);
        // The rows' hashes, which the first find-or-insert computes from the key
        // descriptors (`hash_here`) and writes here for the rest of the batch.
        let hashes = device.alloc(n * 8)?;
        let mut hash_here = true;
        // The key columns it hashes and compares through their descriptors, whose work may
        // be queued on another stream.
        let reached = super::super::expr::reached_columns(keys);
        let batch_desc = key_descriptors(&device, keys)?;
        let mut store_desc = Vec::new();
        for chunk in &self.chunks {
            for key in chunk {
                store_desc.extend(super::super::key_descriptor(key)?);
            }
        }
        let store_desc = upload_words(&device, &store_desc)?;
        let mut starts = self.starts.clone();
        starts.push(g0 as u64);
        let starts = upload_words(&device, &starts)?;
        // Carrying changes no sum, so it goes first: nothing is pending yet should it fail.
        self.carry_exact_sums(n)?;
        let refs = device.alloc(n * 4)?;
        // Each new group's first row (n u32), which the insert sets at the inserting row's
        // own entry and lowers to the least row with the group's key: no fill, and no
        // launch of its own.
        let first = device.alloc(n.div_ceil(2) * 8)?;
        // The count of new groups (word 0, zeroed here before every attempt, so that no
        // caller's value can pass for "no new group"), and word 1, the upstream status the
        // caller zeroed.
        let own_status;
        let inserted = match with.status {
            Some(status) => status,
            None => {
                own_status = device.alloc(8)?;
                &own_status
            }
        };
        // The new groups' string keys, measured over each insert before its wait (see
        // `NewStrings`) where the last batch brought new groups or there was none: a table
        // whose batches bring none would queue that for nothing.
        let strings: Vec<usize> = (0..keys.len())
            .filter(|&k| keys[k].offsets().is_some())
            .collect();
        let strings_early = !strings.is_empty() && self.new_per_row != Some(0);
        // The count of new groups and, with `measured`, the new strings' totals, in one
        // wait; `None`: the upstream work failed.
        let wait_count = |measured: Option<&NewStrings>| -> Result<Option<(u64, Vec<u64>)>> {
            let mut status = [0u8; STATUS_BYTES];
            let words = if with.status.is_some() { 2 } else { 1 };
            let mut totals = vec![0u8; measured.map_or(0, |m| m.totals.len())];
            let mut reads: Vec<(&DeviceBuffer, &mut [u8])> =
                vec![(inserted, &mut status[..8 * words])];
            if let Some(m) = measured {
                reads.push((&m.totals, &mut totals[..]));
            }
            device.read_many(&mut reads)?;
            let status = words_of(&status);
            if status[1] != 0 {
                return Ok(None);
            }
            Ok(Some((status[0], words_of(&totals))))
        };
        // Room for the groups there are and, with an eighth to spare, as many new ones per
        // row as the last batch brought (the first batch: every row, up to FIRST_GUESS): a
        // batch that brings more than there is room for is undone and done again, which
        // costs another pass and wait.
        let expected = match self.new_per_row {
            Some(per_row) => (n as u64).saturating_mul(per_row) / 1024,
            None => {
                // At most one group per 256 bytes of memory left: their slots (18 to 36
                // bytes a group, rounded up to a power of two) take at most a seventh of it,
                // so the guess does not crowd out the batch's own buffers.
                let (used, _) = device.memory_usage();
                let room = device.memory_budget().saturating_sub(used) as u64 / 256;
                (n as u64).min(FIRST_GUESS).min(room)
            }
        };
        let expected = (expected + expected / 8).min(n as u64);
        let (inserted_count, early) = loop {
            let wanted = ((g0 as u64 + expected) * 2)
                .max(MIN_SLOTS)
                .next_power_of_two();
            if self.slots.is_none() || self.capacity < wanted {
                let first_guess = self.new_per_row.is_none() && self.slots.is_some();
                match self.rebuilt_slots(wanted) {
                    Ok(slots) => {
                        self.slots = Some(slots);
                        self.capacity = wanted;
                    }
                    // The first batch's guess does not fit beside what the device holds:
                    // the table's first slots do, and grow if the batch needs them to.
                    Err(KernelError::OutOfDeviceMemory { .. }) if first_guess => {}
                    Err(e) => return Err(e),
                }
            }
            let slots = self.slots.as_ref().expect("slots were just built");
            let limit = self.capacity / 2 - g0 as u64;
            inserted.write(0, &0u64.to_le_bytes())?;
            // SAFETY: `slots` holds `capacity` u64 (mask capacity - 1) with fewer than
            // capacity / 2 used, and inserts stop at `limit` more, so a free slot always
            // remains; `hashes` (written by the first launch, `hash_here`) and `refs`
            // hold n rows; the descriptors point at key
            // columns of n rows (batch) and of the committed chunks, whose `starts` give
            // every committed group id a chunk; `inserted` holds one u64 (zeroed just
            // before); `first` holds n u32; `rows`, when given, is a boolean column of n rows (checked), its
            // values and validity ceil(n/8) bytes or more.
            unsafe {
                device.launch_reaching(
                    Kernel::agg_find_or_insert,
                    cfg,
                    &[
                        Arg::buf(slots),
                        Arg::U64(self.capacity - 1),
                        Arg::buf(&hashes),
                        Arg::U64(n as u64),
                        Arg::buf(&batch_desc),
                        Arg::buf(&store_desc),
                        Arg::buf(&starts),
                        Arg::U32(self.chunks.len() as u32),
                        Arg::U32(keys.len() as u32),
                        Arg::U64(limit),
                        Arg::buf(inserted),
                        Arg::buf(&refs),
                        Arg::buf(&first),
                        Arg::opt(with.rows.map(DeviceColumn::values)),
                        Arg::opt(with.rows.and_then(DeviceColumn::validity)),
                        Arg::U32(u32::from(hash_here)),
                    ],
                    &reached,
                )
            }
            .inspect_err(|_| {
                let _ = self.rollback(g0);
            })?;
            // Every taken row's hash is written now (before its row's probe), for a retry.
            hash_here = false;
            let measured = match strings_early {
                true => match NewStrings::queue(&device, keys, &strings, &refs, &first) {
                    Ok(m) => Some(m),
                    Err(e) => {
                        let _ = self.rollback(g0);
                        return Err(e);
                    }
                },
                false => None,
            };
            let (count, totals) = match wait_count(measured.as_ref()) {
                Ok(Some(read)) => read,
                Ok(None) => {
                    // The upstream work failed: its outputs (these keys) are not to be used.
                    self.rollback(g0)?;
                    return Ok(false);
                }
                Err(e) => {
                    let _ = self.rollback(g0);
                    return Err(e);
                }
            };
            if count <= limit {
                break (count, measured.map(|m| (m, totals)));
            }
            // Too many new keys for the table: undo, grow for the worst case, retry.
            drop(measured);
            self.rollback(g0)?;
            let grown = ((g0 + n) as u64 * 2).next_power_of_two();
            let slots = self.rebuilt_slots(grown)?;
            self.slots = Some(slots);
            self.capacity = grown;
        };
        self.new_per_row = Some((inserted_count.saturating_mul(1024)).div_ceil(n.max(1) as u64));
        if inserted_count == 0 {
            // No new group: every ref is a committed group id (or SKIP), the table's slots
            // are unchanged, and the accumulators are updated by the refs at once.
            let Some(inputs) = inputs else {
                return Ok(true);
            };
            let descriptors = self.accumulator_descriptors(&self.accs, inputs)?;
            let reached = reached_by(&self.accs, inputs);
            let shared = self.launch_update(
                &descriptors,
                &reached,
                Some(&refs),
                None,
                n,
                g0,
                self.locks.as_ref(),
            )?;
            self.count_update(shared);
            return Ok(true);
        }
        // From here until the commit the table holds pending slots: any failure rolls
        // them back before returning. String keys' new bytes the insert's wait did not
        // bring are measured in a wait of their own, before anything is allocated for the
        // new groups (the wait leaves the pool's blocks free of queued work).
        let measured = match early {
            Some(early) => Ok(Some(early)),
            None if !strings.is_empty() => {
                NewStrings::queue(&device, keys, &strings, &refs, &first).and_then(|m| {
                    let totals = words_of(&m.totals.to_host()?);
                    Ok(Some((m, totals)))
                })
            }
            None => Ok(None),
        };
        let result = measured.and_then(|measured| {
            self.commit_batch(
                keys,
                inputs,
                n,
                (&hashes, &refs, &first),
                inserted_count,
                measured,
            )
        });
        if let Err(e) = result {
            // A failed rollback is the error to report (the table is no longer as it was),
            // unless the device is gone: then the rollback fails only for that, and the
            // first error says why.
            return Err(match self.rollback(g0) {
                Err(rollback) if !e.device_gone() => rollback,
                _ => e,
            });
        }
        result.map(|()| true)
    }

    /// Numbers the `inserted` new groups the insert left pending in `refs` (one slot each,
    /// so one leader row each; `found` is the insert's hashes, refs and first rows),
    /// gathers their keys and, with `inputs`, updates the accumulators, with no host wait.
    /// `measured`: the string keys' new bytes, measured and their totals read (wherever a
    /// key is a string; a string key left unmeasured is gathered with a wait of its own).
    pub(super) fn commit_batch(
        &mut self,
        keys: &[&DeviceColumn],
        inputs: Option<&[AccInput<'_>]>,
        n: usize,
        found: (&DeviceBuffer, &DeviceBuffer, &DeviceBuffer),
        inserted: u64,
        measured: Option<(NewStrings, Vec<u64>)>,
    ) -> Result<()> {
        let (hashes, refs, first) = found;
        let device = self.device.clone();
        let g0 = self.groups;
        let new = inserted as usize;
        if new > n {
            return Err(KernelError::InvalidData(format!(
                "{new} new groups in a batch of {n} rows"
            )));
        }
        let total = g0 + new;
        let mut starts: Vec<Option<gather::QueuedStarts>> = (0..keys.len()).map(|_| None).collect();
        let mut byte_totals = vec![0u64; keys.len()];
        let mut string_ranks = None;
        if let Some((measured, totals)) = measured {
            if totals.len() != 1 + measured.starts.len() {
                return Err(KernelError::InvalidData(
                    "a short read of new groups".into(),
                ));
            }
            if totals[0] != inserted {
                return Err(KernelError::InvalidData(format!(
                    "{} leader rows for {inserted} new groups",
                    totals[0]
                )));
            }
            for ((k, started), &bytes) in measured.starts.into_iter().zip(&totals[1..]) {
                starts[k] = Some(started);
                byte_totals[k] = bytes;
            }
            string_ranks = Some((measured.flags, measured.ranks));
        }
        let grown = if total > self.group_capacity {
            Some(self.grown(total.max(self.group_capacity * 2), None)?)
        } else {
            None
        };
        let group_hashes = grown
            .as_ref()
            .map_or(self.group_hashes.as_ref(), |g| g.group_hashes.as_ref())
            .ok_or_else(|| KernelError::InvalidData("a keyed table without hashes".into()))?;
        let leaders = device.alloc(new.max(1) * 4)?;
        // Whether the ranks' launch wrote the leaders and their hashes too.
        let (flags, ranks, leaders_written) = if let Some((flags, ranks)) = string_ranks {
            (flags, ranks, false)
        } else {
            let flags = device.alloc(n * 8)?;
            let ranks = device.alloc(n * 8)?;
            // n > 0 here (a batch adds groups), so the scan writes its total: no zeroing.
            let totals = device.alloc(8)?;
            let count = Word::of(&totals, 0)?;
            // The flags, their scan and the leaders in one launch where the look-back
            // state holds the tiles (up to 16 Mi rows).
            let one_pass = scan::one_pass(
                &device,
                (n as u64).div_ceil(scan::TILE),
                |cfg, state, epoch| {
                    // SAFETY: as `leader_flags`; `flags` and `ranks` hold n u64, `count` one;
                    // the look-back state and epoch are `one_pass`'s, a block of SCAN_THREADS
                    // per tile of the n rows; the leaders' ranks are below `new` (one
                    // leader per new group), which `leaders` holds, and g0 + rank < total
                    // <= the group hashes' capacity; `hashes` holds n u64; the arguments
                    // follow agg.cu's signature.
                    unsafe {
                        device.launch(
                            Kernel::agg_leader_ranks,
                            cfg,
                            &[
                                Arg::buf(refs),
                                Arg::buf(first),
                                Arg::U64(n as u64),
                                state,
                                Arg::U64(scan::LOOKBACK_TILES),
                                Arg::U64(epoch),
                                Arg::buf(&flags),
                                Arg::buf(&ranks),
                                count.arg(),
                                Arg::buf(hashes),
                                Arg::U64(g0 as u64),
                                Arg::buf(&leaders),
                                Arg::buf(group_hashes),
                            ],
                        )
                    }
                },
            )?;
            if one_pass {
                (flags, Arc::new(ranks), true)
            } else {
                drop(ranks);
                leader_flags(&device, refs, first, n, Arg::buf(&flags))?;
                let ranks = scan::exclusive_scan_queued(&device, &flags, n, count)?;
                (flags, Arc::new(ranks), false)
            }
        };
        let slots = self
            .slots
            .as_ref()
            .ok_or_else(|| KernelError::InvalidData("a keyed table without slots".into()))?;
        // agg_resolve's arguments but `n` and the group ids: the rows' group ids, the new
        // groups' leaders and hashes (unless the ranks' launch wrote them: null leaders),
        // and the slots' pending ids made committed ones (the table's first change, undone
        // by a rollback).
        // The flags, the hashes and the groups' hashes serve only to write the leaders.
        let for_leaders = |arg: Arg| if leaders_written { Arg::Ptr(0) } else { arg };
        let resolve = [
            Arg::buf(refs),
            Arg::buf(first),
            Arg::part(&ranks, 0, 8 * n),
            for_leaders(Arg::part(&flags, 0, 8 * n)),
            for_leaders(Arg::buf(hashes)),
            Arg::U64(g0 as u64),
            for_leaders(Arg::buf(&leaders)),
            for_leaders(Arg::buf(group_hashes)),
            Arg::buf(slots),
            Arg::U64(self.capacity),
        ];
        let accs = grown.as_ref().map_or(&self.accs, |g| &g.accs);
        let descriptors = inputs
            .map(|inputs| self.accumulator_descriptors(accs, inputs))
            .transpose()?;
        // With the leaders written, the update resolves each row's group where it reads it
        // and fixes the slots in its own launch, where agg_resolve took one of its own; it
        // comes last, after the keys' gather, which may fail, as the update must not have
        // run then.
        let merged = leaders_written && descriptors.is_some();
        let gids = match merged {
            true => None,
            false => {
                let gids = device.alloc(n * 4)?;
                let mut args = resolve.to_vec();
                args.extend([Arg::U64(n as u64), Arg::buf(&gids)]);
                // SAFETY: ranks are the exclusive scan of the 0/1 flags, so leader ranks
                // are below `new`, and g0 + rank < total <= the hashes' capacity; every
                // pending id's `first` row is a leader (it set its own flag); `slots`
                // holds `capacity` u64, whose pending ids index `first` (n rows); `gids`
                // holds n u32.
                unsafe {
                    device.launch(
                        Kernel::agg_resolve,
                        LaunchConfig::for_items(&device, (n as u64).max(self.capacity), BLOCK),
                        &args,
                    )?;
                }
                Some(gids)
            }
        };
        let leaders = RowIndices::new(leaders, new, n, false);
        // Strings from their queued starts; the other keys together (six to a launch).
        let started = starts.into_iter().zip(byte_totals);
        let started = started.map(|(s, total)| s.map(|s| (s, total))).collect();
        let chunk = gather::gather_columns_started(keys, &leaders, started)?;
        // The accumulators in one launch (which either runs or not; grown accumulators are
        // copies until installed), after the slots' fix or with it (undone by a rollback).
        if let (Some(descriptors), Some(inputs)) = (&descriptors, inputs) {
            let locks = grown
                .as_ref()
                .map_or(self.locks.as_ref(), |g| g.locks.as_ref());
            let reached = reached_by(accs, inputs);
            let resolve = merged.then_some(resolve);
            let shared = self.launch_update(
                descriptors,
                &reached,
                gids.as_ref(),
                resolve,
                n,
                total,
                locks,
            )?;
            self.count_update(shared);
        }
        if let Some(grown) = grown {
            self.install(grown);
        }
        if new > 0 {
            self.chunks.push(chunk);
            self.starts.push(g0 as u64);
        }
        self.groups = total;
        Ok(())
    }

    pub(super) fn accumulator_descriptors(
        &self,
        accs: &[Acc],
        inputs: &[AccInput<'_>],
    ) -> Result<DeviceBuffer> {
        let mut words = Vec::with_capacity(accs.len() * 8);
        for (acc, input) in accs.iter().zip(inputs) {
            let kind = match input.values {
                // A count reads only the validity, whatever the type.
                Some(_) if acc.op == AccOp::Count => INPUT_NONE,
                Some(values) => input_kind(values)?,
                None if acc.op == AccOp::Count => INPUT_NONE,
                None => {
                    return Err(KernelError::Unsupported(
                        "an accumulator other than count without values".into(),
                    ));
                }
            };
            let decimal_op = matches!(
                acc.op,
                AccOp::SumDecimal | AccOp::MinDecimal | AccOp::MaxDecimal
            );
            let decimal = input
                .values
                .is_some_and(|v| matches!(v.data_type(), DataType::Decimal128(..)));
            if decimal && !decimal_op && acc.op != AccOp::Count {
                return Err(KernelError::Unsupported(format!(
                    "{:?} of decimal values",
                    acc.op
                )));
            }
            words.extend([
                acc.op.code(),
                kind,
                input.values.map_or(0, |c| c.values().addr()),
                input
                    .values
                    .and_then(DeviceColumn::validity)
                    .map_or(0, DeviceBuffer::addr),
                input.filter.map_or(0, |c| c.values().addr()),
                input
                    .filter
                    .and_then(DeviceColumn::validity)
                    .map_or(0, DeviceBuffer::addr),
                acc.state.as_ref().map_or(0, DeviceBuffer::addr),
                acc.counts.addr(),
            ]);
        }
        upload_words(&self.device, &words)
    }

    /// Updates the accumulators over `n` rows, each row's group read from `gids` (none: group
    /// 0) or, with `resolve` (`agg_resolve`'s arguments but `n` and `gids`, checked by the
    /// caller as for it), resolved in the same launch, which then does `agg_resolve`'s work
    /// too. Returns whether the launch took per-block tables in shared memory.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_update(
        &self,
        descriptors: &DeviceBuffer,
        reached: &[&DeviceBuffer],
        gids: Option<&DeviceBuffer>,
        resolve: Option<[Arg; RESOLVE_ARGS]>,
        n: usize,
        groups: usize,
        locks: Option<&DeviceBuffer>,
    ) -> Result<bool> {
        let device = &self.device;
        let per_group: usize = self.accs.iter().map(|a| (1 + a.op.words()) * 8).sum();
        let shared = groups * per_group;
        let use_shared =
            !self.accs.iter().any(|a| a.op.locked()) && shared <= SHARED_BYTES && groups <= 4096;
        // A resolve also covers the table's slots.
        let items = resolve.map_or(n as u64, |_| self.capacity.max(n as u64));
        let mut cfg = LaunchConfig::for_items(device, items, BLOCK);
        if use_shared {
            cfg.shared_bytes = shared.max(8) as u32;
        }
        // SAFETY: every descriptor's input columns hold n rows of its input kind (checked
        // by the caller) and its state and counts hold at least `groups` groups; every gid
        // is below `groups` or SKIP (a row the kernel leaves out); `locks` holds a u32 per
        // group when a locked op is present; the shared tables of `shared` bytes fit the
        // launch's dynamic shared memory; a resolve's arguments (or nulls: no resolve)
        // follow agg_resolve's contract, its groups below `groups`.
        let mut args = vec![
            Arg::buf(descriptors),
            Arg::U32(self.accs.len() as u32),
            Arg::opt(gids),
            Arg::U64(n as u64),
            Arg::opt(locks),
            Arg::U64(groups as u64),
            Arg::U32(u32::from(use_shared)),
        ];
        args.extend(resolve.unwrap_or([Arg::Ptr(0); RESOLVE_ARGS]));
        unsafe { device.launch_reaching(Kernel::agg_update, cfg, &args, reached)? };
        Ok(use_shared)
    }

    /// Carries the limbs of the exact float sums when `n` more rows could overflow one.
    /// Carrying changes no sum, so a table stays as it was should the update then fail.
    pub(super) fn carry_exact_sums(&mut self, n: usize) -> Result<()> {
        if !self.accs.iter().any(|a| a.op == AccOp::SumFloat) {
            return Ok(());
        }
        if self.uncarried_rows + n as u64 > self.carry_interval {
            for acc in self.accs.iter().filter(|a| a.op == AccOp::SumFloat) {
                let state = acc.state.as_ref().ok_or_else(|| {
                    KernelError::InvalidData("an exact sum without a state".into())
                })?;
                // SAFETY: `state` holds EXACT_WORDS words for each of `group_capacity` groups.
                unsafe {
                    self.device.launch(
                        Kernel::agg_exact_normalize,
                        LaunchConfig::for_items(&self.device, self.group_capacity as u64, BLOCK),
                        &[Arg::buf(state), Arg::U64(self.group_capacity as u64)],
                    )?;
                }
            }
            self.uncarried_rows = 0;
        }
        self.uncarried_rows += n as u64;
        Ok(())
    }

    /// Carries the exact sums' limbs before any update that would take them past `rows`
    /// uncarried rows (for tests: the real interval is 2^32 rows).
    #[doc(hidden)]
    pub fn carry_exact_sums_every(&mut self, rows: u64) {
        self.carry_interval = rows.min(EXACT_PIECES);
    }

    pub(super) fn count_update(&mut self, shared: bool) {
        if shared {
            self.shared_updates += 1;
        } else {
            self.global_updates += 1;
        }
    }
}

/// The buffers `agg_update` reaches through the accumulator descriptors of `accs` over
/// `inputs`: each input's values, validity and filter, each accumulator's state and counts.
fn reached_by<'a>(accs: &'a [Acc], inputs: &'a [AccInput<'a>]) -> Vec<&'a DeviceBuffer> {
    let mut reached = Vec::new();
    for (acc, input) in accs.iter().zip(inputs) {
        for column in input.values.iter().chain(&input.filter) {
            reached.push(column.values());
            reached.extend(column.validity());
        }
        reached.extend(acc.state.as_ref());
        reached.push(&acc.counts);
    }
    reached
}

/// The new groups' string keys measured on the device over an insert's `refs` and
/// `first`: each row's leader flag (1 where it is its new group's first row), their scan
/// (the leaders' ranks) and each string key's starts at the leader rows, queued in one
/// scan whose totals (the leaders' count, then each key's new bytes) go to `totals`.
/// Nothing is read: the totals come up in the insert's wait, or in one of their own.
pub(super) struct NewStrings {
    totals: DeviceBuffer,
    flags: DeviceBuffer,
    ranks: Arc<DeviceBuffer>,
    /// Each string key's position among the keys, and its starts.
    starts: Vec<(usize, gather::QueuedStarts)>,
}

impl NewStrings {
    /// Queues the measure of the string keys `strings` (positions in `keys`) of a batch
    /// whose insert left `refs` and `first` (n u32 each, n the keys' rows). Over an insert
    /// that overflowed its table the flags are meaningless, but every read stays in the
    /// batch's rows: the caller discards them.
    fn queue(
        device: &Device,
        keys: &[&DeviceColumn],
        strings: &[usize],
        refs: &DeviceBuffer,
        first: &DeviceBuffer,
    ) -> Result<Self> {
        let string_keys: Vec<&DeviceColumn> = strings.iter().map(|&k| keys[k]).collect();
        let n = string_keys.first().map_or(0, |k| k.len());
        let totals = device.alloc(8 * (1 + strings.len()))?;
        let (flags, ranks, queued) = gather::queue_flags_and_strings_starts(
            &string_keys,
            |into| leader_flags(device, refs, first, n, into),
            Word::of(&totals, 0)?,
        )?;
        Ok(Self {
            totals,
            flags,
            ranks,
            starts: strings.iter().copied().zip(queued).collect(),
        })
    }
}

/// Queues each of the `n` rows' leader flag into `into`: 1 where the row is its new
/// group's first row.
fn leader_flags(
    device: &Device,
    refs: &DeviceBuffer,
    first: &DeviceBuffer,
    n: usize,
    into: Arg,
) -> Result<()> {
    if refs.len() < n * 4 || first.len() < n * 4 {
        return Err(KernelError::Unsupported(format!(
            "leader flags of {n} rows over {} and {} bytes",
            refs.len(),
            first.len()
        )));
    }
    // SAFETY: `refs` and `first` hold n u32 (checked); each ref is committed, SKIP or
    // PENDING | row < n (the insert writes no other), so `first` is read at rows below n;
    // `into` holds n u64 (the callers' part).
    unsafe {
        device.launch(
            Kernel::agg_leader_flags,
            LaunchConfig::for_items(device, n as u64, BLOCK),
            &[Arg::buf(refs), Arg::buf(first), Arg::U64(n as u64), into],
        )
    }
}
