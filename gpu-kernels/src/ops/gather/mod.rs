//! Gather by an index column (`cuda/gather.cu`): `out[i] = column[indices[i]]`, where an
//! index of [`NULL_INDEX`](super::NULL_INDEX) gives NULL.
//!
//! A string column's gather needs its byte total before it can allocate the bytes: either
//! the host waits for it ([`gather_column`]), or the lengths and their scan are queued
//! before the host knows even how many indices there are ([`queue_strings_starts`]), the
//! total goes to a word the stage reads in its one wait, and the copy follows
//! ([`gather_column_started`]).

use super::{BLOCK, RowIndices, Word, scan};
use crate::column::{DeviceColumn, Layout};
use crate::device::{Arg, LaunchConfig};
use crate::kernels::Kernel;
use crate::memory::DeviceBuffer;
use crate::{KernelError, Result};
use std::sync::Arc;

mod starts;
pub use starts::{
    queue_flagged_strings_starts, queue_flags_and_strings_starts, queue_strings_starts,
};

/// Gathers the rows of `column` at `indices`; NULL_INDEX gives NULL (outer joins), and the
/// result then has a validity bitmap. A string column's gather waits for its byte total.
pub fn gather_column(column: &DeviceColumn, indices: &RowIndices) -> Result<DeviceColumn> {
    gather(column, indices, None)
}

/// Columns one `gather_many` launch gathers (`GATHER_MANY` in `cuda/gather.cu`).
pub const GATHER_MANY: usize = 6;
/// `gather_many`'s kind of a bitmap of values (a boolean column).
const GATHER_BITS: u64 = 0x80;
/// `gather_many`'s kind bit of a column gathered at the second index set.
const GATHER_SECOND: u64 = 0x40;

/// Gathers each of `columns` at `indices`, as [`gather_column`] does one by one: the
/// fixed-width and boolean columns, validity included, up to [`GATHER_MANY`] in one launch
/// (one kernel per batch of columns, instead of one for each column's values and one for
/// its validity); strings and dictionaries one by one.
pub fn gather_columns(
    columns: &[&DeviceColumn],
    indices: &RowIndices,
) -> Result<Vec<DeviceColumn>> {
    gather_columns_by(columns, &[indices], &vec![0; columns.len()])
}

/// As [`gather_columns`], each column `i` at `indices[sides[i]]`: up to two sets of as many
/// indices (a join's build and probe rows), whose fixed-width and boolean columns share the
/// launches.
fn gather_columns_by(
    columns: &[&DeviceColumn],
    indices: &[&RowIndices],
    sides: &[usize],
) -> Result<Vec<DeviceColumn>> {
    let many = |c: &DeviceColumn| {
        c.dictionary().is_none()
            && matches!(c.layout(), Layout::Bits | Layout::Fixed(1 | 2 | 4 | 8 | 16))
    };
    let together: Vec<usize> = (0..columns.len()).filter(|&i| many(columns[i])).collect();
    let mut out: Vec<Option<DeviceColumn>> = vec![None; columns.len()];
    for group in together.chunks(GATHER_MANY) {
        let these: Vec<(&DeviceColumn, usize)> =
            group.iter().map(|&i| (columns[i], sides[i])).collect();
        for (&i, gathered) in group.iter().zip(gather_many(&these, indices)?) {
            out[i] = Some(gathered);
        }
    }
    out.into_iter()
        .zip(columns.iter().zip(sides))
        .map(|(done, (column, &side))| match done {
            Some(gathered) => Ok(gathered),
            None => gather_column(column, side_indices(indices, side)?),
        })
        .collect()
}

/// `indices[side]`, or an error naming the side that is missing.
fn side_indices<'a>(indices: &[&'a RowIndices], side: usize) -> Result<&'a RowIndices> {
    indices.get(side).copied().ok_or_else(|| {
        KernelError::InvalidData(format!(
            "a column gathered at index set {side} of {}",
            indices.len()
        ))
    })
}

/// Started string columns copied in one launch: their offset width, whether their starts
/// are by source row, their index set, and each column's place, starts and byte total.
type StartedGroup = (usize, bool, usize, Vec<(usize, QueuedStarts, u64)>);

