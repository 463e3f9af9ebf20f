//! Criterion micro-benchmarks of the kernels, in bytes per second moved, on the device
//! `FULMEN_BENCH_DEVICE` names (`emulated`, the default, or `cuda`). Emulated numbers only
//! show that the benchmarks run; `scripts/gpu-check.sh` gives the GPU's.
//!
//! `cargo bench -p fulmen-kernels --bench kernels`

use arrow::array::{BooleanArray, Int64Array};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use fulmen_kernels::ops::{RowIndices, compact, gather, hash, hash_table};
use fulmen_kernels::{Device, DeviceColumn, EmulatorOptions};

fn device() -> Device {
    match std::env::var("FULMEN_BENCH_DEVICE").as_deref() {
        Ok("cuda") => Device::cuda(0, None).expect("FULMEN_BENCH_DEVICE=cuda needs GPU 0"),
        _ => Device::emulated(0, &EmulatorOptions::default()),
    }
}

fn kernels(c: &mut Criterion) {
    let d = device();
    let rows: usize = if d.kind() == fulmen_kernels::DeviceKind::Cuda {
        10_000_000
    } else {
        200_000
    };
    let values: Int64Array = (0..rows as i64)
        .map(|i| i.wrapping_mul(2_654_435_761) % 1000)
        .collect();
    let keep: BooleanArray = (0..rows).map(|i| Some(i % 3 != 0)).collect();
    let column = DeviceColumn::upload(&d, &values).unwrap();
    let predicate = DeviceColumn::upload(&d, &keep).unwrap();
    let random: Vec<u32> = (0..rows as u64)
        .map(|i| (i.wrapping_mul(0x9E37_79B9) % rows as u64) as u32)
        .collect();
    let indices = RowIndices::upload(&d, &random, rows).unwrap();

    let mut group = c.benchmark_group(format!("kernels on {d}"));
    group.sample_size(10);
    group.throughput(Throughput::Bytes((rows * 8 + rows / 8) as u64));
    group.bench_function("filter + compaction (i64)", |b| {
        b.iter(|| {
            let idx = compact::selection_indices(&d, predicate.values(), None, rows).unwrap();
            gather::gather_column(&column, &idx).unwrap()
        })
    });
    group.throughput(Throughput::Bytes((rows * (4 + 8 + 8)) as u64));
    group.bench_function("gather (i64, random)", |b| {
        b.iter(|| gather::gather_column(&column, &indices).unwrap())
    });
    group.throughput(Throughput::Bytes((rows * 16) as u64));
    group.bench_function("hash (i64)", |b| {
        b.iter(|| hash::hash_columns(&d, &[&column]).unwrap())
    });
    let hashes = hash::hash_columns(&d, &[&column]).unwrap();
    group.throughput(Throughput::Bytes((rows * 8) as u64));
    group.bench_function("hash table build (1000 distinct keys)", |b| {
        b.iter(|| hash_table::HashTable::build(&d, &hashes, None, rows).unwrap())
    });
    let small: Int64Array = (0..1000).collect();
    let small = DeviceColumn::upload(&d, &small).unwrap();
    let build_hashes = hash::hash_columns(&d, &[&small]).unwrap();
    let table = hash_table::HashTable::build(&d, &build_hashes, None, 1000).unwrap();
    group.bench_function("hash table probe (1000-row build side)", |b| {
        b.iter(|| table.probe(&hashes, None, rows, None).unwrap())
    });
    // GROUP BY key: count(*), sum(v) with few groups (per-block shared-memory tables) and
    // with many (the global table).
    use fulmen_kernels::ops::aggregate::{AccInput, AccOp, GroupTable};
    let ops = [AccOp::Count, AccOp::SumInt];
    for (name, distinct) in [("4 groups", 4i64), ("all rows distinct", i64::MAX)] {
        let keys: Int64Array = (0..rows as i64)
            .map(|i| i.wrapping_mul(2_654_435_761).rem_euclid(distinct))
            .collect();
        let keys = DeviceColumn::upload(&d, &keys).unwrap();
        let inputs = [
            AccInput {
                values: None,
                filter: None,
            },
            AccInput {
                values: Some(&column),
                filter: None,
            },
        ];
        group.throughput(Throughput::Bytes((rows * 16) as u64));
        group.bench_function(format!("group by, count and sum ({name})"), |b| {
            b.iter(|| {
                let mut t =
                    GroupTable::new(&d, &[arrow::datatypes::DataType::Int64], &ops).unwrap();
                t.update(&[&keys], &inputs, rows).unwrap();
                t.groups()
            })
        });
    }
    // Join: a 1000-row build side probed by every row, keys verified, pairs compacted.
    let join = fulmen_kernels::ops::join::JoinTable::build(
        &d,
        vec![DeviceColumn::upload(&d, &(0..1000).collect::<Int64Array>()).unwrap()],
        None,
        1000,
        false,
    )
    .unwrap();
    group.throughput(Throughput::Bytes((rows * 8) as u64));
    group.bench_function("join probe and verify (1000-row build side)", |b| {
        b.iter(|| join.probe(&[&column], None, rows).unwrap())
    });
    group.finish();
}

criterion_group!(benches, kernels);
criterion_main!(benches);
