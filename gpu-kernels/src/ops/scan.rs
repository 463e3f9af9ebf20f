//! Exclusive prefix sums of u64 values (`cuda/scan.cu`): one launch (`scan_lookback`, a
//! single pass with decoupled look-back) for scans of up to [`LOOKBACK_TILES`] tiles of
//! [`TILE`] values over all segments, three past that.

use super::{BLOCK, Word};
use crate::device::{Arg, Device, LaunchConfig};
use crate::kernels::Kernel;
use crate::memory::DeviceBuffer;
use crate::{KernelError, Result};

/// Values per tile of `scan.cu` (SCAN_THREADS × SCAN_ITEMS).
pub const TILE: u64 = 1024;
/// Tiles a stream's look-back state holds (see `Device::with_lookback`): three arrays of
/// this many u64, 384 KiB. A scan of more tiles over all its segments (over 16 Mi values)
/// takes three launches.
pub const LOOKBACK_TILES: u64 = 16 * 1024;

/// The exclusive prefix sum of the first `n` u64 values of `input`: a buffer of `n`
/// offsets, and the total (a host wait).
pub fn exclusive_scan(
    device: &Device,
    input: &DeviceBuffer,
    n: usize,
) -> Result<(DeviceBuffer, u64)> {
    let (out, totals) = queue(device, input, n, 1, None)?;
    let total = match totals {
        Some(totals) => totals.read_u64(0)?,
        None => 0,
    };
    Ok((out, total))
}

/// Queues the exclusive prefix sum of the first `n` u64 values of `input` without waiting:
/// the offsets, with the total written to the word `total_to` once the scan has run (over
/// no values nothing is written: the caller zeroes the word).
pub fn exclusive_scan_queued(
    device: &Device,
    input: &DeviceBuffer,
    n: usize,
    total_to: Word<'_>,
) -> Result<DeviceBuffer> {
    queue(device, input, n, 1, Some(total_to)).map(|(out, _)| out)
}

/// Values from one segment's start to the next's, for segments of `n` values (see
/// [`segments_queued`]): `n` rounded up to whole tiles.
pub fn segment_stride(n: usize) -> usize {
    n.div_ceil(TILE as usize) * TILE as usize
}

/// Queues, in the launches of one scan, the exclusive prefix sums of `segments` segments
/// of `n` u64 values each, segment `s` at value `s * segment_stride(n)` of `input`: the
/// offsets, laid out alike (the values past `n` in a segment are neither read nor
/// written), and segment `s`'s total written to the word `segments` words after
/// `totals_to`'s own (over no values nothing is written: the caller zeroes the words).
pub fn segments_queued(
    device: &Device,
    input: &DeviceBuffer,
    n: usize,
    segments: usize,
    totals_to: Word<'_>,
) -> Result<DeviceBuffer> {
    // Every segment's word must lie inside the buffer.
    totals_to.nth(segments.saturating_sub(1))?;
    queue(device, input, n, segments, Some(totals_to)).map(|(out, _)| out)
}

/// Launches a kernel that scans, in the same launch, what each of its blocks counts (a
/// block per tile of [`TILE`] items, chained by the decoupled look-back of `scan.cuh`):
/// `launch` is given the grid (exactly `tiles` blocks of `BLOCK` threads: such kernels
/// have no grid-stride loop), the stream's look-back state and the launch's epoch (a null
/// state where there is one tile, which waits for no other). Returns `false`, having
/// launched nothing, where the tiles are more than the state holds ([`LOOKBACK_TILES`]):
/// the caller then counts and scans in separate launches.
pub(crate) fn one_pass(
    device: &Device,
    tiles: u64,
    launch: impl FnOnce(LaunchConfig, Arg, u64) -> Result<()>,
) -> Result<bool> {
    one_pass_segments(device, tiles, 1, launch)
}

/// [`one_pass`] over `segments` segments of `per_segment` tiles each, scanned apart (a
/// block per tile of each): segments of one tile wait for no other, so they need no state.
pub(crate) fn one_pass_segments(
    device: &Device,
    per_segment: u64,
    segments: u64,
    launch: impl FnOnce(LaunchConfig, Arg, u64) -> Result<()>,
) -> Result<bool> {
    let tiles = per_segment.saturating_mul(segments);
    if tiles > LOOKBACK_TILES && per_segment > 1 {
        return Ok(false);
    }
    let cfg = LaunchConfig {
        grid: u32::try_from(tiles)
            .map_err(|_| KernelError::Unsupported(format!("a scan of {tiles} tiles")))?,
        block: BLOCK,
        shared_bytes: 0,
    };
    match per_segment {
        0 | 1 => launch(cfg, Arg::Ptr(0), 0)?,
        _ => device.with_lookback(|state, epoch| launch(cfg, state, epoch))?,
    }
    Ok(true)
}

