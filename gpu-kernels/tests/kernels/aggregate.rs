//! Hash aggregation (`GroupTable`): groups, accumulators, failed updates, and exact float
//! sums checked against an independent exact summation.

use super::*;
use fulmen_kernels::ops::aggregate::{
    AccInput, AccOp, AccValues, Fused, FusedInput, FusedSpec, GroupTable, STATUS_BYTES, UpdateWith,
};
use fulmen_kernels::ops::expr::{Cmp, IntKind, Op, OutKind, Program};

/// How the batches of a group-table test go in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// `update_with`: argument columns, hashes and group ids in memory.
    Ordinary,
    /// `update_fused` where the table is ready for it (a program's registers feed the
    /// accumulators), else, and for a batch with new keys, `update_with`.
    Fused,
    /// `update_fused` into a table without keys: every row one group.
    FusedKeyless,
}

/// The fused program of the group-table test: each input column loaded into a register of
/// its own, in the order k1, k2, v, f, dec, keep, take.
fn loading_program() -> Program {
    let mut p = Program::new();
    let loads = [
        (Op::LoadI32, OutKind::I32, DataType::Int32),
        (Op::LoadStr32, OutKind::Str, DataType::Utf8),
        (Op::LoadI32, OutKind::I32, DataType::Int32),
        (Op::LoadF64, OutKind::F64, DataType::Float64),
        (Op::LoadDec, OutKind::Decimal, DataType::Decimal128(38, 2)),
        (Op::LoadBool, OutKind::Bool, DataType::Boolean),
        (Op::LoadBool, OutKind::Bool, DataType::Boolean),
    ];
    for (slot, (op, kind, t)) in loads.into_iter().enumerate() {
        p.push(op, 0, slot as i64);
        p.output(kind, t);
    }
    p
}

/// The host reference of a group table: groups in first-seen order, with each group's
/// (count(*), count(v), sum(v), min(v), max(v)) over the rows whose filter is true, and
/// the decimal sum, min and max over `d`.
#[derive(Debug, Default, Clone, PartialEq)]
struct RefGroup {
    rows: u64,
    count: u64,
    sum: i64,
    min: Option<i64>,
    max: Option<i64>,
    fsum_count: u64,
    fsum: f64,
    fmin: Option<f64>,
    fmax: Option<f64>,
    dsum: i128,
    dmin: Option<i128>,
    dmax: Option<i128>,
}

