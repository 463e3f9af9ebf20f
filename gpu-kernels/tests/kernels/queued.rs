//! String gathers queued before the host knows how many rows they gather: their lengths
//! run over a selection's or a join probe's pending indices, their byte totals come up in
//! the same wait as the count, and the copies follow without another.

use fulmen_kernels::ops::join::JoinTable;
use fulmen_kernels::ops::{Word, read_status_words, status_bytes};

use super::*;

/// A selection's count and the byte totals of a `Utf8` and a `LargeUtf8` column gathered by
/// it come up in one wait; the gathers then wait for nothing and give what Arrow's filter
/// gives, NULLs and empty strings included, at every awkward size and selectivity (the
/// waits counted on an emulated device of the test's own: the CUDA test device is shared
/// by every test).
#[test]
fn string_gathers_over_a_queued_selection_wait_with_its_count() {
    selection_strings(&device(), false);
    selection_strings(&emulated(), true);
}

fn selection_strings(d: &Device, count_waits: bool) {
    let d = d.clone();
    let waits = |since: u64, want: u64, what: &str| {
        if count_waits {
            assert_eq!(d.counts().syncs - since, want, "{what}");
        }
    };
    let mut zeroed = false;
    for &n in SIZES {
        for (keep, nulls) in [(50, 10), (0, 0), (100, 0), (3, 40)] {
            let seed = n as u64 * 13 + keep;
            let columns = random_columns(n, seed, 15);
            let strings = [&columns[11], &columns[12]];
            let on_device: Vec<DeviceColumn> = strings
                .iter()
                .map(|c| DeviceColumn::upload(&d, c.as_ref()).unwrap())
                .collect();
            let predicate = selection(n, seed ^ 0x5EED, keep, nulls);
            let p = DeviceColumn::upload(&d, &predicate).unwrap();
            let status = d.upload(&vec![0; status_bytes(2)]).unwrap();
            let before = d.counts().syncs;
            let queued =
                compact::selection_indices_queued(&d, p.values(), p.validity(), n, &status)
                    .unwrap();
            let launches = d.counts().launches;
            let both: Vec<&DeviceColumn> = on_device.iter().collect();
            let starts = gather::queue_strings_starts(
                &both,
                queued.pending(&status).unwrap(),
                Word::of(&status, 2).unwrap(),
            )
            .unwrap();
            if count_waits && n > 0 {
                // One launch each (two offset widths), lengths and scan together (the
                // first of more than one tile a column zeroes the stream's look-back state
                // first).
                let zeroing = n > scan::TILE as usize && !std::mem::replace(&mut zeroed, true);
                assert_eq!(
                    d.counts().launches - launches,
                    2 + u64::from(zeroing),
                    "n={n}"
                );
            }
            waits(before, 0, "queueing waits for nothing");
            let (count, totals) = read_status_words(&status, 2).unwrap().unwrap();
            let indices = queued.with_count(count).unwrap();
            let gathered: Vec<DeviceColumn> = on_device
                .iter()
                .zip(starts)
                .zip(&totals)
                .map(|((c, s), &total)| {
                    gather::gather_column_started(c, &indices, s, total).unwrap()
                })
                .collect();
            waits(
                before,
                1,
                "one wait for the count and both byte totals, none for the gathers",
            );
            for ((got, want), total) in gathered.iter().zip(strings).zip(&totals) {
                let want = filter(want.as_ref(), &predicate).unwrap();
                let got = got.to_arrow().unwrap();
                assert_eq!(
                    got.as_ref(),
                    want.as_ref(),
                    "n={n} keep={keep}% nulls={nulls}%"
                );
                let bytes: usize = match want.data_type() {
                    DataType::Utf8 => want.as_string::<i32>().iter().flatten().map(str::len).sum(),
                    _ => want.as_string::<i64>().iter().flatten().map(str::len).sum(),
                };
                assert_eq!(*total, bytes as u64, "the byte total of the kept strings");
            }
        }
    }
}

