//! How a group table grows: new accumulator, hash and lock buffers for a larger capacity
//! (the groups so far copied, the rest at their identity), the slots rebuilt for them, and
//! a failed batch's new groups rolled back.

use super::*;

/// Accumulators one `agg_init_state` launch sets up (its eight slots).
const INIT_ACCS: usize = 8;

impl GroupTable {
    /// `new_slots`: a new keyed table's first hash slots (a buffer and how many u64 it
    /// holds), set empty in the same launch as the accumulators.
    pub(super) fn grown(
        &self,
        capacity: usize,
        new_slots: Option<(&DeviceBuffer, u64)>,
    ) -> Result<Grown> {
        let device = &self.device;
        let keep = self.groups.min(self.group_capacity);
        let mut accs = Vec::with_capacity(self.accs.len());
        for acc in &self.accs {
            let words = acc.op.words();
            accs.push(Acc {
                op: acc.op,
                state: match words {
                    0 => None,
                    _ => Some(device.alloc(capacity * words * 8)?),
                },
                counts: device.alloc(capacity * 8)?,
            });
        }
        let locks = match self.accs.iter().any(|a| a.op.locked()) {
            true => Some(device.alloc(capacity.div_ceil(2) * 8)?),
            false => None,
        };
        let group_hashes = match self.keyed {
            true => Some(device.alloc(capacity * 8)?),
            false => None,
        };
        let old_hashes = self.group_hashes.as_ref().filter(|_| keep > 0);
        if let (Some(old), Some(new)) = (old_hashes, &group_hashes)
            && (old.len() < keep * 8 || new.len() < keep * 8)
        {
            return Err(KernelError::InvalidData(format!(
                "{keep} group hashes to copy from {} into {} bytes",
                old.len(),
                new.len()
            )));
        }
        // Every group the old table's (its first `keep`: counts, states and hashes) or at
        // its identity, and unlocked, eight accumulators a launch (the locks, the hashes
        // and the new slots with the first eight), where a launch set four to their
        // identity and two copies per accumulator brought the old groups back.
        // A table without accumulators (GROUP BY alone) takes one launch for its slots
        // and hashes.
        let launches = accs
            .len()
            .div_ceil(INIT_ACCS)
            .max(usize::from(new_slots.is_some() || old_hashes.is_some()));
        for k in 0..launches {
            let range = (k * INIT_ACCS).min(accs.len())..((k + 1) * INIT_ACCS).min(accs.len());
            let (these, old) = (&accs[range.clone()], &self.accs[range]);
            let (slots, slot_count) = match new_slots {
                Some((buffer, count)) if k == 0 => {
                    if buffer.len() < count as usize * 8 {
                        return Err(KernelError::InvalidData(format!(
                            "{count} slots in a {} byte buffer",
                            buffer.len()
                        )));
                    }
                    (Some(buffer), count)
                }
                _ => (None, 0),
            };
            let first = k == 0;
            let mut args = vec![
                Arg::U64(capacity as u64),
                Arg::U64(keep as u64),
                Arg::opt(locks.as_ref().filter(|_| first)),
                Arg::opt(slots),
                Arg::U64(slot_count),
                Arg::opt(
                    group_hashes
                        .as_ref()
                        .filter(|_| first && old_hashes.is_some()),
                ),
                Arg::opt(old_hashes.filter(|_| first)),
            ];
            for slot in 0..INIT_ACCS {
                args.extend(match (these.get(slot), old.get(slot)) {
                    (Some(acc), Some(was)) => {
                        let words = acc.op.words();
                        if keep > 0
                            && (was.counts.len() < keep * 8
                                || was.state.as_ref().map_or(0, DeviceBuffer::len)
                                    < keep * words * 8)
                        {
                            return Err(KernelError::InvalidData(format!(
                                "an accumulator of fewer than the {keep} groups to keep"
                            )));
                        }
                        [
                            Arg::opt(acc.state.as_ref()),
                            Arg::opt(was.state.as_ref().filter(|_| keep > 0)),
                            Arg::U64(acc.op.code()),
                            Arg::buf(&acc.counts),
                            Arg::opt(Some(&was.counts).filter(|_| keep > 0)),
                        ]
                    }
                    _ => [
                        Arg::Ptr(0),
                        Arg::Ptr(0),
                        Arg::U64(0),
                        Arg::Ptr(0),
                        Arg::Ptr(0),
                    ],
                });
            }
            // SAFETY: each accumulator's `state` (when there is one) holds `capacity`
            // groups of its op's words and its `counts` `capacity` u64, and with keep > 0
            // the old ones at least `keep` groups (checked; the old accumulators are this
            // table's, the same ops in the same order); `locks` (when given) `capacity`
            // u32 (capacity.div_ceil(2) u64); the new slots (when given) `slot_count` u64
            // (checked); the hashes (when given) at least `keep` u64 each (checked);
            // unused accumulator slots are nulls, which the kernel skips; the arguments
            // follow agg.cu's signature.
            unsafe {
                device.launch(
                    Kernel::agg_init_state,
                    LaunchConfig::for_items(device, capacity as u64, BLOCK),
                    &args,
                )?;
            }
        }
        Ok(Grown {
            accs,
            group_hashes,
            locks,
            capacity,
        })
    }

    pub(super) fn install(&mut self, grown: Grown) {
        self.accs = grown.accs;
        self.group_hashes = grown.group_hashes;
        self.locks = grown.locks;
        self.group_capacity = grown.capacity;
    }

    /// New, empty slots for `capacity` entries with the committed groups inserted.
    pub(super) fn rebuilt_slots(&self, capacity: u64) -> Result<DeviceBuffer> {
        let device = &self.device;
        let slots = device.alloc(capacity as usize * 8)?;
        fill_u64(device, &slots, capacity as usize, EMPTY_SLOT)?;
        if self.groups > 0 {
            let hashes = self
                .group_hashes
                .as_ref()
                .ok_or_else(|| KernelError::InvalidData("a keyed table without hashes".into()))?;
            // SAFETY: `slots` holds `capacity` (a power of two above twice the groups)
            // empty slots, so every insert finds one; `hashes` holds `groups` u64.
            unsafe {
                device.launch(
                    Kernel::agg_rehash,
                    LaunchConfig::for_items(device, self.groups as u64, BLOCK),
                    &[
                        Arg::buf(&slots),
                        Arg::U64(capacity - 1),
                        Arg::buf(hashes),
                        Arg::U64(self.groups as u64),
                    ],
                )?;
            }
        }
        Ok(slots)
    }

    /// Removes the slots of groups numbered `g0` and above (and pending ones), retrying
    /// once: the table is only consistent again once this has run.
    pub(super) fn rollback(&self, g0: usize) -> Result<()> {
        let (Some(slots), device) = (&self.slots, &self.device) else {
            return Ok(());
        };
        let run = || {
            // SAFETY: `slots` holds `capacity` u64.
            unsafe {
                device.launch(
                    Kernel::agg_rollback,
                    LaunchConfig::for_items(device, self.capacity, BLOCK),
                    &[
                        Arg::buf(slots),
                        Arg::U64(self.capacity),
                        Arg::U64(g0 as u64),
                    ],
                )
            }
        };
        run().or_else(|_| run())
    }
}
