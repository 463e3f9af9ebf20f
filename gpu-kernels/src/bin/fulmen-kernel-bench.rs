//! `fulmen-kernel-bench`: kernel throughput on one device, as a ratio of the device's own
//! copy bandwidth measured in the same run.
//!
//! ```text
//! fulmen-kernel-bench [--device cuda:0|emulated] [--rows N] [--iterations K]
//! ```
//! Prints a markdown table: operation, rows, median milliseconds, GB/s moved, and GB/s as
//! a share of device-to-device copy bandwidth. Times on the emulated device only show that
//! it runs.

use std::time::Instant;

use fulmen_kernels::ops::{RowIndices, compact, gather};
use fulmen_kernels::{Device, DeviceColumn, EmulatorOptions};

fn median_ms(
    iterations: usize,
    mut run: impl FnMut() -> fulmen_kernels::Result<()>,
) -> fulmen_kernels::Result<f64> {
    run()?; // warm-up: compiles and loads kernels, fills the memory pool
    let mut times = Vec::with_capacity(iterations.max(1));
    for _ in 0..iterations.max(1) {
        let start = Instant::now();
        run()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut device_name = "cuda:0".to_string();
    let mut rows: Option<usize> = None;
    let mut iterations = 5usize;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--device" => device_name = args.next().ok_or("--device needs a value")?,
            "--rows" => rows = Some(args.next().ok_or("--rows needs a value")?.parse()?),
            "--iterations" => {
                iterations = args.next().ok_or("--iterations needs a value")?.parse()?
            }
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let device = match device_name.as_str() {
        "emulated" | "emulated:0" => Device::emulated(0, &EmulatorOptions::default()),
        other => {
            let ordinal = other
                .strip_prefix("cuda:")
                .ok_or("--device is cuda:N or emulated")?
                .parse()?;
            Device::cuda(ordinal, None)?
        }
    };
    let rows = rows.unwrap_or(if device_name.starts_with("cuda") {
        100_000_000
    } else {
        1_000_000
    });
    println!("device: {device} — {}", device.name());

    // Device-to-device copy: the yardstick.
    let bytes = rows * 8;
    let src = device.alloc(bytes)?;
    let dst = device.alloc(bytes)?;
    let copy_ms = median_ms(iterations, || device.copy(&dst, &src))?;
    let copy_gbs = 2.0 * bytes as f64 / copy_ms / 1e6;
    drop((src, dst));

    let values: arrow::array::Int64Array = (0..rows as i64).collect();
    let keep: arrow::array::BooleanArray = (0..rows).map(|i| Some(i % 2 == 0)).collect();
    let column = DeviceColumn::upload(&device, &values)?;
    let predicate = DeviceColumn::upload(&device, &keep)?;
    let filter_ms = median_ms(iterations, || {
        let idx = compact::selection_indices(&device, predicate.values(), None, rows)?;
        gather::gather_column(&column, &idx).map(drop)
    })?;
    // Reads the bitmap and the values, writes indices then the kept values.
    let kept = rows / 2;
    let filter_bytes = rows / 8 + kept * 4 * 2 + kept * 8 + kept * 8;

    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let random: Vec<u32> = (0..rows)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % rows as u64) as u32
        })
        .collect();
    let indices = RowIndices::upload(&device, &random, rows)?;
    let gather_ms = median_ms(iterations, || {
        gather::gather_column(&column, &indices).map(drop)
    })?;
    let gather_bytes = rows * (4 + 8 + 8);

    // GROUP BY key with count(*) and sum(v): 4 groups (per-block shared-memory tables)
    // and every row its own group (the global table); reads keys and values once.
    use fulmen_kernels::ops::aggregate::{AccInput, AccOp, GroupTable};
    let mut group_by = Vec::new();
    for (name, distinct) in [
        ("group by, count + sum (4 groups)", 4i64),
        ("group by, count + sum (all distinct)", i64::MAX),
    ] {
        let keys: arrow::array::Int64Array = (0..rows as i64)
            .map(|i| i.wrapping_mul(2_654_435_761).rem_euclid(distinct))
            .collect();
        let keys = DeviceColumn::upload(&device, &keys)?;
        let ms = median_ms(iterations, || {
            let mut table = GroupTable::new(
                &device,
                &[arrow::datatypes::DataType::Int64],
                &[AccOp::Count, AccOp::SumInt],
            )?;
            table.update(
                &[&keys],
                &[
                    AccInput {
                        values: None,
                        filter: None,
                    },
                    AccInput {
                        values: Some(&column),
                        filter: None,
                    },
                ],
                rows,
            )
        })?;
        group_by.push((name.to_string(), ms, rows * 16));
    }
    // Join: a build side of up to 1M distinct keys probed by every row, keys verified,
    // matching pairs compacted and brought to the host.
    let build_rows = rows.min(1_000_000);
    let build: arrow::array::Int64Array = (0..build_rows as i64).collect();
    let build = DeviceColumn::upload(&device, &build)?;
    let join =
        fulmen_kernels::ops::join::JoinTable::build(&device, vec![build], None, build_rows, false)?;
    let join_ms = median_ms(iterations, || join.probe(&[&column], None, rows).map(drop))?;
    let join_bytes = rows * 8 + build_rows * 8;

    println!();
    println!("| operation | rows | ms (median of {iterations}) | GB/s | of copy bandwidth |");
    println!("|---|---:|---:|---:|---:|");
    println!("| device copy | {rows} | {copy_ms:.3} | {copy_gbs:.1} | 100 % |");
    for (name, ms, moved) in [
        (
            "filter + compaction (i64, 50 %)".to_string(),
            filter_ms,
            filter_bytes,
        ),
        ("gather (i64, random)".to_string(), gather_ms, gather_bytes),
        (
            format!("join probe, keys compared ({build_rows}-row build side)"),
            join_ms,
            join_bytes,
        ),
    ]
    .into_iter()
    .chain(group_by)
    {
        let gbs = moved as f64 / ms / 1e6;
        println!(
            "| {name} | {rows} | {ms:.3} | {gbs:.1} | {:.0} % |",
            100.0 * gbs / copy_gbs
        );
    }
    Ok(())
}