/// Many string columns gathered over one queued selection measure and scan their strings
/// in one launch per four consecutive columns of one offset width and copy them in one
/// launch per four of one width (six `Utf8` columns and a `LargeUtf8` one: three launches
/// each, for four, two and one), and each gives what Arrow's filter gives, its byte total read with
/// the count in one wait.
#[test]
fn string_columns_queued_together_share_their_lengths_launches() {
    for (d, count) in [(device(), false), (emulated(), true)] {
        let mut zeroed = false;
        for n in [0, 1, 700, 5000] {
            let mut strings: Vec<ArrayRef> = (0..6)
                .map(|k| random_columns(n, 40 + k, 20)[11].clone())
                .collect();
            strings.push(random_columns(n, 47, 20)[12].clone());
            let on_device: Vec<DeviceColumn> = strings
                .iter()
                .map(|c| DeviceColumn::upload(&d, c.as_ref()).unwrap())
                .collect();
            let predicate = selection(n, 9, 60, 10);
            let p = DeviceColumn::upload(&d, &predicate).unwrap();
            let status = d.upload(&vec![0; status_bytes(strings.len())]).unwrap();
            let queued =
                compact::selection_indices_queued(&d, p.values(), p.validity(), n, &status)
                    .unwrap();
            let (launches, syncs) = (d.counts().launches, d.counts().syncs);
            let all: Vec<&DeviceColumn> = on_device.iter().collect();
            let starts = gather::queue_strings_starts(
                &all,
                queued.pending(&status).unwrap(),
                Word::of(&status, 2).unwrap(),
            )
            .unwrap();
            if count && n > 0 {
                // The first scan of more than one tile on the stream zeroes its look-back
                // state first.
                let zeroing = n > scan::TILE as usize && !std::mem::replace(&mut zeroed, true);
                assert_eq!(
                    d.counts().launches - launches,
                    3 + u64::from(zeroing),
                    "n={n}: three launches, each measuring and scanning its columns"
                );
            }
            let (kept, totals) = read_status_words(&status, strings.len()).unwrap().unwrap();
            let indices = queued.with_count(kept).unwrap();
            let copies = |d: &Device| -> u64 {
                d.kernel_counts()
                    .iter()
                    .filter(|k| k.kernel.name().starts_with("gather_string_copy"))
                    .map(|k| k.launches)
                    .sum()
            };
            let copied = copies(&d);
            let started = starts
                .into_iter()
                .zip(&totals)
                .map(|(s, &total)| Some((s, total)))
                .collect();
            let gathered = gather::gather_columns_started(&all, &indices, started).unwrap();
            if count && kept > 0 {
                assert_eq!(
                    copies(&d) - copied,
                    3,
                    "n={n}: the copies of four, two and one"
                );
            }
            for (got, want) in gathered.iter().zip(&strings) {
                let got = got.to_arrow().unwrap();
                let want = filter(want.as_ref(), &predicate).unwrap();
                assert_eq!(got.as_ref(), want.as_ref(), "n={n}");
            }
            if count {
                // The count and the totals, then a read of each gathered column.
                assert!(d.counts().syncs - syncs >= 1, "n={n}");
            }
        }
    }
}

/// Starts queued for one string column (of those queued together).
fn queue_one(
    column: &DeviceColumn,
    indices: fulmen_kernels::ops::PendingIndices<'_>,
    total_to: Word<'_>,
) -> fulmen_kernels::Result<gather::QueuedStarts> {
    gather::queue_strings_starts(&[column], indices, total_to).map(|mut one| one.remove(0))
}