/// Gathers each of `columns` at `indices`, as [`gather_columns`] does, except that a column
/// with starts queued for these indices (and the byte total the host read: see
/// [`gather_column_started`]) is gathered from them, with no wait.
pub fn gather_columns_started(
    columns: &[&DeviceColumn],
    indices: &RowIndices,
    started: Vec<Option<(QueuedStarts, u64)>>,
) -> Result<Vec<DeviceColumn>> {
    gather_columns_started_by(columns, &[indices], &vec![0; columns.len()], started)
}

/// As [`gather_columns_started`], each column `i` at `indices[sides[i]]` (at most two sets
/// of as many indices: a join's build and probe rows, its output gathered together, where
/// each side took launches of its own), its starts, if queued, for those indices.
pub fn gather_columns_started_by(
    columns: &[&DeviceColumn],
    indices: &[&RowIndices],
    sides: &[usize],
    started: Vec<Option<(QueuedStarts, u64)>>,
) -> Result<Vec<DeviceColumn>> {
    if started.len() != columns.len() || sides.len() != columns.len() {
        return Err(KernelError::InvalidData(format!(
            "{} queued starts and {} index sets for {} columns",
            started.len(),
            sides.len(),
            columns.len()
        )));
    }
    let mut out: Vec<Option<DeviceColumn>> = vec![None; columns.len()];
    let mut together = Vec::new();
    // Started columns of one offset width, one kind of starts and one index set are copied
    // together, up to GATHER_STRINGS in a launch.
    let mut groups: Vec<StartedGroup> = Vec::new();
    for (i, started) in started.into_iter().enumerate() {
        match started {
            Some((starts, total)) => {
                let width = string_offsets(columns[i])?.0;
                let by_source = starts.indices.is_none();
                let side = sides[i];
                match groups.iter_mut().find(|(w, b, s, g)| {
                    *w == width && *b == by_source && *s == side && g.len() < GATHER_STRINGS
                }) {
                    Some((.., group)) => group.push((i, starts, total)),
                    None => groups.push((width, by_source, side, vec![(i, starts, total)])),
                }
            }
            None => together.push(i),
        }
    }
    for (_, _, side, group) in groups {
        let at: Vec<usize> = group.iter().map(|(i, ..)| *i).collect();
        let these = group
            .into_iter()
            .map(|(i, starts, total)| (columns[i], starts, total))
            .collect();
        let gathered = gather_started_strings(these, side_indices(indices, side)?)?;
        for (i, column) in at.into_iter().zip(gathered) {
            out[i] = Some(column);
        }
    }
    let rest: Vec<&DeviceColumn> = together.iter().map(|&i| columns[i]).collect();
    let rest_sides: Vec<usize> = together.iter().map(|&i| sides[i]).collect();
    for (i, column) in together
        .into_iter()
        .zip(gather_columns_by(&rest, indices, &rest_sides)?)
    {
        out[i] = Some(column);
    }
    out.into_iter()
        .map(|c| c.ok_or_else(|| KernelError::InvalidData("a column was not gathered".into())))
        .collect()
}

