//! String gathers' output starts queued before the host knows how many rows they gather
//! (or which): each column's lengths at the rows and their exclusive scan, its byte total
//! written to a word the stage reads in its one wait.

use super::{GATHER_STRINGS, QueuedStarts, check_bound, string_offsets};
use crate::column::DeviceColumn;
use crate::device::{Arg, Device, LaunchConfig};
use crate::kernels::Kernel;
use crate::memory::DeviceBuffer;
use crate::ops::{BLOCK, PendingIndices, Word, scan};
use crate::{KernelError, Result};
use std::sync::Arc;

/// Queues the lengths of the strings of each of `columns` (of one device) at `indices`
/// and their exclusive scans, without a host wait: each column's output starts, and its
/// byte total written to the word `k` words after `totals_to` for column `k` (the caller
/// zeroed them) for the host to read with the indices' count, in one wait. Work over all
/// the indices' slots, of which only the real ones count. One launch per
/// [`GATHER_STRINGS`] columns of one offset width, lengths and scans together
/// (`gather_string_starts_many`; past the look-back state's tiles, a lengths launch per
/// group and the scans of all in the launches of one).
pub fn queue_strings_starts(
    columns: &[&DeviceColumn],
    indices: PendingIndices<'_>,
    totals_to: Word<'_>,
) -> Result<Vec<QueuedStarts>> {
    let slots = indices.slots();
    if indices.buffer.len() < slots * 4 {
        return Err(KernelError::Unsupported(format!(
            "{slots} pending indices in a {}-byte buffer",
            indices.buffer.len()
        )));
    }
    let Some(first) = columns.first() else {
        return Ok(Vec::new());
    };
    for column in columns {
        check_bound(indices.bound(), column)?;
    }
    let no_lead: Option<fn(Arg) -> Result<()>> = None;
    // The kernels read only the first min(*count, slots) indices, which the producer of
    // the pending indices queued before them on the same stream (a join probe writes its
    // count with its pairs), each below the bound ≤ every column's length (checked) or
    // NULL_INDEX.
    let rows = Rows::Indices(indices.buffer, indices.count);
    queue_starts(first.device(), columns, slots, totals_to, no_lead, rows).map(|(.., s)| s)
}

/// Queues, without a host wait, the starts of the strings of the rows of each of `columns`
/// (of one device and length) that `flags` marks (one u64 per row, non-zero for a marked
/// row), by row: for gathering the marked rows in row order (the indices a compaction of
/// the flags gives), each at the sum of the lengths of the marked rows before it. Column
/// `k`'s byte total goes to the word `k` words after `totals_to`.
pub fn queue_flagged_strings_starts(
    columns: &[&DeviceColumn],
    flags: &DeviceBuffer,
    totals_to: Word<'_>,
) -> Result<Vec<QueuedStarts>> {
    let n = columns.first().map_or(0, |c| c.len());
    if flags.len() < n * 8 {
        return Err(KernelError::Unsupported(format!(
            "flags of {n} rows in a {}-byte buffer",
            flags.len()
        )));
    }
    let Some(first) = columns.first() else {
        return Ok(Vec::new());
    };
    check_rows_of(columns, n)?;
    let no_lead: Option<fn(Arg) -> Result<()>> = None;
    let rows = Rows::Flagged(flags);
    queue_starts(first.device(), columns, n, totals_to, no_lead, rows).map(|(.., s)| s)
}

/// As [`queue_flagged_strings_starts`], with the flags themselves made and scanned in the
/// same launch as the first columns' starts, as one segment more: `flag(into)` queues the
/// kernel that writes the n flags (a u64 per row of `columns`, non-zero for a marked row)
/// into `into`. Their exclusive scan (each marked row's rank among them) is the scan's
/// segment 0, its total written to `totals_to`, and column `k`'s byte total to the word
/// `k + 1` words after. Returns the buffer the flags are in (its first n u64), the scan
/// (the ranks: its first n u64) and each column's starts.
pub fn queue_flags_and_strings_starts(
    columns: &[&DeviceColumn],
    flag: impl FnOnce(Arg) -> Result<()>,
    totals_to: Word<'_>,
) -> Result<(DeviceBuffer, Arc<DeviceBuffer>, Vec<QueuedStarts>)> {
    let Some(first) = columns.first() else {
        return Err(KernelError::Unsupported(
            "flags scanned with the starts of no string column".into(),
        ));
    };
    let n = first.len();
    check_rows_of(columns, n)?;
    let (flags, starts, queued) =
        queue_starts(first.device(), columns, n, totals_to, Some(flag), Rows::Led)?;
    let flags = flags.ok_or_else(|| KernelError::InvalidData("flags were not made".into()))?;
    Ok((flags, starts, queued))
}

