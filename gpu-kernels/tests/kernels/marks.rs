//! A left semi or anti join's matches marked on the device (`JoinTable::mark`, `JoinMarks`)
//! against a nested loop, and what marking and reading cost.

use arrow::array::*;
use fulmen_kernels::DeviceColumn;
use fulmen_kernels::ops::join::{JoinMarks, JoinTable};

use super::{Lcg, device, emulated};

/// The build rows whose keys (an integer and a string) equal those of one of the probe
/// rows that `mask` lets in (all without it): both non-NULL, or, with `nulls_match` (`IS
/// NOT DISTINCT FROM`), each NULL on both sides or equal.
fn nested_loop(
    build: &(Int64Array, StringArray),
    probe: &(Int64Array, StringArray),
    mask: Option<&[bool]>,
    nulls_match: bool,
) -> Vec<bool> {
    let same = |p: usize, b: usize| {
        let ints = (probe.0.is_valid(p), build.0.is_valid(b));
        let strings = (probe.1.is_valid(p), build.1.is_valid(b));
        let ints = match ints {
            (true, true) => probe.0.value(p) == build.0.value(b),
            (false, false) => nulls_match,
            _ => false,
        };
        let strings = match strings {
            (true, true) => probe.1.value(p) == build.1.value(b),
            (false, false) => nulls_match,
            _ => false,
        };
        ints && strings
    };
    (0..build.0.len())
        .map(|b| (0..probe.0.len()).any(|p| mask.is_none_or(|m| m[p]) && same(p, b)))
        .collect()
}

fn bitmap(d: &fulmen_kernels::Device, v: &[bool]) -> fulmen_kernels::DeviceBuffer {
    let mut bytes = vec![0u8; v.len().div_ceil(8).max(1)];
    for (i, &x) in v.iter().enumerate() {
        if x {
            bytes[i / 8] |= 1 << (i % 8);
        }
    }
    d.upload(&bytes).unwrap()
}

/// Marks accumulate over probes (with and without a row mask; NULL keys matching nothing,
/// or, `IS NOT DISTINCT FROM`, each other), equal to a nested loop's matched build rows;
/// cleared, none is marked.
#[test]
fn marks_are_the_build_rows_a_nested_loop_matches() {
    let d = device();
    let mut r = Lcg(29);
    let shapes = [
        (1, 5, 2),
        (31, 40, 5),
        (33, 200, 50),
        (300, 500, 400),
        (2000, 3000, 100_000),
        (1500, 40, 1),
    ];
    for (k, (n_build, n_probe, distinct)) in shapes.into_iter().enumerate() {
        let nulls_match = k % 2 == 1;
        let mut keys = |n: usize| -> (Int64Array, StringArray) {
            (
                (0..n)
                    .map(|_| (!r.chance(10)).then(|| (r.next() % distinct) as i64))
                    .collect(),
                (0..n)
                    .map(|_| (!r.chance(5)).then(|| ["x", "yy", ""][r.next() as usize % 3]))
                    .collect(),
            )
        };
        let build = keys(n_build);
        let (first, second) = (keys(n_probe), keys(n_probe));
        let up = |a: &dyn Array| DeviceColumn::upload(&d, a).unwrap();
        let table = JoinTable::build(
            &d,
            vec![up(&build.0), up(&build.1)],
            None,
            n_build,
            nulls_match,
        )
        .unwrap();
        let marks = JoinMarks::new(&table).unwrap();
        let mask: Vec<bool> = (0..n_probe).map(|_| r.chance(60)).collect();
        let (a1, a2) = (up(&first.0), up(&first.1));
        table.mark(&[&a1, &a2], None, n_probe, &marks).unwrap();
        let (b1, b2) = (up(&second.0), up(&second.1));
        table
            .mark(&[&b1, &b2], Some(&bitmap(&d, &mask)), n_probe, &marks)
            .unwrap();
        let want: Vec<bool> = (nested_loop(&build, &first, None, nulls_match).into_iter())
            .zip(nested_loop(&build, &second, Some(&mask), nulls_match))
            .map(|(x, y)| x || y)
            .collect();
        let got = marks.read(&[]).unwrap().unwrap();
        assert_eq!(
            got, want,
            "{n_build} build rows, {n_probe} probe rows, NULLs match: {nulls_match}"
        );
        marks.clear().unwrap();
        let none = marks.read(&[]).unwrap().unwrap();
        assert!(none.iter().all(|&m| !m), "cleared");
    }
}

/// Marking a probe is one launch and no wait; reading the marks with the status words of
/// the programs that masked the probes is one wait, and a set error word voids the marks.
#[test]
fn marking_queues_one_launch_and_the_read_waits_once() {
    // Counted on an emulated device of the test's own (the CUDA test device is shared).
    let d = emulated();
    let build: Int64Array = (0..5000).map(Some).collect();
    let probe: Int64Array = (0..4000).map(|i| Some(i * 3)).collect();
    let table = JoinTable::build(
        &d,
        vec![DeviceColumn::upload(&d, &build).unwrap()],
        None,
        5000,
        false,
    )
    .unwrap();
    let marks = JoinMarks::new(&table).unwrap();
    let keys = DeviceColumn::upload(&d, &probe).unwrap();
    let before = d.counts();
    table.mark(&[&keys], None, 4000, &marks).unwrap();
    let after = d.counts();
    assert_eq!(after.launches - before.launches, 1, "one launch");
    assert_eq!(after.syncs - before.syncs, 0, "no wait");
    let clear = d.upload(&[0u8; 16]).unwrap();
    let mut failed = [0u8; 16];
    failed[8] = 1;
    let failed = d.upload(&failed).unwrap();
    let before = d.counts();
    let got = marks.read(&[&clear, &clear]).unwrap().unwrap();
    assert_eq!(d.counts().syncs - before.syncs, 1, "one wait");
    let want: Vec<bool> = (0..5000).map(|b| b % 3 == 0 && b < 12000).collect();
    assert_eq!(got, want);
    assert_eq!(
        marks.read(&[&clear, &failed]).unwrap(),
        None,
        "a failed program"
    );
    // Marks of another table are refused.
    let other = JoinTable::build(
        &d,
        vec![DeviceColumn::upload(&d, &probe).unwrap()],
        None,
        4000,
        false,
    )
    .unwrap();
    assert!(other.mark(&[&keys], None, 4000, &marks).is_err());
}