/// `masked`: each batch also selects its rows (`UpdateWith::rows`), and a row it drops
/// makes no group, as a filter fused into the aggregation.
#[allow(clippy::too_many_arguments)] // a test's knobs, named at each call
fn check_group_table(
    d: &Device,
    batches: usize,
    n: usize,
    distinct: u64,
    seed: u64,
    locked: bool,
    masked: bool,
    path: Path,
) {
    let ops = [
        AccOp::Count,
        AccOp::Count,
        AccOp::SumInt,
        AccOp::MinInt,
        AccOp::MaxInt,
        AccOp::SumFloat,
        AccOp::MinFloat,
        AccOp::MaxFloat,
        AccOp::SumDecimal,
        // Decimal minimum and maximum take per-group locks, and with them the update
        // leaves the shared-memory strategy: without them, few groups use it.
        if locked {
            AccOp::MinDecimal
        } else {
            AccOp::Count
        },
        if locked {
            AccOp::MaxDecimal
        } else {
            AccOp::Count
        },
    ];
    let keyed = path != Path::FusedKeyless;
    let key_types = [DataType::Int32, DataType::Utf8];
    let mut table = GroupTable::new(d, if keyed { &key_types } else { &[] }, &ops).unwrap();
    let program = loading_program();
    let reg = |value: Option<usize>| FusedInput {
        value,
        filter: Some(5),
    };
    let spec = FusedSpec {
        keys: if keyed { vec![0, 1] } else { Vec::new() },
        rows: masked.then_some(6),
        accs: vec![
            reg(None),
            reg(Some(2)),
            reg(Some(2)),
            reg(Some(2)),
            reg(Some(2)),
            reg(Some(3)),
            reg(Some(3)),
            reg(Some(3)),
            reg(Some(4)),
            reg(Some(4)),
            reg(Some(4)),
        ],
    };
    let mut order: Vec<(Option<i32>, Option<String>)> = Vec::new();
    let mut groups: std::collections::HashMap<(Option<i32>, Option<String>), RefGroup> =
        Default::default();
    let mut r = Lcg(seed);
    for _ in 0..batches {
        let k1: Int32Array = (0..n)
            .map(|_| (!r.chance(5)).then(|| (r.next() % distinct) as i32))
            .collect();
        let k2: StringArray = (0..n)
            // Of lengths 0, 1 and 3: new groups' string keys are gathered at their
            // first rows, each at the sum of the lengths of the new groups before it.
            .map(|_| (!r.chance(5)).then(|| ["", "k", "kkk"][r.next() as usize % 3].to_string()))
            .collect();
        let v: Int32Array = (0..n)
            .map(|_| (!r.chance(10)).then(|| (r.next() % 2001) as i32 - 1000))
            .collect();
        let f: Float64Array = (0..n)
            .map(|_| (!r.chance(10)).then(|| ((r.next() % 64) as f64 - 32.0) / 4.0))
            .collect();
        let dec: Decimal128Array = (0..n)
            .map(|_| (!r.chance(10)).then(|| (r.next() as i128 - (1 << 46)) << 70))
            .collect::<Decimal128Array>()
            .with_precision_and_scale(38, 2)
            .unwrap();
        let keep: BooleanArray = (0..n)
            .map(|_| (!r.chance(5)).then(|| r.chance(80)))
            .collect();
        // A NULL's value bit is random too: the selection must read the validity.
        let take_values: Vec<bool> = (0..n).map(|_| r.chance(60)).collect();
        let take_valid: Vec<bool> = (0..n).map(|_| !r.chance(5)).collect();
        let take = BooleanArray::new(
            arrow::buffer::BooleanBuffer::from(take_values),
            Some(arrow::buffer::NullBuffer::from(take_valid)),
        );
        for i in 0..n {
            if masked && !(take.is_valid(i) && take.value(i)) {
                continue;
            }
            let key = if keyed {
                (
                    k1.is_valid(i).then(|| k1.value(i)),
                    k2.is_valid(i).then(|| k2.value(i).to_string()),
                )
            } else {
                (None, None)
            };
            let g = groups.entry(key.clone()).or_insert_with(|| {
                order.push(key);
                RefGroup::default()
            });
            if !(keep.is_valid(i) && keep.value(i)) {
                continue;
            }
            g.rows += 1;
            if v.is_valid(i) {
                let x = v.value(i) as i64;
                g.count += 1;
                g.sum += x;
                g.min = Some(g.min.map_or(x, |m| m.min(x)));
                g.max = Some(g.max.map_or(x, |m| m.max(x)));
            }
            if f.is_valid(i) {
                let x = f.value(i);
                g.fsum_count += 1;
                g.fsum += x; // quarters of small integers: every partial sum is exact
                g.fmin = Some(g.fmin.map_or(x, |m| m.min(x)));
                g.fmax = Some(g.fmax.map_or(x, |m| m.max(x)));
            }
            if dec.is_valid(i) {
                let x = dec.value(i);
                g.dsum = g.dsum.wrapping_add(x);
                g.dmin = Some(g.dmin.map_or(x, |m| m.min(x)));
                g.dmax = Some(g.dmax.map_or(x, |m| m.max(x)));
            }
        }
        let up = |a: &dyn Array| DeviceColumn::upload(d, a).unwrap();
        let (k1d, k2d, vd, fd, decd, keepd, taked) = (
            up(&k1),
            up(&k2),
            up(&v),
            up(&f),
            up(&dec),
            up(&keep),
            up(&take),
        );
        fn with<'a>(values: Option<&'a DeviceColumn>, keep: &'a DeviceColumn) -> AccInput<'a> {
            AccInput {
                values,
                filter: Some(keep),
            }
        }
        let inputs = [
            with(None, &keepd),
            with(Some(&vd), &keepd),
            with(Some(&vd), &keepd),
            with(Some(&vd), &keepd),
            with(Some(&vd), &keepd),
            with(Some(&fd), &keepd),
            with(Some(&fd), &keepd),
            with(Some(&fd), &keepd),
            with(Some(&decd), &keepd),
            with(Some(&decd), &keepd),
            with(Some(&decd), &keepd),
        ];
        let with = UpdateWith {
            rows: masked.then_some(&taked),
            status: None,
        };
        if path != Path::Ordinary && table.fused_possible() {
            // As the engine does: a table without groups takes a batch's keys first (reading
            // only its key columns); a fused batch that meets new keys goes the ordinary way.
            let columns = [&k1d, &k2d, &vd, &fd, &decd, &keepd, &taked];
            if keyed && table.groups() == 0 {
                assert!(table.insert_groups(&[&k1d, &k2d], n, with).unwrap());
            }
            if table.fused_ready() {
                match table.update_fused(&program, &columns, n, &spec).unwrap() {
                    Fused::Added => continue,
                    Fused::NewGroups => assert!(keyed, "a table without keys has its group"),
                    Fused::LeftToCpu => panic!("loads leave nothing to the CPU"),
                }
            }
        }
        assert!(
            keyed,
            "a table without keys is always ready for a fused batch"
        );
        assert!(table.update_with(&[&k1d, &k2d], &inputs, n, with).unwrap());
    }
    if !keyed {
        // One group, whether or not a row came.
        if order.is_empty() {
            order.push((None, None));
            groups.insert((None, None), RefGroup::default());
        }
        assert!(table.keys().unwrap().is_empty());
    }
    assert_eq!(table.groups(), order.len());
    if keyed {
        let keys = table.keys().unwrap();
        let k1 = keys[0].as_primitive::<Int32Type>();
        let k2 = keys[1].as_string::<i32>();
        for (g, key) in order.iter().enumerate() {
            let got = (
                k1.is_valid(g).then(|| k1.value(g)),
                k2.is_valid(g).then(|| k2.value(g).to_string()),
            );
            assert_eq!(&got, key, "group {g} is in first-seen order");
        }
    }
    let states: Vec<_> = (0..ops.len()).map(|k| table.state(k).unwrap()).collect();
    // What a finished aggregation reads in one wait is what the reads one by one give
    // (compared as printed: a NaN minimum equals itself there).
    let (all_keys, all_states) = table.download().unwrap();
    assert_eq!(
        format!("{all_states:?}"),
        format!("{states:?}"),
        "download's states"
    );
    assert_eq!(all_keys, table.keys().unwrap(), "download's keys");
    let int = |k: usize| match &states[k].values {
        AccValues::Int(v) => v.clone(),
        other => panic!("{other:?}"),
    };
    let float = |k: usize| match &states[k].values {
        AccValues::Float(v) => v.clone(),
        other => panic!("{other:?}"),
    };
    let dec = |k: usize| match &states[k].values {
        AccValues::Decimal(v) => v.clone(),
        other => panic!("{other:?}"),
    };
    for (g, key) in order.iter().enumerate() {
        let want = &groups[key];
        fn seen<T>(counts: &[u64], g: usize, v: T) -> Option<T> {
            (counts[g] > 0).then_some(v)
        }
        assert_eq!(states[0].counts[g], want.rows, "count(*) of {key:?}");
        assert_eq!(states[1].counts[g], want.count, "count(v) of {key:?}");
        assert_eq!(int(2)[g], want.sum, "sum of {key:?}");
        assert_eq!(seen(&states[3].counts, g, int(3)[g]), want.min);
        assert_eq!(seen(&states[4].counts, g, int(4)[g]), want.max);
        assert_eq!(states[5].counts[g], want.fsum_count);
        assert_eq!(
            float(5)[g].to_bits(),
            want.fsum.to_bits(),
            "float sum of {key:?}"
        );
        assert_eq!(seen(&states[6].counts, g, float(6)[g]), want.fmin);
        assert_eq!(seen(&states[7].counts, g, float(7)[g]), want.fmax);
        assert_eq!(dec(8)[g], want.dsum, "decimal sum of {key:?}");
        if locked {
            assert_eq!(seen(&states[9].counts, g, dec(9)[g]), want.dmin);
            assert_eq!(seen(&states[10].counts, g, dec(10)[g]), want.dmax);
        } else {
            assert_eq!(states[9].counts[g], states[8].counts[g]);
        }
    }
    eprintln!(
        "{path:?}: {} groups: {} shared-memory, {} global and {} fused updates",
        table.groups(),
        table.shared_updates,
        table.global_updates,
        table.fused_updates
    );
    match path {
        Path::Ordinary => assert_eq!(table.fused_updates, 0),
        // With few groups, every batch is fused (after inserting its new keys).
        Path::FusedKeyless if n > 0 => assert_eq!(table.fused_updates, batches as u64),
        Path::Fused if n >= 1000 && distinct < 100 => {
            assert_eq!(table.fused_updates, batches as u64)
        }
        _ => {}
    }
}

