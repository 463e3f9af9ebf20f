//! Launches of `cuda/selftest.cu`: kernels that test the device itself (barriers, warp
//! collectives, atomics, a race, an out-of-bounds write, a divergent barrier). Used by the
//! emulator's tests and by `scripts/gpu-check.sh` on real GPUs.

use crate::device::{Arg, Device, LaunchConfig};
use crate::kernels::Kernel;
use crate::{KernelError, Result};

fn u32s(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn i32s(bytes: &[u8]) -> Vec<i32> {
    bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn bytes_of<T: Copy, const N: usize>(values: &[T], to: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    values.iter().flat_map(|&v| to(v)).collect()
}

/// Inclusive scan of `input` (at most 1024 values) by one block in shared memory.
pub fn block_scan(device: &Device, input: &[u32]) -> Result<Vec<u32>> {
    if input.is_empty() || input.len() > 1024 {
        return Err(KernelError::Unsupported(
            "a block scan of 1 to 1024 values".into(),
        ));
    }
    let d_in = device.upload(&bytes_of(input, u32::to_le_bytes))?;
    let d_out = device.alloc(input.len() * 4)?;
    let cfg = LaunchConfig {
        grid: 1,
        block: input.len() as u32,
        shared_bytes: 0,
    };
    // SAFETY: one block of input.len() threads, each reading and writing its own element.
    unsafe {
        device.launch(
            Kernel::selftest_block_scan,
            cfg,
            &[Arg::buf(&d_in), Arg::buf(&d_out)],
        )?
    };
    Ok(u32s(&d_out.to_host()?))
}

/// What `selftest_warp` computes for each warp of 32 values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarpResults {
    /// Per warp: the sum by a `__shfl_down_sync` tree.
    pub sums: Vec<i32>,
    /// Per warp: `__ballot_sync` of value > 0.
    pub ballots: Vec<u32>,
    /// Per lane: the next lane's value (`__shfl_sync`).
    pub rotated: Vec<i32>,
    /// Per lane: the warp's sum by a `__shfl_xor_sync` butterfly.
    pub all_sums: Vec<i32>,
    /// Per warp: bit 0 `__any_sync(value < 0)`, bit 1 `__all_sync(value > 0)`.
    pub votes: Vec<u32>,
    /// Per lane: the previous lane's value (`__shfl_up_sync`), its own in lane 0.
    pub ups: Vec<i32>,
}

/// Runs the warp collectives over `input` (a whole number of warps), `per_block` values per block.
pub fn warp_ops(device: &Device, input: &[i32], per_block: u32) -> Result<WarpResults> {
    if input.is_empty()
        || !input.len().is_multiple_of(32)
        || !per_block.is_multiple_of(32)
        || !input.len().is_multiple_of(per_block as usize)
    {
        return Err(KernelError::Unsupported(
            "warp tests take whole warps and whole blocks".into(),
        ));
    }
    let n = input.len();
    let warps = n / 32;
    let d_in = device.upload(&bytes_of(input, i32::to_le_bytes))?;
    let sums = device.alloc(warps * 4)?;
    let ballots = device.alloc(warps * 4)?;
    let rotated = device.alloc(n * 4)?;
    let all_sums = device.alloc(n * 4)?;
    let votes = device.alloc(warps * 4)?;
    let ups = device.alloc(n * 4)?;
    let cfg = LaunchConfig {
        grid: (n / per_block as usize) as u32,
        block: per_block,
        shared_bytes: 0,
    };
    // SAFETY: one thread per input value; per-warp outputs hold n/32 values, per-lane n.
    unsafe {
        device.launch(
            Kernel::selftest_warp,
            cfg,
            &[
                Arg::buf(&d_in),
                Arg::buf(&sums),
                Arg::buf(&ballots),
                Arg::buf(&rotated),
                Arg::buf(&all_sums),
                Arg::buf(&votes),
                Arg::buf(&ups),
            ],
        )?;
    }
    Ok(WarpResults {
        sums: i32s(&sums.to_host()?),
        ballots: u32s(&ballots.to_host()?),
        rotated: i32s(&rotated.to_host()?),
        all_sums: i32s(&all_sums.to_host()?),
        votes: u32s(&votes.to_host()?),
        ups: i32s(&ups.to_host()?),
    })
}

/// What `selftest_atomics` leaves behind after `n` iterations.
#[derive(Debug, Clone, PartialEq)]
pub struct AtomicResults {
    /// `atomicAdd(counter, 1)` n times.
    pub counter: u32,
    /// `atomicMax` of every i.
    pub max: i32,
    /// `atomicMin` of every -i.
    pub min: i32,
    /// 64-bit `atomicAdd` of every i.
    pub sum64: u64,
    /// float `atomicAdd` of 1.0, n times.
    pub fsum: f32,
    /// double `atomicAdd` of 0.5, n times.
    pub dsum: f64,
    /// `atomicOr` of 1 << (i % 32).
    pub bits: u32,
    /// A sum of every i by an `atomicCAS` loop.
    pub cas_sum: u64,
}

/// Every thread of `grid` × `block` hammers the same few addresses, `n` updates in all.
pub fn atomics(device: &Device, n: u64, grid: u32, block: u32) -> Result<AtomicResults> {
    let zeros = [0u8; 8];
    let counter = device.upload(&zeros[..4])?;
    let max = device.upload(&i32::MIN.to_le_bytes())?;
    let min = device.upload(&i32::MAX.to_le_bytes())?;
    let sum64 = device.upload(&zeros)?;
    let fsum = device.upload(&0f32.to_le_bytes())?;
    let dsum = device.upload(&0f64.to_le_bytes())?;
    let bits = device.upload(&zeros[..4])?;
    let cas_sum = device.upload(&zeros)?;
    let cfg = LaunchConfig {
        grid,
        block,
        shared_bytes: 0,
    };
    // SAFETY: every pointer is a single value of the kernel's parameter type.
    unsafe {
        device.launch(
            Kernel::selftest_atomics,
            cfg,
            &[
                Arg::U64(n),
                Arg::buf(&counter),
                Arg::buf(&max),
                Arg::buf(&min),
                Arg::buf(&sum64),
                Arg::buf(&fsum),
                Arg::buf(&dsum),
                Arg::buf(&bits),
                Arg::buf(&cas_sum),
            ],
        )?;
    }
    let word = |b: &crate::DeviceBuffer| -> Result<[u8; 8]> {
        let mut out = [0u8; 8];
        let host = b.to_host()?;
        out[..host.len()].copy_from_slice(&host);
        Ok(out)
    };
    let w4 = |b: &crate::DeviceBuffer| -> Result<[u8; 4]> {
        let w = word(b)?;
        Ok([w[0], w[1], w[2], w[3]])
    };
    Ok(AtomicResults {
        counter: u32::from_le_bytes(w4(&counter)?),
        max: i32::from_le_bytes(w4(&max)?),
        min: i32::from_le_bytes(w4(&min)?),
        sum64: u64::from_le_bytes(word(&sum64)?),
        fsum: f32::from_le_bytes(w4(&fsum)?),
        dsum: f64::from_le_bytes(word(&dsum)?),
        bits: u32::from_le_bytes(w4(&bits)?),
        cas_sum: u64::from_le_bytes(word(&cas_sum)?),
    })
}

/// One block of `threads` threads each reads its neighbour's shared slot; without the
/// barrier that is a race. Returns what each thread read (the right answer is t + 2 mod).
pub fn racy(device: &Device, threads: u32, with_barrier: bool) -> Result<Vec<u32>> {
    let out = device.alloc(threads as usize * 4)?;
    let cfg = LaunchConfig {
        grid: 1,
        block: threads,
        shared_bytes: 0,
    };
    // SAFETY: one block; thread t writes out[t] only.
    unsafe {
        device.launch(
            Kernel::selftest_racy,
            cfg,
            &[Arg::buf(&out), Arg::U32(u32::from(with_barrier))],
        )?
    };
    Ok(u32s(&out.to_host()?))
}

/// A kernel that writes one element past the end of an `n`-element buffer: the device must
/// report it.
pub fn out_of_bounds(device: &Device, n: u64) -> Result<()> {
    let out = device.alloc(n as usize * 4)?;
    let cfg = LaunchConfig::for_items(device, n + 1, 64);
    // SAFETY: deliberately unsafe for the device (it writes out[n]); on the emulator the
    // write lands in the allocation's guard zone, which the launch check reports. Never
    // run this on a real GPU outside a test.
    unsafe { device.launch(Kernel::selftest_oob, cfg, &[Arg::buf(&out), Arg::U64(n)]) }?;
    // The launch is queued: the fault shows when the stream runs it.
    device.synchronize()
}

/// Half a block waits at `__syncthreads`, half at `__syncwarp`: the device must report it.
pub fn divergent_barrier(device: &Device) -> Result<()> {
    let out = device.alloc(64 * 4)?;
    let cfg = LaunchConfig {
        grid: 1,
        block: 64,
        shared_bytes: 0,
    };
    // SAFETY: one block of 64 threads writing out[threadIdx.x] if they ever get there.
    unsafe { device.launch(Kernel::selftest_divergent, cfg, &[Arg::buf(&out)]) }?;
    device.synchronize()
}
