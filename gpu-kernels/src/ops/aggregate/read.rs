//! How a group table comes to the host: its key columns and accumulator states, read in
//! one host wait.

use super::*;

impl GroupTable {
    /// The key columns of the groups, in group order (first seen first).
    pub fn keys(&self) -> Result<Vec<ArrayRef>> {
        Ok(self.read(true, &[], &[])?.0)
    }

    /// Accumulator `k`'s state for every group.
    pub fn state(&self, k: usize) -> Result<AccState> {
        let mut states = self.read(false, &[k], &[])?.1;
        Ok(states.remove(0))
    }

    /// The key columns and every accumulator's state, all in one host wait (one per
    /// 16 MiB of staging past that): what a finished aggregation brings up.
    pub fn download(&self) -> Result<(Vec<ArrayRef>, Vec<AccState>)> {
        let all: Vec<usize> = (0..self.accs.len()).collect();
        let (keys, states, _) = self.read(true, &all, &[])?;
        Ok((keys, states))
    }

    /// [`Self::download`], and the key columns of each of `others` (such as a
    /// count(DISTINCT)'s tables of (group, value) pairs) in the same wait.
    #[allow(clippy::type_complexity)]
    pub fn download_with(
        &self,
        others: &[&GroupTable],
    ) -> Result<(Vec<ArrayRef>, Vec<AccState>, Vec<Vec<ArrayRef>>)> {
        let all: Vec<usize> = (0..self.accs.len()).collect();
        self.read(true, &all, others)
    }

    /// The key columns (when `with_keys`), the states of accumulators `ks` and the key
    /// columns of `others`, read in one wait. Only the groups' part of each buffer comes
    /// down, not its spare capacity.
    #[allow(clippy::type_complexity)]
    pub(super) fn read(
        &self,
        with_keys: bool,
        ks: &[usize],
        others: &[&GroupTable],
    ) -> Result<(Vec<ArrayRef>, Vec<AccState>, Vec<Vec<ArrayRef>>)> {
        let g = self.groups;
        let accs = ks
            .iter()
            .map(|&k| {
                self.accs
                    .get(k)
                    .ok_or_else(|| KernelError::Unsupported(format!("accumulator {k}")))
            })
            .collect::<Result<Vec<&Acc>>>()?;
        // An exact float sum is rounded on the device first; the rounding is queued and
        // read with the rest.
        let rounded = accs
            .iter()
            .map(|acc| match (&acc.state, acc.op) {
                (Some(state), AccOp::SumFloat) if g > 0 => {
                    let rounded = self.device.alloc(g * 8)?;
                    // SAFETY: `state` holds EXACT_WORDS words for each of at least `g`
                    // groups, `rounded` a u64 for each.
                    unsafe {
                        self.device.launch(
                            Kernel::agg_exact_finish,
                            LaunchConfig::for_items(&self.device, g as u64, BLOCK),
                            &[Arg::buf(state), Arg::U64(g as u64), Arg::buf(&rounded)],
                        )?;
                    }
                    Ok(Some(rounded))
                }
                _ => Ok(None),
            })
            .collect::<Result<Vec<Option<DeviceBuffer>>>>()?;
        // Where each accumulator's words come from (the rounding, else the state), and
        // how many bytes of them: its groups' words as they come to the host.
        let sources: Vec<Option<(&DeviceBuffer, usize)>> = accs
            .iter()
            .zip(&rounded)
            .map(|(acc, rounded)| {
                rounded
                    .as_ref()
                    .or(acc.state.as_ref())
                    .map(|b| (b, (g * acc.op.host_words() * 8).min(b.len())))
            })
            .collect();
        let mut counts: Vec<Vec<u8>> = accs
            .iter()
            .map(|acc| vec![0u8; (g * 8).min(acc.counts.len())])
            .collect();
        let mut words: Vec<Vec<u8>> = sources
            .iter()
            .map(|s| vec![0u8; s.map_or(0, |(_, len)| len)])
            .collect();
        let mut columns: Vec<&DeviceColumn> = if with_keys {
            self.key_chunks().collect()
        } else {
            Vec::new()
        };
        for other in others {
            columns.extend(other.key_chunks());
        }
        let arrays = {
            let mut extra: Vec<(&DeviceBuffer, &mut [u8])> = Vec::new();
            for ((acc, source), (counts, words)) in accs
                .iter()
                .zip(&sources)
                .zip(counts.iter_mut().zip(words.iter_mut()))
            {
                if !counts.is_empty() {
                    extra.push((&acc.counts, counts.as_mut_slice()));
                }
                if let Some((buffer, _)) = source.filter(|(_, len)| *len > 0) {
                    extra.push((buffer, words.as_mut_slice()));
                }
            }
            crate::column::download_columns_with(&self.device, &columns, &mut extra)?
        };
        let mut arrays = arrays.into_iter();
        let keys = match with_keys {
            true => self.keys_from(&mut arrays)?,
            false => Vec::new(),
        };
        let other_keys = others
            .iter()
            .map(|other| other.keys_from(&mut arrays))
            .collect::<Result<Vec<_>>>()?;
        let states = accs
            .iter()
            .zip(counts.iter().zip(&words))
            .map(|(acc, (counts, words))| AccState {
                counts: words_of(counts, g),
                values: acc_values(acc, words, g),
            })
            .collect();
        Ok((keys, states, other_keys))
    }