#[test]
fn group_table_aggregates_like_the_host_reference() {
    let d = device();
    // Few groups (shared-memory tables), many groups (one global table that grows past
    // its first size within a batch and across batches), and empty and tiny batches.
    // Each also with a row selection (a fused filter): dropped rows make no group.
    for (locked, masked) in [(false, false), (true, false), (false, true), (true, true)] {
        check_group_table(&d, 3, 5000, 4, 1, locked, masked, Path::Ordinary);
        check_group_table(&d, 4, 3000, 1_000_000, 2, locked, masked, Path::Ordinary);
        check_group_table(&d, 2, 1, 10, 3, locked, masked, Path::Ordinary);
        check_group_table(&d, 2, 0, 10, 4, locked, masked, Path::Ordinary);
    }
}

/// The same batches and host reference, with the accumulators fed from a program's
/// registers (`update_fused`): keyed with up to 8 and 20 groups (a warp reduces a group a
/// round, and past its rounds the rest update lane by lane), with many groups (too many
/// for the fused kernel: the ordinary way), and without keys (each thread's rows reduced in
/// registers), at awkward sizes.
#[test]
fn fused_group_table_updates_aggregate_like_the_host_reference() {
    let d = device();
    for masked in [false, true] {
        check_group_table(&d, 3, 5000, 1, 5, false, masked, Path::Fused);
        check_group_table(&d, 3, 5000, 4, 6, false, masked, Path::Fused);
        check_group_table(&d, 3, 3000, 1_000_000, 7, false, masked, Path::Fused);
        check_group_table(&d, 2, 1, 10, 8, false, masked, Path::Fused);
        for n in [0, 1, 31, 33, 257, 5000, 70_001] {
            check_group_table(&d, 2, n, 1, 9, false, masked, Path::FusedKeyless);
        }
    }
}

/// A batch whose upstream status word is set (an expression program that failed) changes
/// nothing, whether its keys were new or seen; with the word clear it goes in, and the
/// table's count of new groups and the upstream word come back in one host wait (counted
/// on an emulated device of the test's own: the CUDA test device is shared by every test).
#[test]
fn an_update_whose_upstream_failed_leaves_the_table_as_it_was() {
    check_upstream_status(&device(), false);
    check_upstream_status(&emulated(), true);
}

fn check_upstream_status(d: &Device, count_waits: bool) {
    let waits = |before: u64, what: &str| {
        if count_waits {
            assert_eq!(d.counts().syncs - before, 1, "{what}");
        }
    };
    let mut table = GroupTable::new(d, &[DataType::Int64], &[AccOp::Count]).unwrap();
    let input = [AccInput {
        values: None,
        filter: None,
    }];
    let seen: Int64Array = (0..3000).map(|i| Some(i % 700)).collect();
    let seen = DeviceColumn::upload(d, &seen).unwrap();
    table.update(&[&seen], &input, 3000).unwrap();
    let want = table.state(0).unwrap();
    let fresh: Int64Array = (0..3000).map(|i| Some(1000 + i % 900)).collect();
    let fresh = DeviceColumn::upload(d, &fresh).unwrap();
    let status = |failed: u64| {
        let mut words = vec![0u8; STATUS_BYTES];
        words[8..16].copy_from_slice(&failed.to_le_bytes());
        d.upload(&words).unwrap()
    };
    for keys in [&seen, &fresh] {
        let failed = status(1);
        let with = UpdateWith {
            rows: None,
            status: Some(&failed),
        };
        let before = d.counts().syncs;
        assert!(!table.update_with(&[keys], &input, 3000, with).unwrap());
        waits(before, "one host wait");
        assert_eq!(table.groups(), 700);
        assert_eq!(table.state(0).unwrap(), want);
    }
    let clear = status(0);
    let with = UpdateWith {
        rows: None,
        status: Some(&clear),
    };
    let before = d.counts().syncs;
    assert!(table.update_with(&[&seen], &input, 3000, with).unwrap());
    waits(before, "a batch of known groups waits once");
    assert_eq!(table.groups(), 700);
    assert!(
        table
            .update_with(
                &[&fresh],
                &input,
                3000,
                UpdateWith {
                    rows: None,
                    status: Some(&status(0))
                }
            )
            .unwrap()
    );
    assert_eq!(table.groups(), 1600);
    let counts = table.state(0).unwrap().counts;
    assert!(counts[..700].iter().all(|&c| c > 0) && counts[700..].iter().all(|&c| c > 0));
    assert_eq!(counts.iter().sum::<u64>(), 9000);
}