/// The rows whose strings a gather's starts are queued for.
#[derive(Clone, Copy)]
enum Rows<'a> {
    /// Pending indices (their buffer, and the word saying how many are real).
    Indices(&'a DeviceBuffer, Word<'a>),
    /// The rows a caller's flags mark (one u64 a row).
    Flagged(&'a DeviceBuffer),
    /// The rows the flags of the scan's lead segment mark.
    Led,
}

impl Rows<'_> {
    /// The kernels' `idx`, `flags` and `count` arguments over `slots` rows, the lead
    /// segment's flags being in `lead`.
    fn args(self, slots: usize, lead: Option<&DeviceBuffer>) -> Result<[Arg; 3]> {
        Ok(match self {
            Rows::Indices(buffer, count) => [Arg::buf(buffer), Arg::Ptr(0), count.arg()],
            Rows::Flagged(flags) => [Arg::Ptr(0), Arg::part(flags, 0, 8 * slots), Arg::Ptr(0)],
            Rows::Led => {
                let lead = lead.ok_or_else(|| {
                    KernelError::Unsupported("strings flagged by a lead segment without one".into())
                })?;
                [Arg::Ptr(0), Arg::part(lead, 0, 8 * slots), Arg::Ptr(0)]
            }
        })
    }
}

/// Checks that flagged string columns have the flags' `n` rows.
fn check_rows_of(columns: &[&DeviceColumn], n: usize) -> Result<()> {
    match columns.iter().find(|c| c.len() != n) {
        Some(other) => Err(KernelError::Unsupported(format!(
            "flagged string starts of columns of {n} and {} rows",
            other.len()
        ))),
        None => Ok(()),
    }
}

/// The columns in launch groups: up to [`GATHER_STRINGS`] consecutive columns of one
/// offset width each, as (first column, end, width).
fn string_groups(columns: &[&DeviceColumn]) -> Result<Vec<(usize, usize, usize)>> {
    let mut groups = Vec::new();
    let mut k = 0;
    while k < columns.len() {
        let width = string_offsets(columns[k])?.0;
        let mut end = k + 1;
        while end < columns.len()
            && end - k < GATHER_STRINGS
            && string_offsets(columns[end])?.0 == width
        {
            end += 1;
        }
        groups.push((k, end, width));
        k = end;
    }
    Ok(groups)
}

/// The offsets arguments of a launch over `group` (unused ones null).
fn offsets_args(group: &[&DeviceColumn]) -> Result<[Arg; GATHER_STRINGS]> {
    let mut offsets = [Arg::Ptr(0); GATHER_STRINGS];
    for (k, column) in group.iter().enumerate().take(GATHER_STRINGS) {
        offsets[k] = Arg::buf(string_offsets(column)?.1);
    }
    Ok(offsets)
}

