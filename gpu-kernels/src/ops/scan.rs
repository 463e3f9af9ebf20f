//! Exclusive prefix sums of u64 values (`cuda/scan.cu`).

use super::BLOCK;
use crate::device::{Arg, Device, LaunchConfig};
use crate::kernels::Kernel;
use crate::memory::DeviceBuffer;
use crate::{KernelError, Result};

/// Values per tile of `scan.cu` (SCAN_THREADS × SCAN_ITEMS).
const TILE: u64 = 1024;

/// The exclusive prefix sum of the first `n` u64 values of `input`: a buffer of `n`
/// offsets, and the total.
pub fn exclusive_scan(
    device: &Device,
    input: &DeviceBuffer,
    n: usize,
) -> Result<(DeviceBuffer, u64)> {
    if input.len() < n * 8 {
        return Err(KernelError::Unsupported(format!(
            "scan of {n} values from a {} byte buffer",
            input.len()
        )));
    }
    let out = device.alloc(n * 8)?;
    if n == 0 {
        return Ok((out, 0));
    }
    let tiles = (n as u64).div_ceil(TILE);
    let sums = device.alloc((tiles as usize + 1) * 8)?;
    let grid = LaunchConfig::for_items(device, tiles, 1).grid;
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
    // all on `device`; the kernels are launched with blockDim.x == SCAN_THREADS (256) as
    // scan.cu requires, and the argument lists follow its signatures.
    unsafe {
        device.launch(
            Kernel::scan_tile_sums,
            tiled,
            &[Arg::buf(input), Arg::U64(n as u64), Arg::buf(&sums)],
        )?;
        device.launch(
            Kernel::scan_tile_offsets,
            single,
            &[Arg::buf(&sums), Arg::U64(tiles)],
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
    let total = sums.read_u64(tiles as usize)?;
    Ok((out, total))
}