#[test]
fn a_failed_group_table_update_leaves_the_table_as_it_was() {
    let d = emulated();
    let keys: Int64Array = (0..4000).map(|i| Some(i % 1500)).collect();
    let keys = DeviceColumn::upload(&d, &keys).unwrap();
    let mut clean = GroupTable::new(&d, &[DataType::Int64], &[AccOp::Count]).unwrap();
    let input = [AccInput {
        values: None,
        filter: None,
    }];
    clean.update(&[&keys], &input, 4000).unwrap();
    clean.update(&[&keys], &input, 4000).unwrap();
    let want = clean.state(0).unwrap();
    // Fail each allocation and each launch of the second update in turn: the update
    // either fails and changes nothing (so that retrying it gives the clean answer) or
    // succeeds.
    for kind in ["allocation", "launch"] {
        for k in 1.. {
            let mut table = GroupTable::new(&d, &[DataType::Int64], &[AccOp::Count]).unwrap();
            table.update(&[&keys], &input, 4000).unwrap();
            let plan = if kind == "allocation" {
                FaultPlan {
                    fail_allocation: Some(k),
                    ..FaultPlan::default()
                }
            } else {
                FaultPlan {
                    fail_launch: Some(k),
                    ..FaultPlan::default()
                }
            };
            d.inject_faults(plan).unwrap();
            let failed = table.update(&[&keys], &input, 4000).is_err();
            d.inject_faults(FaultPlan::default()).unwrap();
            if failed {
                table.update(&[&keys], &input, 4000).unwrap();
            }
            assert_eq!(table.groups(), 1500, "{kind} {k}");
            assert_eq!(table.state(0).unwrap(), want, "{kind} {k}");
            if !failed {
                break;
            }
        }
    }
}

/// The correctly rounded sum of `xs`, by Shewchuk's method (non-overlapping partials kept
/// exactly with two-sums, then rounded once with the half-way correction), an algorithm
/// independent of the device's fixed-point one. Valid while no partial overflows.
fn exact_sum(xs: &[f64]) -> f64 {
    let mut partials: Vec<f64> = Vec::new();
    for &value in xs {
        let mut x = value;
        let mut kept = 0;
        for j in 0..partials.len() {
            let mut y = partials[j];
            if x.abs() < y.abs() {
                std::mem::swap(&mut x, &mut y);
            }
            let hi = x + y;
            let lo = y - (hi - x);
            if lo != 0.0 {
                partials[kept] = lo;
                kept += 1;
            }
            x = hi;
        }
        partials.truncate(kept);
        partials.push(x);
    }
    let Some(mut hi) = partials.pop() else {
        return 0.0;
    };
    let mut lo = 0.0;
    while let Some(y) = partials.pop() {
        let x = hi;
        hi = x + y;
        lo = y - (hi - x);
        if lo != 0.0 {
            break;
        }
    }
    // The rest is below half an ulp of hi; when lo is exactly half an ulp, the rest's sign
    // decides the tie.
    if let Some(&next) = partials.last()
        && ((lo < 0.0 && next < 0.0) || (lo > 0.0 && next > 0.0))
    {
        let y = lo * 2.0;
        let x = hi + y;
        if x - hi == y {
            hi = x;
        }
    }
    hi + 0.0 // a sum of zeros is +0.0, as arrow's (which starts from 0.0)
}

/// Sums `batches` with one float-sum accumulator over `keys` (None: no GROUP BY) and
/// returns each group's sum, in first-seen group order.
fn device_sums(d: &Device, batches: &[(Vec<i64>, Vec<f64>)], keyed: bool, carry: u64) -> Vec<f64> {
    let key_types = if keyed { vec![DataType::Int64] } else { vec![] };
    let mut table = GroupTable::new(d, &key_types, &[AccOp::SumFloat]).unwrap();
    table.carry_exact_sums_every(carry);
    for (keys, values) in batches {
        let k = DeviceColumn::upload(d, &Int64Array::from(keys.clone())).unwrap();
        let v = DeviceColumn::upload(d, &Float64Array::from(values.clone())).unwrap();
        let input = [AccInput {
            values: Some(&v),
            filter: None,
        }];
        let key_columns: Vec<&DeviceColumn> = if keyed { vec![&k] } else { vec![] };
        table.update(&key_columns, &input, values.len()).unwrap();
    }
    match table.state(0).unwrap().values {
        AccValues::Float(v) => v,
        other => panic!("{other:?}"),
    }
}

fn sum_of(d: &Device, xs: &[f64]) -> f64 {
    device_sums(d, &[(vec![0; xs.len()], xs.to_vec())], false, u64::MAX)[0]
}

#[test]
fn float_sums_are_correctly_rounded_at_the_edges() {
    let d = device();
    let tiny = f64::from_bits(1); // the smallest subnormal
    let cases: &[(&[f64], f64)] = &[
        (&[], 0.0),
        (&[-0.0], 0.0),
        (&[0.1; 10], 1.0), // in order, 0.9999999999999999
        (&[-128.2, 32768.3, 27.3], 32667.4),
        (&[1e308, 1e308, -1e308, -1e308, 1.0], 1.0), // passes 2^1024 on the way
        (&[1.0, 1e-300, -1.0], 1e-300),
        (&[f64::MAX, f64::MAX], f64::INFINITY),
        (&[f64::MAX, f64::MAX, -f64::MAX], f64::MAX),
        (&[-f64::MAX, -f64::MAX], f64::NEG_INFINITY),
        (&[tiny, tiny, tiny], f64::from_bits(3)),
        (
            &[f64::MIN_POSITIVE, -tiny],
            f64::from_bits(f64::MIN_POSITIVE.to_bits() - 1),
        ),
        // Ties go to the even neighbour; anything below the tie breaks it.
        (&[1.0, 1.0 / (1u64 << 53) as f64], 1.0),
        (&[1.0, 1.0 / (1u64 << 53) as f64, 1e-30], 1.0 + f64::EPSILON),
        (&[9007199254740994.0, 1.0], 9007199254740996.0),
        (&[-9007199254740994.0, -1.0], -9007199254740996.0),
        (&[9007199254740992.0, 1.0], 9007199254740992.0),
        (&[1e16, 1.0, -1e16], 1.0),
        (&[f64::INFINITY, 1.0], f64::INFINITY),
        (&[f64::NEG_INFINITY, f64::MAX], f64::NEG_INFINITY),
    ];
    for (xs, want) in cases {
        let got = sum_of(&d, xs);
        assert_eq!(
            got.to_bits(),
            want.to_bits(),
            "sum of {xs:?}: {got:e}, want {want:e}"
        );
        // The reference holds where no partial sum overflows.
        if xs.iter().map(|x| x.abs()).sum::<f64>().is_finite() {
            assert_eq!(
                exact_sum(xs).to_bits(),
                want.to_bits(),
                "the reference on {xs:?}"
            );
        }
    }
    assert!(sum_of(&d, &[f64::INFINITY, f64::NEG_INFINITY]).is_nan());
    assert!(sum_of(&d, &[1.0, f64::NAN]).is_nan());
}