/// Queues the lengths of the strings of `group` (up to [`GATHER_STRINGS`] columns of one
/// offset width) at `slots` rows, column `c`'s at `lengths` + `c * stride` u64: with
/// `source[0]` (indices, of which the count word `count` says how many are real), of the
/// strings those indices pick; with `source[1]` (flags, one u64 a row), of each row's
/// where it is flagged, 0 elsewhere.
fn many_lengths(
    group: &[&DeviceColumn],
    [idx, flags, count]: [Arg; 3],
    slots: usize,
    lengths: Arg,
    stride: usize,
    width: usize,
) -> Result<()> {
    let Some(first) = group.first() else {
        return Ok(());
    };
    let kernel = if width == 4 {
        Kernel::gather_string_lengths_many_o32
    } else {
        Kernel::gather_string_lengths_many_o64
    };
    let device = first.device();
    let mut args = vec![
        idx,
        flags,
        Arg::U64(slots as u64),
        count,
        lengths,
        Arg::U64(stride as u64),
        Arg::U32(group.len() as u32),
    ];
    args.extend(offsets_args(group)?);
    // SAFETY: each column's offsets hold its length + 1 offsets of `width` bytes (one
    // width for the group: `string_groups`), and the callers check that the indices (below
    // the columns' lengths, or NULL_INDEX) or the flagged rows (each column's rows)
    // address them; `lengths` holds (group.len() - 1) * stride + slots u64
    // (`queue_starts`); unused offsets are null.
    unsafe {
        device.launch(
            kernel,
            LaunchConfig::for_items(device, slots as u64, BLOCK),
            &args,
        )
    }
}

/// Queues each column's starts — after a segment of flags `lead(into)` writes and that is
/// scanned too, when given — and returns the flags (when led), the starts (segment `s` at
/// `s` strides, the stride `scan::segment_stride(slots)` where there are two segments or
/// more) and each column's queued starts. One `gather_string_starts_many` launch per
/// group of columns (`string_groups`; the lead scanned in the first) where each launch's
/// tiles fit the look-back state; else a lengths launch per group into one buffer, and
/// the scans of all its segments in the launches of one.
fn queue_starts(
    device: &Device,
    columns: &[&DeviceColumn],
    slots: usize,
    totals_to: Word<'_>,
    lead: Option<impl FnOnce(Arg) -> Result<()>>,
    rows: Rows<'_>,
) -> Result<(Option<DeviceBuffer>, Arc<DeviceBuffer>, Vec<QueuedStarts>)> {
    if let Some(other) = columns.iter().find(|c| c.device() != device) {
        return Err(KernelError::Unsupported(format!(
            "string starts of columns on {device} and {}",
            other.device()
        )));
    }
    let led = usize::from(lead.is_some());
    let segments = led + columns.len();
    // Every segment's total word lies inside the totals' buffer.
    totals_to.nth(segments.saturating_sub(1))?;
    let stride = match segments {
        1 => slots,
        _ => scan::segment_stride(slots),
    };
    let groups = string_groups(columns)?;
    let indices = match rows {
        Rows::Indices(buffer, _) => Some(buffer.addr()),
        _ => None,
    };
    let queued = |starts: &Arc<DeviceBuffer>| {
        (columns.iter().enumerate())
            .map(|(k, column)| {
                Ok(QueuedStarts {
                    starts: Arc::clone(starts),
                    at: (led + k) * stride,
                    slots,
                    indices,
                    offsets: string_offsets(column)?.1.addr(),
                })
            })
            .collect::<Result<Vec<_>>>()
    };
    let per_segment = (slots as u64).div_ceil(scan::TILE);
    let one_pass = per_segment <= 1
        || groups.iter().enumerate().all(|(g, (k, end, _))| {
            let group_segments = (end - k + usize::from(g == 0) * led) as u64;
            per_segment * group_segments <= scan::LOOKBACK_TILES
        });
    if slots == 0 || !one_pass {
        let (all, starts) =
            queue_lengths_then_scan(device, columns, slots, totals_to, lead, rows, stride)?;
        let queued = queued(&starts)?;
        return Ok(((led == 1).then_some(all), starts, queued));
    }
    let lead_flags = match lead {
        Some(lead) => {
            let flags = device.alloc(8 * slots)?;
            lead(Arg::part(&flags, 0, 8 * slots))?;
            Some(flags)
        }
        None => None,
    };
    let starts = device.alloc(segments * stride * 8)?;
    let [idx, flags, count] = rows.args(slots, lead_flags.as_ref())?;
    for (g, &(k, end, width)) in groups.iter().enumerate() {
        let group = &columns[k..end];
        // The lead is scanned with the first group, as its segment 0.
        let group_lead = lead_flags.as_ref().filter(|_| g == 0);
        let first_segment = if g == 0 { 0 } else { led + k };
        let group_segments = end - k + usize::from(group_lead.is_some());
        let kernel = if width == 4 {
            Kernel::gather_string_starts_many_o32
        } else {
            Kernel::gather_string_starts_many_o64
        };
        let totals = Arg::part(
            totals_to.buffer,
            8 * (totals_to.index + first_segment),
            8 * group_segments,
        );
        let span = (group_segments - 1) * stride + slots;
        let out = Arg::part(&starts, 8 * first_segment * stride, 8 * span);
        let offsets = offsets_args(group)?;
        scan::one_pass_segments(
            device,
            per_segment,
            group_segments as u64,
            |cfg, state, epoch| {
                let mut args = vec![
                    idx,
                    flags,
                    Arg::U64(slots as u64),
                    count,
                    group_lead.map_or(Arg::Ptr(0), |l| Arg::part(l, 0, 8 * slots)),
                    Arg::U64(stride as u64),
                    Arg::U32(group.len() as u32),
                ];
                args.extend(offsets);
                args.extend([
                    state,
                    Arg::U64(scan::LOOKBACK_TILES),
                    Arg::U64(epoch),
                    out,
                    totals,
                ]);
                // SAFETY: as `many_lengths` for the rows each segment reads; the lead, when
                // given, holds `slots` u64 written by the launch before; `out` holds
                // group_segments segments of `slots` starts, `stride` apart, and `totals`
                // group_segments u64 (checked by `Word::nth` above); the look-back state and
                // epoch are `one_pass_segments`'s, a block of SCAN_THREADS per tile of each segment.
                unsafe { device.launch(kernel, cfg, &args) }
            },
        )?;
    }
    let starts = Arc::new(starts);
    let queued = queued(&starts)?;
    Ok((lead_flags, starts, queued))
}