/// Gathers up to [`GATHER_MANY`] fixed-width or boolean columns of one device in one
/// launch, each at the index set its pair names (of at most two, of as many indices).
fn gather_many(
    columns: &[(&DeviceColumn, usize)],
    indices: &[&RowIndices],
) -> Result<Vec<DeviceColumn>> {
    let Some((first, _)) = columns.first() else {
        return Ok(Vec::new());
    };
    let device = first.device();
    if columns.len() > GATHER_MANY || columns.iter().any(|(c, _)| c.device() != device) {
        return Err(KernelError::Unsupported(format!(
            "gathering {} columns of several devices, or more than {GATHER_MANY}, in one launch",
            columns.len()
        )));
    }
    let first_set = side_indices(indices, 0)?;
    let count = first_set.len();
    if indices.len() > 2
        || indices.iter().any(|i| i.len() != count)
        || indices.iter().any(|i| i.buffer().device() != device)
    {
        return Err(KernelError::Unsupported(format!(
            "gathering at {} index sets of lengths {:?} in one launch (at most two, of one \
             length, on the columns' device)",
            indices.len(),
            indices.iter().map(|i| i.len()).collect::<Vec<_>>()
        )));
    }
    let bitmap = count.div_ceil(8);
    let mut kinds = 0u64;
    let mut outputs = Vec::with_capacity(columns.len());
    for (k, &(column, side)) in columns.iter().enumerate() {
        let at = side_indices(indices, side)?;
        check_bound(at.bound(), column)?;
        let (kind, bytes) = match column.layout() {
            Layout::Fixed(width @ (1 | 2 | 4 | 8 | 16)) => (width as u64, count * width),
            Layout::Bits => (GATHER_BITS, bitmap),
            other => {
                return Err(KernelError::Unsupported(format!(
                    "gathering a {other:?} column with others"
                )));
            }
        };
        let second = if side == 1 { GATHER_SECOND } else { 0 };
        kinds |= (kind | second) << (8 * k);
        let values = device.alloc(bytes)?;
        let validity = match column.validity().is_some() || at.nullable() {
            true => Some(device.alloc(bitmap)?),
            false => None,
        };
        outputs.push((values, validity));
    }
    let mut args = vec![
        Arg::buf(first_set.buffer()),
        Arg::opt(indices.get(1).map(|i| i.buffer())),
        Arg::U64(count as u64),
        Arg::U64(kinds),
    ];
    for k in 0..GATHER_MANY {
        match (columns.get(k), outputs.get(k)) {
            (Some((column, _)), Some((values, validity))) => args.extend([
                Arg::buf(column.values()),
                Arg::buf(values),
                Arg::opt(column.validity()),
                Arg::opt(validity.as_ref()),
            ]),
            _ => args.extend([Arg::Ptr(0); 4]),
        }
    }
    if count > 0 {
        // SAFETY: every index of either set is below the length of each column gathered
        // at it or NULL_INDEX (RowIndices guarantees it; the bounds were checked above);
        // both sets hold `count` indices on this device, the second is null when no
        // column's kind names it; each column's values hold its length of values of its
        // kind's width (or bits), each output `count` of them (or ceil(count/8) bytes),
        // each validity bitmap (or null) its rows; slots past the columns are null and
        // their kind 0.
        unsafe {
            device.launch(
                Kernel::gather_many,
                LaunchConfig::for_items(device, count as u64, BLOCK),
                &args,
            )?;
        }
    }
    Ok(columns
        .iter()
        .zip(outputs)
        .map(|((column, _), (values, validity))| {
            DeviceColumn::from_parts(column.data_type().clone(), count, values, None, validity)
        })
        .collect())
}

/// Gathers a string column (32-bit offsets) at `indices` without a host wait, into a byte
/// buffer of `bound` bytes, which must hold the gathered strings (the caller knows the
/// longest): their total is not read. A dictionary's decoding, whose longest string the
/// host knows, gathers this way.
pub(crate) fn gather_strings_within(
    column: &DeviceColumn,
    indices: &RowIndices,
    bound: usize,
) -> Result<DeviceColumn> {
    let (width, offsets) = string_offsets(column)?;
    let count = indices.len();
    if width != 4 || bound > i32::MAX as usize || count == 0 {
        return gather(column, indices, None);
    }
    check_bound(indices.bound(), column)?;
    let device = column.device();
    let lengths = device.alloc(count * 8)?;
    // SAFETY: `offsets` holds column.len() + 1 offsets of 4 bytes, every index is below
    // the bound checked above (or NULL_INDEX); `lengths` holds `count` u64; no count word.
    unsafe {
        device.launch(
            Kernel::gather_string_lengths_o32,
            LaunchConfig::for_items(device, count as u64, BLOCK),
            &[
                Arg::buf(offsets),
                Arg::buf(indices.buffer()),
                Arg::U64(count as u64),
                Arg::Ptr(0),
                Arg::buf(&lengths),
            ],
        )?;
    }
    // The total goes to a word nobody reads: the caller's bound sizes the bytes.
    let total = device.alloc(8)?;
    let starts = scan::exclusive_scan_queued(device, &lengths, count, Word::of(&total, 0)?)?;
    gather(
        column,
        indices,
        Some((Arc::new(starts), 0, bound.max(1) as u64, false)),
    )
}

/// The output starts of a string column's gather, queued over indices whose count the host
/// has not read ([`queue_strings_starts`]); the byte total is in the word it was given.
#[derive(Debug)]
pub struct QueuedStarts {
    /// The scan the starts are part of (shared by the columns queued together), and where
    /// they begin in it (in values).
    starts: Arc<DeviceBuffer>,
    at: usize,
    slots: usize,
    /// What they were computed from: the index buffer (`None`: starts by source row, of
    /// flagged rows) and the column's offsets.
    indices: Option<u64>,
    offsets: u64,
}