/// Doubles of every magnitude and sign, subnormals included, most of them cancelled by
/// their negation elsewhere in the sequence: what is left is the sum of the small ones, so
/// a sum that drops a bit anywhere is wrong, and a naive sum depends on the order.
fn awkward_doubles(r: &mut Lcg, n: usize) -> Vec<f64> {
    let one = |r: &mut Lcg| {
        let exponent = match r.next() % 4 {
            0 => 0x3F0 + r.next() % 0x20, // around 1
            1 => 0x3BF + r.next() % 0xA0, // 2^-64 .. 2^96
            2 => r.next() % 0x40,         // subnormal and tiny
            _ => 0x784 + r.next() % 0x64, // 2^900 .. 2^1000
        };
        let significand = (r.next() ^ (r.next() << 20)) & ((1 << 52) - 1);
        f64::from_bits((r.next() & 1) << 63 | exponent << 52 | significand)
    };
    let mut xs: Vec<f64> = (0..n / 2).map(|_| one(r)).collect();
    for i in 0..n - n / 2 {
        let x = if i < n / 2 && r.chance(90) {
            -xs[i]
        } else {
            one(r)
        };
        xs.push(x);
    }
    for i in (1..xs.len()).rev() {
        xs.swap(i, r.next() as usize % (i + 1));
    }
    xs
}

#[test]
fn float_sums_do_not_depend_on_order_threads_batches_or_carrying() {
    let d = device();
    let mut r = Lcg(77);
    for (n, groups) in [(5000usize, 1u64), (20_000, 7), (30_000, 3000)] {
        let values = awkward_doubles(&mut r, n);
        let keys: Vec<i64> = (0..n).map(|_| (r.next() % groups) as i64).collect();
        // The reference, per group in first-seen order.
        let mut order: Vec<i64> = Vec::new();
        let mut members: std::collections::HashMap<i64, Vec<f64>> = Default::default();
        for (&k, &v) in keys.iter().zip(&values) {
            members
                .entry(k)
                .or_insert_with(|| {
                    order.push(k);
                    Vec::new()
                })
                .push(v);
        }
        let want: Vec<u64> = order
            .iter()
            .map(|k| exact_sum(&members[k]).to_bits())
            .collect();
        let naive: Vec<u64> = order
            .iter()
            .map(|k| members[k].iter().sum::<f64>().to_bits())
            .collect();
        assert_ne!(want, naive, "the data must make order matter");
        let keyed = groups > 1;
        let bits = |v: Vec<f64>| v.into_iter().map(f64::to_bits).collect::<Vec<_>>();
        let one_batch = [(keys.clone(), values.clone())];
        assert_eq!(
            bits(device_sums(&d, &one_batch, keyed, u64::MAX)),
            want,
            "{n} rows, {groups} groups"
        );
        // Other batch boundaries, the limbs carried before every batch.
        let mut batches = Vec::new();
        let mut at = 0;
        while at < n {
            let len = (1 + r.next() as usize % 4000).min(n - at);
            batches.push((keys[at..at + len].to_vec(), values[at..at + len].to_vec()));
            at += len;
        }
        assert_eq!(
            bits(device_sums(&d, &batches, keyed, 1)),
            want,
            "batches, carried each time"
        );
        // Emulated devices with other thread orders and grid shapes.
        for seed in [1, 0xDEAD_BEEF] {
            for multiprocessors in [1, 5] {
                let other = Device::emulated(
                    0,
                    &EmulatorOptions {
                        seed,
                        multiprocessors,
                        ..Default::default()
                    },
                );
                assert_eq!(
                    bits(device_sums(&other, &batches, keyed, 3000)),
                    want,
                    "seed {seed}, {multiprocessors} SMs"
                );
            }
        }
    }
}

