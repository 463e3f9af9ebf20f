//! A device's streams: work on one runs in its own order, work that uses a buffer made on
//! another is made to wait for that stream first, on the device (a counted stream wait, only
//! while it may still run and was not waited for as far), and a block let go on one stream
//! goes to another only once the host has waited past it.

use fulmen_kernels::ops::scan;

use super::*;

/// u64 values as bytes.
fn words(values: &[u64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A copy and a launch on one stream of buffers another stream is still filling see what
/// that stream wrote (the emulated device runs a stream's queue only when it is waited
/// for: without the wait they would read the pool's fill pattern).
#[test]
fn work_on_one_stream_waits_for_the_stream_that_made_its_input() {
    for d in [device(), emulated()] {
        let (a, b) = (d.on_stream(1), d.on_stream(2));
        assert_eq!((a.stream_index(), b.stream_index()), (1, 2));
        assert_eq!(a, b, "two streams of one device are the one device");
        let values: Vec<u64> = (1..=5000).collect();
        let made_on_a = a.upload(&words(&values)).unwrap();
        let copied = b.alloc(made_on_a.len()).unwrap();
        b.copy(&copied, &made_on_a).unwrap();
        assert!(
            copied.to_host().unwrap() == words(&values),
            "the copy sees a's upload"
        );

        let more: Vec<u64> = (0..3000).map(|i| i * 7 % 11).collect();
        let input = a.upload(&words(&more)).unwrap();
        let (offsets, total) = scan::exclusive_scan(&b, &input, more.len()).unwrap();
        let mut want = Vec::with_capacity(more.len());
        let mut sum = 0;
        for v in &more {
            want.push(sum);
            sum += v;
        }
        assert_eq!(total, sum);
        assert!(
            offsets.to_host().unwrap() == words(&want),
            "the scan sees a's upload"
        );
    }
}

/// The waits between streams are counted, on the device (the host does not wait): one for
/// what the other stream queued so far, none again for the same work, nor once the host
/// has passed it; a read waits (on the host) for its own stream only.
#[test]
fn a_stream_waits_for_another_once_and_only_while_it_may_still_run() {
    let d = emulated();
    let (a, b) = (d.on_stream(1), d.on_stream(2));
    let on_a = a.upload(&[3u8; 4096]).unwrap();
    let on_b = b.upload(&[4u8; 4096]).unwrap();
    let start = d.counts();
    let since = |what: &str, syncs: u64, waits: u64| {
        let c = d.counts();
        assert_eq!(
            (c.syncs - start.syncs, c.stream_waits - start.stream_waits),
            (syncs, waits),
            "{what}: host syncs and stream waits"
        );
    };
    assert_eq!(on_b.to_host().unwrap(), vec![4u8; 4096]);
    since("b's read waits for b alone", 1, 0);
    let first = b.alloc(4096).unwrap();
    b.copy(&first, &on_a).unwrap();
    since("a copy of a's buffer makes b wait for a", 1, 1);
    let second = b.alloc(4096).unwrap();
    b.copy(&second, &on_a).unwrap();
    since("b waits for a's upload already: no second wait", 1, 1);
    let more = a.upload(&[5u8; 4096]).unwrap();
    let third = b.alloc(4096).unwrap();
    b.copy(&third, &more).unwrap();
    since("a queued more: b waits again", 1, 2);
    a.synchronize().unwrap();
    let fourth = b.alloc(4096).unwrap();
    b.copy(&fourth, &more).unwrap();
    since("the host has passed a: no wait", 2, 2);
    assert_eq!(second.to_host().unwrap(), vec![3u8; 4096]);
    assert_eq!(first.to_host().unwrap(), vec![3u8; 4096]);
    assert_eq!(third.to_host().unwrap(), vec![5u8; 4096]);
    assert_eq!(fourth.to_host().unwrap(), vec![5u8; 4096]);
    assert_eq!(d.streams(), 3, "streams 0, 1 and 2");
}

/// A block let go while its stream still has work queued on it is reused at once on that
/// stream, and on another only once the host has waited for the first.
#[test]
fn a_block_goes_to_another_stream_only_once_its_stream_has_passed_it() {
    let d = emulated();
    let (a, b) = (d.on_stream(1), d.on_stream(2));
    let held = a.alloc(4096).unwrap();
    held.write(0, &[9u8; 4096]).unwrap();
    let addr = held.addr();
    drop(held);
    let other = b.alloc(4096).unwrap();
    assert_ne!(other.addr(), addr, "a's write may still be running");
    let same = a.alloc(4096).unwrap();
    assert_eq!(same.addr(), addr, "a's own work is queued before a's next");
    same.write(0, &[1u8; 4096]).unwrap();
    drop(same);
    a.synchronize().unwrap();
    let after = b.alloc(4096).unwrap();
    assert_eq!(after.addr(), addr, "a has passed it");
    after.write(0, &[2u8; 4096]).unwrap();
    assert_eq!(after.to_host().unwrap(), vec![2u8; 4096]);
    drop(other);
}

/// Inside `in_stream`, work through any handle goes on the scope's stream, and a buffer
/// made there carries it: a read through a handle on another stream waits for it.
#[test]
fn work_in_a_stream_scope_goes_on_the_scopes_stream() {
    let d = emulated();
    let values: Vec<u64> = (0..4096).map(|i| i * 3).collect();
    let made = fulmen_kernels::device::in_stream(5, || {
        let buffer = d.upload(&words(&values)).unwrap();
        assert_eq!(buffer.stream(), 5, "made on the scope's stream");
        let inner = fulmen_kernels::device::in_stream(6, || d.alloc(8).unwrap());
        assert_eq!(inner.stream(), 6, "the innermost scope wins");
        assert_eq!(
            d.alloc(8).unwrap().stream(),
            5,
            "and the outer one is back after it"
        );
        buffer
    });
    assert_eq!(d.stream_index(), 0, "the handle keeps its own stream");
    let before = d.counts();
    assert!(
        made.to_host().unwrap() == words(&values),
        "the read sees the upload"
    );
    let c = d.counts();
    assert_eq!(
        (c.stream_waits - before.stream_waits, c.syncs - before.syncs),
        (1, 1),
        "stream 0 waits for stream 5 on the device, then the host for stream 0"
    );
}

/// Kernels that read key columns only through a table of their descriptors (a join's
/// build and probe, which hash the keys there, and a group table's find-or-insert) wait
/// for the stream that made those columns: each key column is made by a gather still
/// queued on stream 1 and read in stream 2's scope, as a CollectLeft build side made on the
/// shared stream is read by a partition's. Without the wait stream 2 would run its work
/// first (the emulated device runs a queue when it is waited for) over the pool's fill
/// pattern: a table of wrong keys, no match, wrong groups.
#[test]
fn kernels_reading_keys_through_descriptors_wait_for_the_stream_that_made_them() {
    use fulmen_kernels::device::in_stream;
    use fulmen_kernels::ops::aggregate::{AccInput, AccOp, GroupTable};
    use fulmen_kernels::ops::join::JoinTable;
    use fulmen_kernels::ops::{RowIndices, gather};
    for d in [device(), emulated()] {
        // Uploaded and done, then gathered whole by a kernel left queued on stream 1.
        let on_stream_1 = |values: &Int64Array| {
            in_stream(1, || {
                let uploaded = DeviceColumn::upload(&d, values).unwrap();
                let rows: Vec<u32> = (0..values.len() as u32).collect();
                let all = RowIndices::upload(&d, &rows, values.len()).unwrap();
                d.synchronize().unwrap();
                gather::gather_column(&uploaded, &all).unwrap()
            })
        };
        let build: Int64Array = (0..2000).map(|i| Some(i * 3)).collect();
        let probe: Int64Array = (0..3000).map(Some).collect();
        let keys: Int64Array = (0..5000).map(|i| Some(i % 7)).collect();
        let build_keys = on_stream_1(&build);
        let table = in_stream(2, || {
            let table = JoinTable::build(&d, vec![build_keys], None, build.len(), false);
            d.synchronize().unwrap();
            table.unwrap()
        });
        let probe_keys = on_stream_1(&probe);
        let matches = in_stream(2, || table.probe(&[&probe_keys], None, probe.len())).unwrap();
        let want: Vec<u32> = (0..1000).collect();
        assert_eq!(matches.build, want, "{d}: the build rows matched");
        let want: Vec<u32> = (0..1000).map(|i| i * 3).collect();
        assert_eq!(matches.probe, want, "{d}: the probe rows matched");

        let keys = on_stream_1(&keys);
        in_stream(2, || {
            let mut groups = GroupTable::new(&d, &[DataType::Int64], &[AccOp::Count]).unwrap();
            let count = AccInput {
                values: None,
                filter: None,
            };
            groups.update(&[&keys], &[count], 5000).unwrap();
            assert_eq!(groups.groups(), 7, "{d}: groups");
            let counts = groups.state(0).unwrap().counts;
            assert!(
                counts.iter().all(|&c| c == 714 || c == 715),
                "{d}: {counts:?}"
            );
        });
    }
}