/// String columns one `gather_string_lengths_many` or `gather_string_starts_many` launch
/// measures (`GATHER_STRINGS` in `cuda/gather.cu`).
const GATHER_STRINGS: usize = 4;

/// Checks that indices below `bound` address rows of `column`.
fn check_bound(bound: usize, column: &DeviceColumn) -> Result<()> {
    if bound > column.len() {
        return Err(KernelError::Unsupported(format!(
            "indices into {bound} rows used on a column of {}",
            column.len()
        )));
    }
    Ok(())
}

/// A string column's offset width and offsets.
fn string_offsets(column: &DeviceColumn) -> Result<(usize, &DeviceBuffer)> {
    match (column.layout(), column.offsets()) {
        (Layout::Var(width), Some(offsets)) => Ok((width, offsets)),
        _ => Err(KernelError::Unsupported(format!(
            "string starts of a {} column",
            column.data_type()
        ))),
    }
}

/// Gathers a string column with starts queued by [`queue_strings_starts`] over the same
/// indices (now counted), or by [`queue_flagged_strings_starts`] over the flags these
/// indices are the compaction of (in row order, no NULL index), and the byte total the
/// host read: no wait. The check that the starts were queued for these indices and this
/// column compares buffer addresses: it catches a mix-up, not a buffer freed and its
/// address handed out again (whatever the starts, no byte is written past the output).
pub fn gather_column_started(
    column: &DeviceColumn,
    indices: &RowIndices,
    started: QueuedStarts,
    total: u64,
) -> Result<DeviceColumn> {
    let fits = match started.indices {
        Some(addr) => addr == indices.buffer().addr() && indices.len() <= started.slots,
        None => indices.bound() <= started.slots && !indices.nullable(),
    };
    if !fits || Some(started.offsets) != column.offsets().map(DeviceBuffer::addr) {
        return Err(KernelError::Unsupported(
            "string starts queued for other indices or another column".into(),
        ));
    }
    let by_source = started.indices.is_none();
    gather(
        column,
        indices,
        Some((started.starts, started.at, total, by_source)),
    )
}