/// A fused batch is one upload, two launches (the fused kernel and the merge of its deltas)
/// and one host wait, and changes nothing unless it is added: not when a row's key has no
/// group yet (the batch then goes the ordinary way, which inserts it), nor when a row meets
/// a case the program leaves to the CPU. Counted on an emulated device of the test's own.
#[test]
fn a_fused_batch_waits_once_and_changes_nothing_unless_added() {
    let d = emulated();
    let ops = [
        AccOp::Count,
        AccOp::SumInt,
        AccOp::SumFloat,
        AccOp::SumDecimal,
    ];
    let mut table = GroupTable::new(&d, &[DataType::Int64], &ops).unwrap();
    // Registers: 0 the key, 1 the key times `factor` (an overflow where it is huge), 2 the
    // key as a float, 3 the key as a decimal of scale 2, 4 "key < limit".
    let program = |factor: i64, limit: i64| {
        let mut p = Program::new();
        p.push(Op::LoadI64, 0, 0);
        p.output(OutKind::I64, DataType::Int64);
        p.push(Op::LoadI64, 0, 0);
        let k = p.constant(Some((factor, 0)));
        p.push(Op::Const, 0, k);
        p.push(Op::MulI, IntKind::I64 as i64, 0);
        p.output(OutKind::I64, DataType::Int64);
        p.push(Op::LoadI64, 0, 0);
        p.push(Op::CastIF, 0, 0);
        p.output(OutKind::F64, DataType::Float64);
        p.push(Op::LoadI64, 0, 0);
        p.push(Op::CastID, 18, 2);
        p.output(OutKind::Decimal, DataType::Decimal128(18, 2));
        p.push(Op::LoadI64, 0, 0);
        let l = p.constant(Some((limit, 0)));
        p.push(Op::Const, 0, l);
        p.push(Op::CmpI, Cmp::Lt as i64, 0);
        p.output(OutKind::Bool, DataType::Boolean);
        p
    };
    let feed = |value: Option<usize>| FusedInput {
        value,
        filter: None,
    };
    let spec = FusedSpec {
        keys: vec![0],
        rows: Some(4),
        accs: vec![feed(None), feed(Some(1)), feed(Some(2)), feed(Some(3))],
    };
    let ordinary = |table: &mut GroupTable, c: &DeviceColumn| {
        let none = AccInput {
            values: None,
            filter: None,
        };
        let some = AccInput {
            values: Some(c),
            filter: None,
        };
        table
            .update(&[c], &[none, some, some, some], c.len())
            .unwrap();
    };
    let states = |table: &GroupTable| -> Vec<_> {
        (0..ops.len()).map(|k| table.state(k).unwrap()).collect()
    };
    // 60 rows of each key 0..50; the ordinary batch 75 rows of each key 0..40.
    let keys: Int64Array = (0..3000).map(|i| Some(i % 50)).collect();
    let keys = DeviceColumn::upload(&d, &keys).unwrap();
    let few: Int64Array = (0..3000).map(|i| Some(i % 40)).collect();
    let few = DeviceColumn::upload(&d, &few).unwrap();
    assert!(
        !table.fused_ready(),
        "a keyed table without groups inserts them first"
    );
    ordinary(&mut table, &few);
    assert_eq!(table.groups(), 40);

    // Keys 40..50 have no group: nothing is added.
    let before = states(&table);
    let counts = d.counts();
    assert!(table.fused_ready());
    let outcome = table.update_fused(&program(3, 50), &[&keys], 3000, &spec);
    assert_eq!(outcome.unwrap(), Fused::NewGroups);
    let after = d.counts();
    assert_eq!(after.syncs - counts.syncs, 1, "one host wait");
    // The first fused batch also readies its new deltas (a merge applying nothing).
    assert_eq!(
        after.launches - counts.launches,
        3,
        "a reset, the kernel and the merge"
    );
    assert_eq!(after.h2d_copies - counts.h2d_copies, 1, "one upload");
    assert_eq!(states(&table), before);
    assert_eq!(table.groups(), 40);
    // The keys and every state come up in one wait, with one launch (the exact float
    // sum's rounding).
    let counts = d.counts();
    let (keys_now, states_now) = table.download().unwrap();
    let after = d.counts();
    assert_eq!(after.syncs - counts.syncs, 1, "download: one host wait");
    assert_eq!(
        after.launches - counts.launches,
        1,
        "download: one rounding"
    );
    assert_eq!(states_now, before);
    assert_eq!(keys_now[0].len(), 40);
    // A count(DISTINCT)'s tables of (group, value) pairs come up in the same wait.
    let pairs: Vec<GroupTable> = [7, 13]
        .iter()
        .map(|&m| {
            let mut t = GroupTable::new(&d, &[DataType::Int64, DataType::Int64], &[]).unwrap();
            let values: Int64Array = (0..3000).map(|i| Some(i % m)).collect();
            let values = DeviceColumn::upload(&d, &values).unwrap();
            t.update(&[&few, &values], &[], 3000).unwrap();
            t
        })
        .collect();
    let counts = d.counts();
    let refs: Vec<&GroupTable> = pairs.iter().collect();
    let (keys_with, states_with, pair_keys) = table.download_with(&refs).unwrap();
    let after = d.counts();
    assert_eq!(
        after.syncs - counts.syncs,
        1,
        "download_with: one host wait"
    );
    assert_eq!((keys_with, states_with), (keys_now.clone(), before.clone()));
    for (t, got) in pairs.iter().zip(&pair_keys) {
        assert_eq!(got, &t.keys().unwrap(), "a pair table's keys");
        assert!(got[0].len() > 40, "{}", got[0].len());
    }
    assert!(
        !table.fused_ready(),
        "after new keys, a batch goes the ordinary way"
    );
    ordinary(&mut table, &few);
    assert!(table.fused_ready());

    // Selecting the keys below 40, the batch goes in.
    let before = states(&table);
    let counts = d.counts();
    let outcome = table.update_fused(&program(3, 40), &[&keys], 3000, &spec);
    assert_eq!(outcome.unwrap(), Fused::Added);
    let after = d.counts();
    assert_eq!(after.syncs - counts.syncs, 1, "one host wait");
    assert_eq!(
        after.launches - counts.launches,
        2,
        "the kernel and the merge"
    );
    assert_eq!(after.h2d_copies - counts.h2d_copies, 1, "one upload");
    assert_eq!((table.fused_updates, table.groups()), (1, 40));
    let now = states(&table);
    let (AccValues::Int(sum), AccValues::Int(sum_was)) = (&now[1].values, &before[1].values) else {
        panic!("{now:?}")
    };
    let (AccValues::Float(fsum), AccValues::Float(fsum_was)) = (&now[2].values, &before[2].values)
    else {
        panic!("{now:?}")
    };
    let (AccValues::Decimal(dsum), AccValues::Decimal(dsum_was)) =
        (&now[3].values, &before[3].values)
    else {
        panic!("{now:?}")
    };
    for g in 0..40 {
        let key = g as i64; // the ordinary batches put key g in group g
        assert_eq!(now[0].counts[g], before[0].counts[g] + 60, "count of {g}");
        assert_eq!(sum[g], sum_was[g] + 60 * 3 * key, "sum of 3 × {g}");
        assert_eq!(fsum[g], fsum_was[g] + 60.0 * key as f64, "float sum of {g}");
        assert_eq!(
            dsum[g],
            dsum_was[g] + 60 * 100 * key as i128,
            "decimal sum of {g}"
        );
    }

    // Misses in a row back off: after a second miss (right after the ordinary batch the
    // first one cost) two ordinary batches go before the next try; a batch added resets it.
    let table_states = states(&table);
    assert_eq!(
        table
            .update_fused(&program(3, 50), &[&keys], 3000, &spec)
            .unwrap(),
        Fused::NewGroups
    );
    ordinary(&mut table, &few);
    assert!(table.fused_ready());
    assert_eq!(
        table
            .update_fused(&program(3, 50), &[&keys], 3000, &spec)
            .unwrap(),
        Fused::NewGroups
    );
    ordinary(&mut table, &few);
    assert!(
        !table.fused_ready(),
        "a second miss in a row costs two ordinary batches"
    );
    ordinary(&mut table, &few);
    assert!(table.fused_ready());
    assert_eq!(
        table
            .update_fused(&program(3, 40), &[&keys], 3000, &spec)
            .unwrap(),
        Fused::Added
    );
    assert_ne!(states(&table), table_states);

    // An overflow in a row leaves the batch to the CPU and the table as it was.
    let before = states(&table);
    let counts = d.counts();
    let outcome = table.update_fused(&program(i64::MAX / 3, 40), &[&keys], 3000, &spec);
    assert_eq!(outcome.unwrap(), Fused::LeftToCpu);
    assert_eq!(d.counts().syncs - counts.syncs, 1, "one host wait");
    assert_eq!(states(&table), before);

    // Registers that do not fit their use are refused before anything runs.
    let refused = |change: &dyn Fn(&mut FusedSpec)| {
        let mut wrong = spec.clone();
        change(&mut wrong);
        let mut table = GroupTable::new(&d, &[DataType::Int64], &ops).unwrap();
        ordinary(&mut table, &few);
        let launches_before = d.counts().launches;
        assert!(
            table
                .update_fused(&program(3, 40), &[&keys], 3000, &wrong)
                .is_err()
        );
        assert_eq!(d.counts().launches, launches_before, "nothing launched");
    };
    refused(&|s| s.keys = vec![2]);
    refused(&|s| s.keys = vec![0, 0]);
    refused(&|s| s.rows = Some(0));
    refused(&|s| s.accs[1].value = Some(5));
    refused(&|s| s.accs[2].value = Some(3)); // a float sum of decimals
    refused(&|s| s.accs[0].filter = Some(2));
    refused(&|s| s.accs.pop().map(|_| ()).unwrap_or(()));
}