/// Starts queued for one column or index list are refused for another, and a selection's
/// pending indices are refused with another status buffer than the one its count goes to;
/// columns queued together need a word each.
#[test]
fn queued_string_starts_are_only_used_where_they_were_queued() {
    let d = device();
    let n = 500;
    let columns = random_columns(n, 3, 10);
    let a = DeviceColumn::upload(&d, columns[11].as_ref()).unwrap();
    let b = DeviceColumn::upload(&d, columns[11].as_ref()).unwrap();
    let numbers = DeviceColumn::upload(&d, columns[3].as_ref()).unwrap();
    let p = DeviceColumn::upload(&d, &selection(n, 4, 50, 0)).unwrap();
    let status = d.upload(&vec![0; status_bytes(1)]).unwrap();
    let other = d.upload(&vec![0; status_bytes(1)]).unwrap();
    let queued =
        compact::selection_indices_queued(&d, p.values(), p.validity(), n, &status).unwrap();
    assert!(queued.pending(&other).is_err());
    let word = Word::of(&status, 2).unwrap();
    assert!(Word::of(&status, 3).is_err(), "a word past the buffer");
    assert!(queue_one(&numbers, queued.pending(&status).unwrap(), word).is_err());
    let two = gather::queue_strings_starts(&[&a, &b], queued.pending(&status).unwrap(), word);
    assert!(
        two.is_err(),
        "two columns' totals in a buffer with one word for them"
    );
    let starts = queue_one(&a, queued.pending(&status).unwrap(), word).unwrap();
    let (count, totals) = read_status_words(&status, 1).unwrap().unwrap();
    let indices = queued.with_count(count).unwrap();
    let err = gather::gather_column_started(&b, &indices, starts, totals[0]).unwrap_err();
    assert!(err.to_string().contains("another column"), "{err}");
    // Starts over the selection's indices are refused for other indices.
    let again = compact::selection_indices_queued(&d, p.values(), p.validity(), n, &other).unwrap();
    let starts = queue_one(
        &a,
        again.pending(&other).unwrap(),
        Word::of(&other, 2).unwrap(),
    )
    .unwrap();
    let (_, totals) = read_status_words(&other, 1).unwrap().unwrap();
    let other_indices = RowIndices::upload(&d, &[1, 2, 3], n).unwrap();
    let err = gather::gather_column_started(&a, &other_indices, starts, totals[0]).unwrap_err();
    assert!(err.to_string().contains("other indices"), "{err}");
}

/// A join probe's match count and the byte totals of string columns gathered from both
/// sides come up in one wait, and the gathers give Arrow's `take` at the matched rows; a
/// probe whose candidates overflowed its guess runs again with exact sizes and says the
/// work queued over its pending matches counts for nothing (waits counted as above).
#[test]
fn string_gathers_over_a_queued_join_probe_wait_with_its_totals() {
    probe_strings(&device(), false);
    probe_strings(&emulated(), true);
}