/// [`queue_starts`] in separate launches: the lead's flags and each group's lengths into
/// one buffer of `segments × stride` u64, then the scan of all its segments. Returns that
/// buffer (the flags: its first `slots` u64) and the starts.
fn queue_lengths_then_scan(
    device: &Device,
    columns: &[&DeviceColumn],
    slots: usize,
    totals_to: Word<'_>,
    lead: Option<impl FnOnce(Arg) -> Result<()>>,
    rows: Rows<'_>,
    stride: usize,
) -> Result<(DeviceBuffer, Arc<DeviceBuffer>)> {
    let led = usize::from(lead.is_some());
    let segments = led + columns.len();
    let all = device.alloc((segments * stride * 8).max(1))?;
    if slots > 0 {
        if let Some(lead) = lead {
            lead(Arg::part(&all, 0, 8 * slots))?;
        }
        let source = rows.args(slots, Some(&all))?;
        for (k, end, width) in string_groups(columns)? {
            let group = &columns[k..end];
            let span = (group.len() - 1) * stride + slots;
            let into = Arg::part(&all, 8 * (led + k) * stride, 8 * span);
            many_lengths(group, source, slots, into, stride, width)?;
        }
    }
    let starts = scan::segments_queued(device, &all, slots, segments, totals_to)?;
    Ok((all, Arc::new(starts)))
}

#[cfg(test)]
mod tests {
    use arrow::array::{LargeStringArray, StringArray};

    use super::*;
    use crate::device::EmulatorOptions;