/// A new table starts in one launch (`agg_init_state`): its accumulators at their
/// identity, their locks and, with keys, its first hash slots empty, so that a first batch
/// of up to 900 rows fills no slots (no `agg_fill_u64`). Also a table grouping without
/// accumulators (its slots alone), one without keys, and ones of eight and nine
/// accumulators (eight to a launch); each then aggregates 900 rows into 37 groups (a key's
/// sum is its rows times itself). And a first batch of 20 000 new groups is inserted once: its slots are sized
/// for every row to be new, not for the 1 024 groups 2 048 slots hold (when it was
/// inserted, undone, and inserted again).
#[test]
fn a_new_group_table_starts_in_one_launch() {
    // Counted on an emulated device of the test's own: through the stand-in driver the
    // suite's tests share cuda:0, and another test's launch between two counts made one
    // table's start count 3 launches for 2 (once, with the tests run in another order).
    let d = emulated();
    use fulmen_kernels::Kernel;
    let launches_of = |d: &Device, kernel: Kernel| -> u64 {
        d.kernel_counts()
            .iter()
            .filter(|k| k.kernel == kernel)
            .map(|k| k.launches)
            .sum()
    };
    let fills = |d: &Device| launches_of(d, Kernel::agg_fill_u64);
    let rows = 900;
    let keys: Int64Array = (0..rows).map(|i| Some(i % 37)).collect();
    let keys = DeviceColumn::upload(&d, &keys).unwrap();
    let input = AccInput {
        values: Some(&keys),
        filter: None,
    };
    // The device's first scan sets its look-back state up (a fill, once per stream).
    let mut warm = GroupTable::new(&d, &[DataType::Int64], &[AccOp::Count]).unwrap();
    warm.update(&[&keys], &[input], rows as usize).unwrap();
    let int64 = [DataType::Int64];
    for (key_types, ops, launches) in [
        (&int64[..], vec![AccOp::Count, AccOp::SumInt], 1),
        (&int64[..], vec![], 1),
        (&[][..], vec![AccOp::Count, AccOp::SumInt], 1),
        (&int64[..], vec![AccOp::SumInt; 8], 1),
        (&int64[..], vec![AccOp::SumInt; 9], 2),
    ] {
        let case = format!("{} keys, {} accumulators", key_types.len(), ops.len());
        let before = d.counts().launches;
        let mut table = GroupTable::new(&d, key_types, &ops).unwrap();
        assert_eq!(d.counts().launches - before, launches, "{case}: launches");
        let fills_before = fills(&d);
        let batch_keys: Vec<&DeviceColumn> = match key_types.len() {
            0 => vec![],
            _ => vec![&keys],
        };
        let inputs: Vec<AccInput> = ops
            .iter()
            .map(|op| match op {
                AccOp::Count => AccInput {
                    values: None,
                    filter: None,
                },
                _ => input,
            })
            .collect();
        table.update(&batch_keys, &inputs, rows as usize).unwrap();
        assert_eq!(fills(&d), fills_before, "{case}: no slot fill");
        let groups = if key_types.is_empty() { 1 } else { 37 };
        assert_eq!(table.groups(), groups, "{case}: groups");
        if ops.is_empty() {
            continue;
        }
        let read_keys = table.keys().unwrap();
        let group_key = |g: usize| -> i64 {
            match read_keys.first() {
                Some(k) => k.as_any().downcast_ref::<Int64Array>().unwrap().value(g),
                None => -1,
            }
        };
        let sum = table.state(ops.len() - 1).unwrap();
        for (g, &count) in sum.counts.iter().enumerate() {
            let k = group_key(g);
            let (rows, total) = match k {
                -1 => (rows as u64, (0..rows).map(|i| i % 37).sum::<i64>()),
                k => ((0..rows).filter(|i| i % 37 == k).count() as u64, 0),
            };
            assert_eq!(count, rows, "{case}: group {k}'s rows");
            let want = if k == -1 { total } else { k * rows as i64 };
            let got = match &sum.values {
                AccValues::Int(v) => v[g],
                other => panic!("{case}: {other:?}"),
            };
            assert_eq!(got, want, "{case}: group {k}'s sum");
        }
    }
    let many: Int64Array = (0..20_000).map(|i| Some(i * 7)).collect();
    let many = DeviceColumn::upload(&d, &many).unwrap();
    let mut table = GroupTable::new(&d, &int64, &[AccOp::Count]).unwrap();
    let (inserts, rollbacks) = (
        launches_of(&d, Kernel::agg_find_or_insert),
        launches_of(&d, Kernel::agg_rollback),
    );
    let count = AccInput {
        values: None,
        filter: None,
    };
    table.update(&[&many], &[count], 20_000).unwrap();
    assert_eq!(table.groups(), 20_000);
    assert_eq!(
        launches_of(&d, Kernel::agg_find_or_insert) - inserts,
        1,
        "inserted once"
    );
    assert_eq!(
        launches_of(&d, Kernel::agg_rollback),
        rollbacks,
        "nothing undone"
    );
    assert!(table.state(0).unwrap().counts.iter().all(|&c| c == 1));
}