    /// Every chunk of every key column, key by key.
    fn key_chunks(&self) -> impl Iterator<Item = &DeviceColumn> {
        (0..self.key_types.len()).flat_map(|k| self.chunks.iter().map(move |chunk| &chunk[k]))
    }

    /// The key columns from the arrays of [`Self::key_chunks`], taken from `arrays`.
    fn keys_from(&self, arrays: &mut impl Iterator<Item = ArrayRef>) -> Result<Vec<ArrayRef>> {
        (0..self.key_types.len())
            .map(|k| {
                let parts: Vec<ArrayRef> = arrays.by_ref().take(self.chunks.len()).collect();
                if parts.is_empty() {
                    return Ok(new_empty_array(&self.key_types[k]));
                }
                // Chunks of dictionary-encoded keys come down as dictionaries: every
                // chunk in the table's key type.
                let parts = parts
                    .into_iter()
                    .map(|a| match a.data_type() == &self.key_types[k] {
                        true => Ok(a),
                        false => arrow::compute::cast(&a, &self.key_types[k])
                            .map_err(|e| KernelError::InvalidData(e.to_string())),
                    })
                    .collect::<Result<Vec<ArrayRef>>>()?;
                let refs: Vec<&dyn arrow::array::Array> =
                    parts.iter().map(|a| a.as_ref()).collect();
                arrow::compute::concat(&refs).map_err(|e| KernelError::InvalidData(e.to_string()))
            })
            .collect()
    }
}

/// An accumulator's values from the words read for `g` groups (an exact float sum's
/// already rounded on the device).
fn acc_values(acc: &Acc, bytes: &[u8], g: usize) -> AccValues {
    if acc.state.is_none() {
        return AccValues::None;
    }
    match acc.op {
        AccOp::Count => AccValues::None,
        AccOp::SumFloat => {
            AccValues::Float(words_of(bytes, g).into_iter().map(f64::from_bits).collect())
        }
        AccOp::SumInt | AccOp::MinInt | AccOp::MaxInt => {
            AccValues::Int(words_of(bytes, g).iter().map(|&w| w as i64).collect())
        }
        AccOp::MinFloat | AccOp::MaxFloat => AccValues::Float(
            words_of(bytes, g)
                .iter()
                .map(|&w| f64::from_bits(if w >> 63 == 1 { w & !(1 << 63) } else { !w }))
                .collect(),
        ),
        AccOp::SumDecimal | AccOp::MinDecimal | AccOp::MaxDecimal => AccValues::Decimal(
            words_of(bytes, g * 2)
                .chunks_exact(2)
                .map(|p| ((p[1] as u128) << 64 | p[0] as u128) as i128)
                .collect(),
        ),
    }
}

fn words_of(bytes: &[u8], count: usize) -> Vec<u64> {
    bytes
        .chunks_exact(8)
        .take(count)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}