/// Gathers string columns of one offset width with starts queued over these indices (of
/// one kind: by output row, or by source row) and their byte totals, as
/// [`gather_column_started`] does one by one, their bytes copied in one launch (up to
/// [`GATHER_STRINGS`] columns).
fn gather_started_strings(
    mut group: Vec<(&DeviceColumn, QueuedStarts, u64)>,
    indices: &RowIndices,
) -> Result<Vec<DeviceColumn>> {
    if group.len() == 1 {
        let (column, starts, total) = group.remove(0);
        return Ok(vec![gather_column_started(column, indices, starts, total)?]);
    }
    let Some((first, first_starts, _)) = group.first() else {
        return Ok(Vec::new());
    };
    let device = first.device();
    let width = string_offsets(first)?.0;
    let by_source = first_starts.indices.is_none();
    if group.len() > GATHER_STRINGS {
        return Err(KernelError::Unsupported(format!(
            "copying {} string columns in one launch",
            group.len()
        )));
    }
    let count = indices.len();
    let null_indices = indices.nullable();
    let mut parts = Vec::with_capacity(group.len());
    for (column, started, total) in &group {
        let fits = match started.indices {
            Some(addr) => addr == indices.buffer().addr() && count <= started.slots,
            None => indices.bound() <= started.slots && !null_indices,
        };
        let (w, offsets) = string_offsets(column)?;
        if !fits
            || started.offsets != offsets.addr()
            || w != width
            || started.indices.is_none() != by_source
            || column.device() != device
        {
            return Err(KernelError::Unsupported(
                "string starts queued for other indices or another column".into(),
            ));
        }
        check_bound(indices.bound(), column)?;
        if width == 4 && *total > i32::MAX as u64 {
            return Err(KernelError::Unsupported(format!(
                "a string column of {total} bytes in 32-bit offsets"
            )));
        }
        let validity = gathered_validity(column, indices.buffer(), count, null_indices)?;
        let out_bytes = device.alloc(*total as usize)?;
        let out_offsets = device.alloc((count + 1) * width)?;
        if count == 0 {
            out_offsets.write(0, &vec![0u8; width])?;
        }
        parts.push((validity, out_bytes, out_offsets));
    }
    if count > 0 {
        let mut args = vec![
            Arg::buf(indices.buffer()),
            Arg::U64(count as u64),
            Arg::U32(u32::from(by_source)),
            Arg::U32(group.len() as u32),
        ];
        for k in 0..GATHER_STRINGS {
            match (group.get(k), parts.get(k)) {
                (Some((column, started, _)), Some((_, out_bytes, out_offsets))) => {
                    let starts = &started.starts;
                    let at = started.at;
                    args.extend([
                        Arg::buf(string_offsets(column)?.1),
                        Arg::buf(column.values()),
                        Arg::part(starts, 8 * at, starts.len() - 8 * at),
                        Arg::buf(out_offsets),
                        Arg::buf(out_bytes),
                        Arg::U64(out_bytes.len() as u64),
                    ]);
                }
                _ => args.extend([
                    Arg::Ptr(0),
                    Arg::Ptr(0),
                    Arg::Ptr(0),
                    Arg::Ptr(0),
                    Arg::Ptr(0),
                    Arg::U64(0),
                ]),
            }
        }
        let kernel = if width == 4 {
            Kernel::gather_string_copy_many_o32
        } else {
            Kernel::gather_string_copy_many_o64
        };
        // SAFETY: for each column, as `gather`'s copy: its starts are the exclusive scan of
        // its lengths at these indices (or by source row, every index below the bound
        // checked against them), so each row's bytes land inside its `out_bytes` (its
        // total), and no byte is written at or past that buffer's size whatever the
        // starts; its `out_offsets` holds count + 1 offsets, the last written by the final
        // row; columns past `group.len()` are not read.
        unsafe {
            device.launch(
                kernel,
                LaunchConfig::for_items(device, count as u64, BLOCK),
                &args,
            )?;
        }
    }
    Ok(group
        .iter()
        .zip(parts)
        .map(|((column, ..), (validity, out_bytes, out_offsets))| {
            DeviceColumn::from_parts(
                column.data_type().clone(),
                count,
                out_bytes,
                Some(out_offsets),
                validity,
            )
        })
        .collect())
}

/// The validity of `column` gathered at the `count` indices in `indices` (each below the
/// column's length, as the callers check, or NULL_INDEX, which gives NULL): none where the
/// column has none and no index is NULL.
fn gathered_validity(
    column: &DeviceColumn,
    indices: &DeviceBuffer,
    count: usize,
    null_indices: bool,
) -> Result<Option<DeviceBuffer>> {
    if column.validity().is_none() && !null_indices {
        return Ok(None);
    }
    let device = column.device();
    let out = device.alloc(count.div_ceil(8))?;
    // SAFETY: the validity bitmap (or null) covers column.len() rows, which every index
    // addresses (or is NULL_INDEX); `out` holds ceil(count/8) bytes, one thread per byte.
    unsafe {
        device.launch(
            Kernel::gather_validity,
            LaunchConfig::for_items(device, count.div_ceil(8) as u64, BLOCK),
            &[
                Arg::opt(column.validity()),
                Arg::buf(indices),
                Arg::U64(count as u64),
                Arg::buf(&out),
            ],
        )?;
    }
    Ok(Some(out))
}

/// Starts queued before (a scan, and where in it they begin), their byte total, and
/// whether they are by source row.
type Started = (Arc<DeviceBuffer>, usize, u64, bool);