/// A batch that brings new groups waits once: the insert's count of new groups is the
/// count of their leader rows, so the numbering reads nothing back; with a string key, the
/// new keys' byte total (and the count of leaders, checked against the insert's), measured
/// over the insert before its wait, comes up in that wait. A batch after one that brought
/// no new group does not measure them early: one that then brings new string keys measures
/// them in a second wait. The groups, their keys and counts are right either way, over a
/// first batch, a second one with old and new keys mixed, two of old keys and one of new.
#[test]
fn a_batch_of_new_groups_waits_once_even_with_a_string_key() {
    // Counted on an emulated device of the test's own: through the stand-in driver the
    // suite's tests share cuda:0, and the others' queued work changed which of this test's
    // uploads and allocations had to wait (3 waits for 1, in about one run of two).
    let d = emulated();
    let count = AccInput {
        values: None,
        filter: None,
    };
    // Keys 0..499 over and over below 1000, each its own from 1000 on.
    let key = |i: i64| if i < 1000 { i % 500 } else { i };
    let ints = |range: std::ops::Range<i64>| -> DeviceColumn {
        let a: Int64Array = range.map(|i| Some(key(i))).collect();
        DeviceColumn::upload(&d, &a).unwrap()
    };
    let strings = |range: std::ops::Range<i64>| -> DeviceColumn {
        let a: StringArray = range.map(|i| Some(format!("key {}", key(i)))).collect();
        DeviceColumn::upload(&d, &a).unwrap()
    };
    // A first table on this stream sets its scan's look-back state up (once per stream).
    let warm = ints(0..100);
    let mut table = GroupTable::new(&d, &[DataType::Int64], &[AccOp::Count]).unwrap();
    table.update(&[&warm], &[count], 100).unwrap();
    for (case, key_type) in [("integer", DataType::Int64), ("string", DataType::Utf8)] {
        let mut table =
            GroupTable::new(&d, std::slice::from_ref(&key_type), &[AccOp::Count]).unwrap();
        // 300 new groups (keys 0..299), then 100 old and 200 new ones (keys 300..499, 0..99),
        // then old keys only, twice, then 50 new ones (keys 1000..1049).
        for (batch, range, groups) in [
            (1, 0..300, 300),
            (2, 300..600, 500),
            (3, 0..300, 500),
            (4, 100..400, 500),
            (5, 1000..1050, 550),
        ] {
            let keys = match key_type {
                DataType::Utf8 => strings(range.clone()),
                _ => ints(range.clone()),
            };
            let n = (range.end - range.start) as usize;
            let before = d.counts().syncs;
            let kernels_before = d.kernel_counts();
            table.update(&[&keys], &[count], n).unwrap();
            assert_eq!(
                d.counts().syncs - before,
                match (&key_type, batch) {
                    (DataType::Utf8, 5) => 2,
                    _ => 1,
                },
                "{case} keys, batch {batch}: waits"
            );
            // Integer keys rank their leaders in one launch, flags and scan together, which
            // writes the leaders too, and the update resolves each row's group itself;
            // string keys flag them, rank them in the launch that measures and scans the
            // new strings, and resolve the groups in a launch of their own. A batch of old
            // keys only updates, but measures the new strings (for nothing) where the last
            // batch brought new groups.
            let launched = |kernel: Kernel| -> u64 {
                let of = |counts: &[fulmen_kernels::KernelCounts]| -> u64 {
                    counts
                        .iter()
                        .filter(|k| k.kernel == kernel)
                        .map(|k| k.launches)
                        .sum()
                };
                of(&d.kernel_counts()) - of(&kernels_before)
            };
            let ranked = [
                launched(Kernel::agg_leader_ranks),
                launched(Kernel::agg_leader_flags),
                launched(Kernel::scan_lookback),
                launched(Kernel::agg_resolve),
                launched(Kernel::agg_update),
            ];
            let want = match (&key_type, batch) {
                (DataType::Utf8, 1 | 2 | 5) => [0, 1, 0, 1, 1],
                (DataType::Utf8, 3) => [0, 1, 0, 0, 1],
                (_, 1 | 2 | 5) => [1, 0, 0, 0, 1],
                _ => [0, 0, 0, 0, 1],
            };
            assert_eq!(
                ranked, want,
                "{case} keys, batch {batch}: ranks, flags, scans, resolves, updates"
            );
            assert_eq!(table.groups(), groups, "{case} keys, batch {batch}: groups");
        }
        let read = table.keys().unwrap();
        let counts = table.state(0).unwrap().counts;
        let mut seen = vec![0u64; 1050];
        for (g, &c) in counts.iter().enumerate() {
            let k = match key_type {
                DataType::Utf8 => {
                    let s = read[0].as_any().downcast_ref::<StringArray>().unwrap();
                    s.value(g)
                        .trim_start_matches("key ")
                        .parse::<usize>()
                        .unwrap()
                }
                _ => read[0]
                    .as_any()
                    .downcast_ref::<Int64Array>()
                    .unwrap()
                    .value(g) as usize,
            };
            seen[k] += c;
        }
        // Keys 0..299 came in three batches, 300..399 in two, 400..499 and 1000..1049 in one.
        let want: Vec<u64> = (0..1050)
            .map(|k| match k {
                0..300 => 3,
                300..400 => 2,
                400..500 | 1000.. => 1,
                _ => 0,
            })
            .collect();
        assert_eq!(seen, want, "{case} keys: each key's rows");
    }
}