    /// The one-launch starts (`gather_string_starts_many`) equal the lengths launched apart
    /// and scanned after (the path past the look-back state's tiles, which no batch of
    /// fewer than 16 Mi rows takes), over indices, caller's flags and led flags, with six
    /// `Utf8` columns and a `LargeUtf8` one (groups of four, two and one), at one tile and
    /// at several: starts and byte totals alike, the lead's ranks too.
    #[test]
    fn one_launch_starts_equal_the_lengths_scanned_apart() {
        let d = Device::emulated(0, &EmulatorOptions::default());
        for n in [700usize, 5000] {
            let mut columns: Vec<DeviceColumn> = (0..6u64)
                .map(|k| {
                    let a: StringArray = (0..n as u64)
                        .map(|i| {
                            (i % (7 + k) != 0).then(|| "x".repeat(((i * 31 + k) % 23) as usize))
                        })
                        .collect();
                    DeviceColumn::upload(&d, &a).unwrap()
                })
                .collect();
            let large: LargeStringArray = (0..n).map(|i| Some("y".repeat(i % 13))).collect();
            columns.push(DeviceColumn::upload(&d, &large).unwrap());
            let refs: Vec<&DeviceColumn> = columns.iter().collect();
            let flag_words: Vec<u8> = (0..n as u64)
                .flat_map(|i| u64::from(i % 3 == 1).to_le_bytes())
                .collect();
            let flags = d.upload(&flag_words).unwrap();
            // Every third row, backwards, and a count word saying how many are real.
            let picked: Vec<u8> = (0..n as u32)
                .rev()
                .step_by(3)
                .flat_map(u32::to_le_bytes)
                .collect();
            let real = (n as u64).div_ceil(3) - 1;
            let indices = d.upload(&picked).unwrap();
            let count = d.upload(&real.to_le_bytes()).unwrap();
            let lead = |into: Arg| -> Result<()> {
                // The flags copied in: a gather of 8-byte values at the rows 0..n.
                let identity: Vec<u8> = (0..n as u32).flat_map(u32::to_le_bytes).collect();
                let identity = d.upload(&identity)?;
                // SAFETY: `flags` holds n u64, `identity` n indices below n, `into` n u64.
                unsafe {
                    d.launch(
                        Kernel::gather_fixed_8,
                        LaunchConfig::for_items(&d, n as u64, BLOCK),
                        &[
                            Arg::buf(&flags),
                            Arg::buf(&identity),
                            Arg::U64(n as u64),
                            into,
                        ],
                    )
                }
            };
            let slots = picked.len() / 4;
            for (case, rows, led) in [
                (
                    "indices",
                    Rows::Indices(&indices, Word::of(&count, 0).unwrap()),
                    false,
                ),
                ("flags", Rows::Flagged(&flags), false),
                ("led", Rows::Led, true),
            ] {
                let slots = if case == "indices" { slots } else { n };
                let words = refs.len() + usize::from(led);
                let run = |one_launch: bool| -> (Vec<u64>, Vec<u64>) {
                    let totals = d.upload(&vec![0u8; 8 * words]).unwrap();
                    let to = Word::of(&totals, 0).unwrap();
                    let segments = words;
                    let stride = if segments == 1 {
                        slots
                    } else {
                        scan::segment_stride(slots)
                    };
                    let starts = if one_launch {
                        let lead = led.then_some(lead);
                        queue_starts(&d, &refs, slots, to, lead, rows).unwrap().1
                    } else {
                        let lead = led.then_some(lead);
                        queue_lengths_then_scan(&d, &refs, slots, to, lead, rows, stride)
                            .unwrap()
                            .1
                    };
                    let words_of = |b: Vec<u8>| -> Vec<u64> {
                        b.chunks_exact(8)
                            .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
                            .collect()
                    };
                    let starts = words_of(starts.to_host().unwrap());
                    // Only each segment's first `slots` starts are written.
                    let starts = (0..segments)
                        .flat_map(|s| starts[s * stride..s * stride + slots].to_vec())
                        .collect();
                    (starts, words_of(totals.to_host().unwrap()))
                };
                let before = d.counts().launches;
                let one = run(true);
                let one_launches = d.counts().launches - before;
                let apart = run(false);
                assert_eq!(one, apart, "n={n} {case}");
                assert!(
                    apart.1.iter().all(|&t| t > 0),
                    "n={n} {case}: {:?}",
                    apart.1
                );
                // Three groups (four, two and one columns), the lead made first; the first
                // multi-tile scan on the stream zeroes its look-back state.
                assert!(
                    (3 + u64::from(led)..=4 + u64::from(led)).contains(&one_launches),
                    "n={n} {case}: {one_launches} launches"
                );
            }
        }
    }
}