/// Launches the scan of `segments` segments; where `total_to` is not given, a buffer
/// holding the segments' totals (none over no values).
fn queue(
    device: &Device,
    input: &DeviceBuffer,
    n: usize,
    segments: usize,
    total_to: Option<Word<'_>>,
) -> Result<(DeviceBuffer, Option<DeviceBuffer>)> {
    let stride = if segments > 1 { segment_stride(n) } else { n };
    let values = segments * stride;
    if input.len() < values * 8 {
        return Err(KernelError::Unsupported(format!(
            "scan of {segments} segments of {n} values from a {} byte buffer",
            input.len()
        )));
    }
    let out = device.alloc(values * 8)?;
    if n == 0 || segments == 0 {
        return Ok((out, None));
    }
    let tiles = (n as u64).div_ceil(TILE);
    let all_tiles = tiles * segments as u64;
    let (total_arg, totals) = match total_to {
        Some(word) => (Arg::part(word.buffer, 8 * word.index, 8 * segments), None),
        None => {
            let totals = device.alloc(8 * segments)?;
            (Arg::buf(&totals), Some(totals))
        }
    };
    let lookback = |cfg: LaunchConfig, state: Arg, epoch: u64| {
        // SAFETY: `input` holds segments × stride u64 (checked above), of which the kernel
        // reads the first n of each segment; `out` holds segments × stride u64; the totals
        // (`total_to`, checked by the callers with `Word::nth`, or `totals`) `segments`
        // u64; `state` and `epoch` are as `one_pass_segments` gives them; all
        // on `device`; a block of SCAN_THREADS per tile (`one_pass_segments`), and the arguments
        // follow scan.cu's signature.
        unsafe {
            device.launch(
                Kernel::scan_lookback,
                cfg,
                &[
                    Arg::buf(input),
                    Arg::U64(n as u64),
                    Arg::U64(segments as u64),
                    state,
                    Arg::U64(LOOKBACK_TILES),
                    Arg::U64(epoch),
                    Arg::buf(&out),
                    total_arg,
                ],
            )
        }
    };
    // Segments of one tile wait for no other tile: one launch, without the state.
    if one_pass_segments(device, tiles, segments as u64, lookback)? {
        return Ok((out, totals));
    }
    let sums = device.alloc((tiles as usize + 1) * segments * 8)?;
    // A block per tile, as many as the device holds at once (a grid-stride over tiles).
    let grid = LaunchConfig::for_items(device, all_tiles * BLOCK as u64, BLOCK).grid;
    let tiled = LaunchConfig {
        grid,
        block: BLOCK,
        shared_bytes: 0,
    };
    // SAFETY: `input` holds segments × stride u64 (checked above), of which the kernels
    // read the first n of each segment; `sums` holds (tiles + 1) × segments u64 and `out`
    // segments × stride u64; the totals (`total_to`, checked by the callers: `Word::nth`,
    // or `totals`) `segments` u64, all on `device`; the kernels are launched with
    // blockDim.x == SCAN_THREADS (256) as scan.cu requires, and the argument lists follow
    // its signatures.
    unsafe {
        device.launch(
            Kernel::scan_tile_sums,
            tiled,
            &[
                Arg::buf(input),
                Arg::U64(n as u64),
                Arg::U64(segments as u64),
                Arg::buf(&sums),
            ],
        )?;
        // A block per segment scans its tile sums.
        let per_segment = LaunchConfig {
            grid: segments as u32,
            block: BLOCK,
            shared_bytes: 0,
        };
        device.launch(
            Kernel::scan_tile_offsets,
            per_segment,
            &[
                Arg::buf(&sums),
                Arg::U64(n as u64),
                Arg::U64(segments as u64),
                total_arg,
            ],
        )?;
        device.launch(
            Kernel::scan_tiles,
            tiled,
            &[
                Arg::buf(input),
                Arg::U64(n as u64),
                Arg::U64(segments as u64),
                Arg::buf(&sums),
                Arg::buf(&out),
            ],
        )?;
    }
    Ok((out, totals))
}