fn gather(
    column: &DeviceColumn,
    indices: &RowIndices,
    started: Option<Started>,
) -> Result<DeviceColumn> {
    if column.dictionary().is_some() {
        // The codes move; the dictionary is shared.
        return Ok(column.recoded(gather(&column.codes(), indices, None)?));
    }
    check_bound(indices.bound(), column)?;
    let count = indices.len();
    let null_indices = indices.nullable();
    let indices = indices.buffer();
    let device = column.device();
    let cfg = LaunchConfig::for_items(device, count as u64, BLOCK);
    let bitmap_cfg = LaunchConfig::for_items(device, count.div_ceil(8) as u64, BLOCK);
    let n = Arg::U64(count as u64);
    // Every index is below column.len() or NULL_INDEX (RowIndices guarantees it, and the
    // bound was checked above), so the kernels read column buffers only at existing rows.
    let validity = gathered_validity(column, indices, count, null_indices)?;
    let (values, offsets) = match column.layout() {
        Layout::Fixed(width) => {
            let kernel = match width {
                1 => Kernel::gather_fixed_1,
                2 => Kernel::gather_fixed_2,
                4 => Kernel::gather_fixed_4,
                8 => Kernel::gather_fixed_8,
                16 => Kernel::gather_fixed_16,
                other => {
                    return Err(KernelError::Unsupported(format!(
                        "gathering {other}-byte values"
                    )));
                }
            };
            let out = device.alloc(count * width)?;
            // SAFETY: `values` holds column.len() values of `width` bytes; `out` holds
            // `count` of them; the kernel's element type has exactly `width` bytes.
            unsafe {
                device.launch(
                    kernel,
                    cfg,
                    &[
                        Arg::buf(column.values()),
                        Arg::buf(indices),
                        n,
                        Arg::buf(&out),
                    ],
                )?;
            }
            (out, None)
        }
        Layout::Bits => {
            let out = device.alloc(count.div_ceil(8))?;
            // SAFETY: gathering bits is gathering a bitmap: the values bitmap covers
            // column.len() rows and `out` holds ceil(count/8) bytes.
            unsafe {
                device.launch(
                    Kernel::gather_validity,
                    bitmap_cfg,
                    &[
                        Arg::buf(column.values()),
                        Arg::buf(indices),
                        n,
                        Arg::buf(&out),
                    ],
                )?;
            }
            (out, None)
        }
        Layout::Var(width) => {
            let offsets = column.offsets().ok_or_else(|| {
                KernelError::InvalidData("a string column without offsets".into())
            })?;
            let (lengths_kernel, copy_kernel) = if width == 4 {
                (
                    Kernel::gather_string_lengths_o32,
                    Kernel::gather_string_copy_o32,
                )
            } else {
                (
                    Kernel::gather_string_lengths_o64,
                    Kernel::gather_string_copy_o64,
                )
            };
            let (starts, at, total, by_source) = match started {
                Some(started) => started,
                None => {
                    let lengths = device.alloc(count * 8)?;
                    // SAFETY: `offsets` holds column.len() + 1 offsets of `width` bytes;
                    // `lengths` holds `count` u64; no count word: every index is read.
                    unsafe {
                        device.launch(
                            lengths_kernel,
                            cfg,
                            &[
                                Arg::buf(offsets),
                                Arg::buf(indices),
                                n,
                                Arg::Ptr(0),
                                Arg::buf(&lengths),
                            ],
                        )?;
                    }
                    let (starts, total) = scan::exclusive_scan(device, &lengths, count)?;
                    (Arc::new(starts), 0, total, false)
                }
            };
            if width == 4 && total > i32::MAX as u64 {
                return Err(KernelError::Unsupported(format!(
                    "a string column of {total} bytes in 32-bit offsets"
                )));
            }
            let out_bytes = device.alloc(total as usize)?;
            let out_offsets = device.alloc((count + 1) * width)?;
            if count == 0 {
                out_offsets.write(0, &vec![0u8; width])?;
            }
            // SAFETY: `starts` holds the exclusive scan of the lengths, at least `count` of
            // them (by source row: one per source row, every index being below the bound
            // checked against them), so each row's bytes land inside `out_bytes` (total
            // bytes), and the kernel writes none at or past its size whatever the starts;
            // `out_offsets` holds count + 1 offsets, the last written by the final row.
            unsafe {
                device.launch(
                    copy_kernel,
                    cfg,
                    &[
                        Arg::buf(offsets),
                        Arg::buf(column.values()),
                        Arg::buf(indices),
                        n,
                        Arg::part(&starts, 8 * at, starts.len() - 8 * at),
                        Arg::U32(u32::from(by_source)),
                        Arg::buf(&out_offsets),
                        Arg::buf(&out_bytes),
                        Arg::U64(out_bytes.len() as u64),
                    ],
                )?;
            }
            (out_bytes, Some(out_offsets))
        }
        Layout::Dict => {
            return Err(KernelError::InvalidData(
                "dictionary codes without their dictionary".into(),
            ));
        }
    };
    Ok(DeviceColumn::from_parts(
        column.data_type().clone(),
        count,
        values,
        offsets,
        validity,
    ))
}
