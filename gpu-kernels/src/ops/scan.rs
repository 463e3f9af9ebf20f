//! Exclusive prefix sums of u64 values (`cuda/scan.cu`).

use super::{BLOCK, Word};
use crate::device::{Arg, Device, LaunchConfig};
use crate::kernels::Kernel;
use crate::memory::DeviceBuffer;
use crate::{KernelError, Result};

/// Values per tile of `scan.cu` (SCAN_THREADS × SCAN_ITEMS).
const TILE: u64 = 1024;

/// The exclusive prefix sum of the first `n` u64 values of `input`: a buffer of `n`
/// offsets, and the total (a host wait).
pub fn exclusive_scan(
    device: &Device,
    input: &DeviceBuffer,
    n: usize,
) -> Result<(DeviceBuffer, u64)> {
    let (out, sums) = queue(device, input, n, None)?;
    let total = match sums {
        Some((sums, tiles)) => sums.read_u64(tiles)?,
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
    queue(device, input, n, Some(total_to)).map(|(out, _)| out)
}

/// Launches the scan; the tile sums (and their count: the total is at that index) unless
/// there were no values.
fn queue(
    device: &Device,
    input: &DeviceBuffer,
    n: usize,
    total_to: Option<Word<'_>>,
) -> Result<(DeviceBuffer, Option<(DeviceBuffer, usize)>)> {
    if input.len() < n * 8 {
        return Err(KernelError::Unsupported(format!(
            "scan of {n} values from a {} byte buffer",
            input.len()
        )));
    }
    let out = device.alloc(n * 8)?;
    if n == 0 {
        return Ok((out, None));
    }
    let tiles = (n as u64).div_ceil(TILE);
    let sums = device.alloc((tiles as usize + 1) * 8)?;
    // A block per tile, as many as the device holds at once (a grid-stride over tiles).
    let grid = LaunchConfig::for_items(device, tiles * BLOCK as u64, BLOCK).grid;
    let tiled = LaunchConfig {
        grid,
        block: BLOCK,
        shared_bytes: 0,
    };
    let single = LaunchConfig {
        grid: 1,
        block: BLOCK,
        shared_bytes: 0,
    };
    // SAFETY: `input` holds n u64 (checked above), `sums` tiles + 1 u64 and `out` n u64,
    // `total_to` (when given) one u64 (a `Word` holds one), all on `device`;
    // the kernels are launched with blockDim.x == SCAN_THREADS (256) as scan.cu requires,
    // and the argument lists follow its signatures.
    unsafe {
        device.launch(
            Kernel::scan_tile_sums,
            tiled,
            &[Arg::buf(input), Arg::U64(n as u64), Arg::buf(&sums)],
        )?;
        device.launch(
            Kernel::scan_tile_offsets,
            single,
            &[
                Arg::buf(&sums),
                Arg::U64(tiles),
                total_to.map_or(Arg::Ptr(0), Word::arg),
            ],
        )?;
        device.launch(
            Kernel::scan_tiles,
            tiled,
            &[
                Arg::buf(input),
                Arg::U64(n as u64),
                Arg::buf(&sums),
                Arg::buf(&out),
            ],
        )?;
    }
    Ok((out, Some((sums, tiles as usize))))
}