fn probe_strings(d: &Device, count_waits: bool) {
    let d = d.clone();
    let waits = |since: u64, want: u64, what: &str| {
        if count_waits {
            assert_eq!(d.counts().syncs - since, want, "{what}");
        }
    };
    // 3000 build rows, each key 30 times; 2000 probe rows, two in three matching.
    let build: Int64Array = (0..3000).map(|i| Some(i % 100)).collect();
    let probe: Int64Array = (0..2000).map(|i| Some(i * 7 % 150)).collect();
    let build_strings = random_columns(3000, 21, 10).swap_remove(11);
    let probe_strings = random_columns(2000, 22, 10).swap_remove(12);
    let up = |a: &dyn Array| DeviceColumn::upload(&d, a).unwrap();
    let table = JoinTable::build(&d, vec![up(&build)], None, 3000, false).unwrap();
    let keys = up(&probe);
    let (bs, ps) = (up(build_strings.as_ref()), up(probe_strings.as_ref()));
    let want_pairs = (0..2000).filter(|&p| probe.value(p) < 100).count() * 30;
    for round in 0..2 {
        let before = d.counts().syncs;
        let queued = table
            .probe_queued(&[&keys], None, 2000, 2)
            .unwrap()
            .unwrap();
        let build_starts =
            queue_one(&bs, queued.pending_build(), queued.extra_word(0).unwrap()).unwrap();
        let probe_starts =
            queue_one(&ps, queued.pending_probe(), queued.extra_word(1).unwrap()).unwrap();
        assert!(queued.extra_word(2).is_err());
        waits(before, 0, "queueing waits for nothing");
        let probed = queued.finish().unwrap();
        let (build_rows, probe_rows) = probed.pairs.unwrap();
        assert_eq!(build_rows.len(), want_pairs);
        let (got_build, got_probe) = match probed.words {
            None => {
                assert_eq!(round, 0, "only the first probe outgrows its guess");
                (
                    gather::gather_column(&bs, &build_rows).unwrap(),
                    gather::gather_column(&ps, &probe_rows).unwrap(),
                )
            }
            Some(totals) => {
                assert_eq!(round, 1, "the first probe outgrew its guess");
                let got = (
                    gather::gather_column_started(&bs, &build_rows, build_starts, totals[0])
                        .unwrap(),
                    gather::gather_column_started(&ps, &probe_rows, probe_starts, totals[1])
                        .unwrap(),
                );
                waits(
                    before,
                    1,
                    "one wait for the probe's totals and both byte totals",
                );
                got
            }
        };
        let rows = |r: &RowIndices| UInt32Array::from(r.to_host().unwrap());
        let want_build = take(build_strings.as_ref(), &rows(&build_rows), None).unwrap();
        let want_probe = take(probe_strings.as_ref(), &rows(&probe_rows), None).unwrap();
        assert_eq!(got_build.to_arrow().unwrap().as_ref(), want_build.as_ref());
        assert_eq!(got_probe.to_arrow().unwrap().as_ref(), want_probe.as_ref());
    }
}

/// A probe queued over the caller's totals, whose first caller word is the error word of
/// work queued before it (a fused filter's program), stops in its one wait when that word
/// is set, without running again for the matches that overflowed its guess; with the word
/// clear it runs again and gives every match.
#[test]
fn a_probe_whose_error_word_is_set_stops_in_its_one_wait() {
    let d = emulated();
    // 3000 build rows, each key 30 times; 2000 probe rows, two in three matching: a fresh
    // table's first guess (about one match a row) overflows.
    let build: Int64Array = (0..3000).map(|i| Some(i % 100)).collect();
    let probe: Int64Array = (0..2000).map(|i| Some(i * 7 % 150)).collect();
    let up = |a: &dyn Array| DeviceColumn::upload(&d, a).unwrap();
    let keys = up(&probe);
    let want_pairs = (0..2000).filter(|&p| probe.value(p) < 100).count() * 30;
    for failed in [true, false] {
        let table = JoinTable::build(&d, vec![up(&build)], None, 3000, false).unwrap();
        let mut words = vec![0u8; 16];
        words[8] = u8::from(failed);
        let totals = d.upload(&words).unwrap();
        let before = d.counts().syncs;
        let queued = table
            .probe_queued_into(&[&keys], None, 2000, 1, Some(totals))
            .unwrap()
            .unwrap();
        let probed = queued.finish_unless_failed().unwrap();
        let waits = d.counts().syncs - before;
        match probed {
            None => {
                assert!(failed);
                assert_eq!(waits, 1, "one wait, no exact-size rerun");
            }
            Some(probed) => {
                assert!(!failed);
                assert!(probed.words.is_none(), "the guess was outgrown");
                assert!(waits > 1, "the probe ran again with exact sizes");
                assert_eq!(probed.pairs.unwrap().0.len(), want_pairs);
            }
        }
    }
}

/// A probe bringing its pairs to the host (`QueuedProbe::pairs_to_host`, a join whose
/// output goes to the host) gives a nested loop's pairs, in probe order and within a probe
/// row in build order, and reads them in the wait that reads its total once the table has
/// seen a probe at about its rate of matches: a fresh table's first probe, outgrowing its
/// outputs, runs again; a probe finding more than the last one's rate predicts reads the
/// rest in a second wait; one finding fewer reads the guess whole. On the test device
/// (the waits counted on an emulated device of the test's own).
#[test]
fn a_probe_brings_its_pairs_to_the_host_in_its_one_wait() {
    probe_pairs_to_host(&device(), false);
    probe_pairs_to_host(&emulated(), true);
}

fn probe_pairs_to_host(d: &Device, count_waits: bool) {
    // 3000 build rows, each key 30 times (some NULL), against 2000 probe rows.
    let build: Int64Array = (0..3000)
        .map(|i| (i % 97 != 5).then_some(i % 100))
        .collect();
    let table = JoinTable::build(
        d,
        vec![DeviceColumn::upload(d, &build).unwrap()],
        None,
        3000,
        false,
    )
    .unwrap();
    // Probes matching about 2 rows in 3, 2 in 3 again, 1 in 3, 2 in 3, none.
    let modulus = [150, 150, 300, 150, 1];
    let offset = [0, 0, 0, 0, 1000];
    for (round, (&m, &o)) in modulus.iter().zip(&offset).enumerate() {
        let probe: Int64Array = (0..2000)
            .map(|i| (i % 61 != 7).then_some(i * 7 % m + o))
            .collect();
        let (mut want_build, mut want_probe) = (Vec::new(), Vec::new());
        for p in 0..2000 {
            for b in 0..3000 {
                if probe.is_valid(p) && build.is_valid(b) && probe.value(p) == build.value(b) {
                    want_build.push(b as u32);
                    want_probe.push(p as u32);
                }
            }
        }
        let keys = DeviceColumn::upload(d, &probe).unwrap();
        let before = d.counts();
        let matches = table
            .probe_queued(&[&keys], None, 2000, 0)
            .unwrap()
            .map(|q| q.pairs_to_host().unwrap())
            .unwrap();
        let after = d.counts();
        assert_eq!(matches.probe, want_probe, "round {round}");
        assert_eq!(matches.build, want_build, "round {round}");
        if !count_waits {
            continue;
        }
        let waits = after.syncs - before.syncs;
        let read = (after.d2h_bytes - before.d2h_bytes) as usize;
        match round {
            0 => assert!(waits > 2, "a fresh table's first probe runs again: {waits}"),
            1 | 2 | 4 => assert_eq!(waits, 1, "round {round}: the total and the pairs together"),
            _ => assert_eq!(waits, 2, "more than the last rate predicts: the rest apart"),
        }
        assert!(read >= 8 + want_probe.len() * 8, "round {round}: {read}");
        if round == 2 {
            // The guess, at the last probe's rate, over-reads what this one found.
            assert!(read > 8 + want_probe.len() * 8 * 3 / 2, "{read}");
        }
    }
    // Fresh tables over unique keys: a first probe guesses one match per probe row, up to
    // the pairs PCIe copies in a quarter of a wait's time (17 187), so 2000 rows matching
    // 2 in 3 take one wait and 30 000 rows matching 12 in 13 read the rest in a second.
    for (n, modulus, waits) in [(2000, 3000, 1), (30_000, 30_000, 2)] {
        let build: Int64Array = (0..n as i64).collect();
        let fresh = JoinTable::build(
            d,
            vec![DeviceColumn::upload(d, &build).unwrap()],
            None,
            n,
            false,
        )
        .unwrap();
        let keys: Int64Array = (0..n as i64)
            .map(|i| (i % 13 != 4).then_some(i * 7 % modulus))
            .collect();
        let (mut want_build, mut want_probe) = (Vec::new(), Vec::new());
        for (p, key) in keys.iter().enumerate() {
            if let Some(k) = key.filter(|&k| k < n as i64) {
                want_build.push(k as u32);
                want_probe.push(p as u32);
            }
        }
        let keys = DeviceColumn::upload(d, &keys).unwrap();
        let before = d.counts();
        let matches = fresh
            .probe_queued(&[&keys], None, n, 0)
            .unwrap()
            .map(|q| q.pairs_to_host().unwrap())
            .unwrap();
        assert_eq!(matches.probe, want_probe, "{n}");
        assert_eq!(matches.build, want_build, "{n}");
        if count_waits {
            let after = d.counts();
            assert_eq!(
                after.syncs - before.syncs,
                waits,
                "a first probe of {n} rows"
            );
            let read = (after.d2h_bytes - before.d2h_bytes) as usize;
            let guess = (n + n / 64 + 256).min(17_187);
            assert!(read <= 8 + guess.max(want_probe.len()) * 8, "{read}");
        }
    }
    // A set error word (a fused filter's program leaving a row to the CPU): no pairs, in
    // the one wait.
    let probe: Int64Array = (0..2000).map(|i| Some(i * 7 % 150)).collect();
    let keys = DeviceColumn::upload(d, &probe).unwrap();
    let mut words = vec![0u8; 16];
    words[8] = 1;
    let before = d.counts().syncs;
    let queued =
        (table.probe_queued_into(&[&keys], None, 2000, 1, Some(d.upload(&words).unwrap())))
            .unwrap()
            .unwrap();
    assert!(queued.pairs_to_host_unless_failed().unwrap().is_none());
    if count_waits {
        assert_eq!(d.counts().syncs - before, 1);
    }
    let queued = table
        .probe_queued(&[&keys], None, 2000, 0)
        .unwrap()
        .unwrap();
    assert!(
        queued.pairs_to_host_unless_failed().is_err(),
        "no error word to read"
    );
    // Pairs left on the device, their probe rows read in the probe's wait too (a join
    // taking a host batch's matched rows there): none past the last probe's rate (no match
    // at all, above), then, at the rate of a probe like it, the same rows in one wait.
    let mut queued = table
        .probe_queued(&[&keys], None, 2000, 0)
        .unwrap()
        .unwrap();
    queued.read_probe_rows_too();
    assert!(
        queued.finish().unwrap().probe_rows.is_none(),
        "past the guess"
    );
    let mut queued = table
        .probe_queued(&[&keys], None, 2000, 0)
        .unwrap()
        .unwrap();
    queued.read_probe_rows_too();
    let before = d.counts().syncs;
    let probed = queued.finish().unwrap();
    if count_waits {
        assert_eq!(
            d.counts().syncs - before,
            1,
            "the total and the probe rows together"
        );
    }
    let (_, probe_rows) = probed.pairs.unwrap();
    let read = probed
        .probe_rows
        .expect("the probe rows, read with the total");
    assert_eq!(read, probe_rows.to_host().unwrap());
    assert!(!read.is_empty());
}

/// A join's pairs and the probe columns they index come down in one wait (what a join whose
/// output goes to the host takes there), equal to reading them apart.
#[test]
fn index_lists_and_columns_come_down_in_one_wait() {
    let d = emulated();
    let n = 5000;
    let columns = random_columns(n, 42, 15);
    let on_device: Vec<DeviceColumn> = columns
        .iter()
        .map(|c| DeviceColumn::upload(&d, c.as_ref()).unwrap())
        .collect();
    let refs: Vec<&DeviceColumn> = on_device.iter().collect();
    let a: Vec<u32> = (0..3000).map(|i| (i * 7 % n) as u32).collect();
    let b: Vec<u32> = (0..3000).map(|i| (i * 13 % n) as u32).collect();
    let (a_dev, b_dev) = (
        RowIndices::upload(&d, &a, n).unwrap(),
        RowIndices::upload(&d, &b, n).unwrap(),
    );
    let before = d.counts().syncs;
    let (lists, arrays) = RowIndices::all_to_host_with(&[&a_dev, &b_dev], &refs).unwrap();
    assert_eq!(d.counts().syncs - before, 1, "one wait");
    assert_eq!(lists, vec![a, b]);
    for (array, column) in arrays.iter().zip(&columns) {
        assert_eq!(array.as_ref(), column.as_ref(), "{}", column.data_type());
    }
}
