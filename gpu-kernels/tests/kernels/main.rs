//! Every kernel on the device chosen by `FULMEN_TEST_DEVICE` (`emulated`, the default;
//! `cuda` on a GPU machine), checked against arrow-rs compute on random data with nulls and
//! awkward sizes; the emulator's own guarantees; and every kernel compiled with NVRTC.

use std::sync::Arc;

use arrow::array::*;
use arrow::compute::{filter, take};
use arrow::datatypes::*;
use fulmen_kernels::ops::{
    NULL_INDEX, RowIndices, Word, compact, gather, hash, hash_table, scan, selftest,
};
use fulmen_kernels::{Device, DeviceColumn, EmulatorOptions, FaultPlan, Kernel, KernelError};
use proptest::prelude::*;

mod aggregate;
mod concat;
mod dictionary;
mod marks;
mod queued;
mod standin;
mod streams;

/// Sizes that trip kernels up: empty, one, around a warp, around a block, many blocks.
const SIZES: &[usize] = &[
    0, 1, 31, 32, 33, 255, 256, 257, 1023, 1024, 1025, 5000, 70_001,
];

/// The device the kernel tests run on: `FULMEN_TEST_DEVICE=cuda` runs them on GPU 0 (and
/// fails if it cannot be opened: never a silent fall back to the emulator).
fn device() -> Device {
    match std::env::var("FULMEN_TEST_DEVICE").as_deref() {
        Ok("cuda") => {
            Device::cuda(0, None).unwrap_or_else(|e| panic!("FULMEN_TEST_DEVICE=cuda: {e}"))
        }
        Ok("emulated") | Err(_) => emulated(),
        Ok(other) => panic!("FULMEN_TEST_DEVICE={other}: expected emulated or cuda"),
    }
}

/// Tests of the emulator's own guarantees (races exposed, guard zones, divergent barriers,
/// injected faults) always run on it: on a GPU they would hang or corrupt memory.
fn emulated() -> Device {
    Device::emulated(0, &EmulatorOptions::default())
}

#[test]
fn the_test_device_is_the_one_asked_for() {
    let d = device();
    let kind = match std::env::var("FULMEN_TEST_DEVICE").as_deref() {
        Ok("cuda") => fulmen_kernels::DeviceKind::Cuda,
        _ => fulmen_kernels::DeviceKind::Emulated,
    };
    assert_eq!(d.kind(), kind, "{d:?}");
    eprintln!("kernel tests run on {d} ({})", d.name());
}

fn small_device(budget: usize) -> Device {
    Device::emulated(
        0,
        &EmulatorOptions {
            memory_budget: budget,
            ..Default::default()
        },
    )
}

/// A deterministic pseudo-random sequence (tests must not depend on the clock).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 17
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

fn random_columns(n: usize, seed: u64, null_percent: u64) -> Vec<ArrayRef> {
    let mut r = Lcg(seed);
    let opt = |r: &mut Lcg| !r.chance(null_percent);
    let i8s: Int8Array = (0..n)
        .map(|_| opt(&mut r).then(|| r.next() as i8))
        .collect();
    let i16s: Int16Array = (0..n)
        .map(|_| opt(&mut r).then(|| r.next() as i16))
        .collect();
    let i32s: Int32Array = (0..n)
        .map(|_| opt(&mut r).then(|| r.next() as i32))
        .collect();
    let i64s: Int64Array = (0..n)
        .map(|_| opt(&mut r).then(|| r.next() as i64 - (1 << 40)))
        .collect();
    let u64s: UInt64Array = (0..n).map(|_| opt(&mut r).then(|| r.next())).collect();
    let f32s: Float32Array = (0..n)
        .map(|_| opt(&mut r).then(|| (r.next() % 1000) as f32 / 7.0))
        .collect();
    let f64s: Float64Array = (0..n)
        .map(|_| opt(&mut r).then(|| (r.next() % 100_000) as f64 / 3.0))
        .collect();
    let bools: BooleanArray = (0..n).map(|_| opt(&mut r).then(|| r.chance(50))).collect();
    let dates: Date32Array = (0..n)
        .map(|_| opt(&mut r).then(|| (r.next() % 20_000) as i32))
        .collect();
    let ts: TimestampMicrosecondArray = (0..n)
        .map(|_| opt(&mut r).then(|| r.next() as i64))
        .collect::<TimestampMicrosecondArray>()
        .with_timezone("Europe/Oslo");
    let decimals: Decimal128Array = (0..n)
        .map(|_| opt(&mut r).then(|| (r.next() as i128) * 1_000_003 - (1 << 50)))
        .collect::<Decimal128Array>()
        .with_precision_and_scale(38, 4)
        .unwrap();
    let strings: StringArray = (0..n)
        .map(|_| {
            opt(&mut r).then(|| {
                let len = (r.next() % 12) as usize;
                (0..len)
                    .map(|_| (b'a' + (r.next() % 26) as u8) as char)
                    .collect::<String>()
            })
        })
        .collect();
    let large: LargeStringArray = strings.iter().collect();
    // Precision 15: 64-bit values on the device (narrowed on upload, widened on download),
    // negative ones and those at the precision's edges among them.
    let edge = 10i128.pow(15) - 1;
    let narrow: Decimal128Array = (0..n)
        .map(|_| {
            opt(&mut r).then(|| match r.next() % 8 {
                0 => edge,
                1 => -edge,
                _ => (r.next() as i128 % (2 * edge + 1)) - edge,
            })
        })
        .collect::<Decimal128Array>()
        .with_precision_and_scale(15, 2)
        .unwrap();
    vec![
        Arc::new(i8s),
        Arc::new(i16s),
        Arc::new(i32s),
        Arc::new(i64s),
        Arc::new(u64s),
        Arc::new(f32s),
        Arc::new(f64s),
        Arc::new(bools),
        Arc::new(dates),
        Arc::new(ts),
        Arc::new(decimals),
        Arc::new(strings),
        Arc::new(large),
        Arc::new(narrow),
    ]
}

/// A decimal of precision at most 18 goes up in 8 bytes a value (narrowed in the copy into
/// staging) and comes back as Arrow's 16; one beyond its precision is refused.
#[test]
fn narrow_decimals_move_in_half_the_bytes() {
    let d = emulated();
    let values: Decimal128Array = (0..1000)
        .map(|i| (i % 7 != 0).then_some((i as i128 - 500) * 1_000_000_000_007))
        .collect::<Decimal128Array>()
        .with_precision_and_scale(18, 3)
        .unwrap();
    let before = d.counts().h2d_bytes;
    let column = DeviceColumn::upload(&d, &values).unwrap();
    // 8 bytes a value and the validity bitmap.
    assert_eq!(d.counts().h2d_bytes - before, 1000 * 8 + 125);
    assert_eq!(column.layout(), fulmen_kernels::column::Layout::Fixed(8));
    assert_eq!(column.to_arrow().unwrap().to_data(), values.to_data());
    // Arrow does not always check precision: a value that would not fit is an error.
    let beyond = Decimal128Array::from(vec![1i128 << 70, 5])
        .with_precision_and_scale(18, 0)
        .unwrap();
    assert!(DeviceColumn::upload(&d, &beyond).is_err());
    let beyond = Decimal128Array::from(vec![5, -(1i128 << 64) - 1])
        .with_precision_and_scale(10, 0)
        .unwrap();
    assert!(DeviceColumn::upload(&d, &beyond).is_err());
    // Under a NULL any bits may stand (a minimum's identity, say): they are not a value.
    let under_null = Decimal128Array::new(
        vec![i128::MAX, 7, i128::MIN].into(),
        Some(vec![false, true, false].into()),
    )
    .with_precision_and_scale(12, 2)
    .unwrap();
    let back = DeviceColumn::upload(&d, &under_null)
        .unwrap()
        .to_arrow()
        .unwrap();
    let back = back.as_primitive::<Decimal128Type>();
    assert_eq!(back.iter().collect::<Vec<_>>(), [None, Some(7), None]);
}

#[test]
fn upload_and_download_round_trip_every_type() {
    let d = device();
    for &n in SIZES {
        for null_percent in [0, 20, 100] {
            for array in random_columns(n, n as u64 + null_percent, null_percent) {
                let back = DeviceColumn::upload(&d, array.as_ref())
                    .unwrap()
                    .to_arrow()
                    .unwrap();
                assert_eq!(
                    back.to_data(),
                    array.to_data(),
                    "{} n={n}",
                    array.data_type()
                );
                // Sliced arrays (non-zero offsets) are rebased on upload.
                if n > 10 {
                    let sliced = array.slice(3, n - 7);
                    let back = DeviceColumn::upload(&d, sliced.as_ref())
                        .unwrap()
                        .to_arrow()
                        .unwrap();
                    assert_eq!(
                        back.as_ref(),
                        sliced.as_ref(),
                        "sliced {}",
                        array.data_type()
                    );
                }
            }
        }
    }
}

#[test]
fn a_view_column_concatenated_from_slices_keeps_32_bit_offsets() {
    // 8 192 values of 2 KiB (16 MiB of strings) cut in slices of 32 rows and put together
    // again: each slice keeps every data buffer, so the result's buffers count 4 GiB.
    let values: Vec<String> = (0..8192).map(|i| format!("{i:0>2048}")).collect();
    let view = StringViewArray::from_iter_values(values.iter());
    let slices: Vec<ArrayRef> = (0..256)
        .map(|k| Arc::new(view.slice(32 * k, 32)) as ArrayRef)
        .collect();
    let pieces: Vec<&dyn Array> = slices.iter().map(|a| a.as_ref()).collect();
    let joined = arrow::compute::concat(&pieces).unwrap();
    assert!(joined.get_buffer_memory_size() > i32::MAX as usize);
    // Its strings take 16 MiB: 32-bit offsets, as every plan expects of a view column.
    let column = DeviceColumn::upload(&device(), joined.as_ref()).unwrap();
    assert_eq!(column.data_type(), &DataType::Utf8);
    let back = column.to_arrow().unwrap();
    assert_eq!(
        back.as_ref(),
        &StringArray::from_iter_values(values.iter()) as &dyn Array
    );
}

#[test]
fn views_and_dictionaries_are_converted_on_upload() {
    let d = device();
    let view = StringViewArray::from(vec![
        Some("a much longer string than twelve bytes"),
        None,
        Some("b"),
    ]);
    let back = DeviceColumn::upload(&d, &view).unwrap().to_arrow().unwrap();
    assert_eq!(
        back.as_ref(),
        &StringArray::from(vec![
            Some("a much longer string than twelve bytes"),
            None,
            Some("b")
        ]) as &dyn Array
    );
    let dict: DictionaryArray<Int32Type> = vec![Some("x"), None, Some("y"), Some("x")]
        .into_iter()
        .collect();
    let back = DeviceColumn::upload(&d, &dict).unwrap().to_arrow().unwrap();
    assert_eq!(
        back.as_ref(),
        &StringArray::from(vec![Some("x"), None, Some("y"), Some("x")]) as &dyn Array
    );
    let unsupported = ListArray::from_iter_primitive::<Int32Type, _, _>(vec![Some(vec![Some(1)])]);
    assert!(matches!(
        DeviceColumn::upload(&d, &unsupported),
        Err(KernelError::Unsupported(_))
    ));
}

fn selection(n: usize, seed: u64, keep_percent: u64, null_percent: u64) -> BooleanArray {
    let mut r = Lcg(seed);
    (0..n)
        .map(|_| (!r.chance(null_percent)).then(|| r.chance(keep_percent)))
        .collect()
}

fn check_filter(d: &Device, n: usize, seed: u64, keep: u64, nulls: u64) {
    let columns = random_columns(n, seed, 10);
    let predicate = selection(n, seed ^ 0xABC, keep, nulls);
    let batch = RecordBatch::try_from_iter(
        columns
            .iter()
            .enumerate()
            .map(|(i, c)| (format!("c{i}"), c.clone())),
    )
    .unwrap();
    let device_batch = fulmen_kernels::DeviceBatch::upload(d, &batch).unwrap();
    let device_predicate = DeviceColumn::upload(d, &predicate).unwrap();
    let filtered = compact::filter_batch(&device_batch, &device_predicate)
        .unwrap()
        .to_record_batch()
        .unwrap();
    let expected = arrow::compute::filter_record_batch(&batch, &predicate).unwrap();
    assert_eq!(filtered, expected, "n={n} keep={keep}% nulls={nulls}%");
}

#[test]
fn filter_keeps_the_rows_arrow_keeps_in_order() {
    let d = device();
    for &n in SIZES {
        for (keep, nulls) in [(50, 10), (0, 0), (100, 0), (100, 50), (3, 0)] {
            check_filter(&d, n, n as u64 * 31 + keep, keep, nulls);
        }
    }
}

#[test]
fn a_queued_selection_keeps_what_arrow_keeps_and_waits_once_for_its_count() {
    // Waits are counted on an emulated device of the test's own: the CUDA test device is
    // shared by every test.
    for (d, counted) in [(device(), false), (emulated(), true)] {
        queued_selection(&d, counted);
    }
}

fn queued_selection(d: &Device, counted: bool) {
    let d = d.clone();
    for &n in SIZES {
        for (keep, nulls) in [(50, 10), (0, 0), (100, 0), (3, 40)] {
            let seed = n as u64 * 17 + keep;
            let predicate = selection(n, seed, keep, nulls);
            let rows: Int64Array = (0..n as i64).map(Some).collect();
            let device_rows = DeviceColumn::upload(&d, &rows).unwrap();
            let p = DeviceColumn::upload(&d, &predicate).unwrap();
            let status = d.upload(&[0; fulmen_kernels::ops::STATUS_BYTES]).unwrap();
            let before = d.counts();
            let queued =
                compact::selection_indices_queued(&d, p.values(), p.validity(), n, &status)
                    .unwrap();
            if counted {
                assert_eq!(d.counts().syncs, before.syncs, "queueing waits for nothing");
            }
            let count = fulmen_kernels::ops::read_status(&status).unwrap().unwrap();
            if counted {
                assert_eq!(
                    d.counts().syncs,
                    before.syncs + 1,
                    "one wait, for the count"
                );
            }
            let indices = queued.with_count(count).unwrap();
            let got = gather::gather_column(&device_rows, &indices)
                .unwrap()
                .to_arrow()
                .unwrap();
            let expected = filter(&rows, &predicate).unwrap();
            assert_eq!(
                got.as_ref(),
                expected.as_ref(),
                "n={n} keep={keep}% nulls={nulls}%"
            );
        }
    }
    // The error word of a program queued before (word 1) makes the status read say so,
    // and a count above the rows is refused, not trusted.
    let n = 1000;
    let p = DeviceColumn::upload(&d, &selection(n, 5, 50, 0)).unwrap();
    let status = d.upload(&[0; fulmen_kernels::ops::STATUS_BYTES]).unwrap();
    status.write(8, &1u64.to_le_bytes()).unwrap();
    let queued =
        compact::selection_indices_queued(&d, p.values(), p.validity(), n, &status).unwrap();
    assert_eq!(fulmen_kernels::ops::read_status(&status).unwrap(), None);
    assert!(queued.with_count(n as u64 + 1).is_err());
    let short = d.upload(&[0; 8]).unwrap();
    assert!(compact::selection_indices_queued(&d, p.values(), None, n, &short).is_err());
}

#[test]
fn filter_of_a_million_rows() {
    let d = device();
    let n = 1 << 20;
    let values: Int64Array = (0..n as i64).map(Some).collect();
    let predicate = selection(n, 99, 30, 5);
    let device_values = DeviceColumn::upload(&d, &values).unwrap();
    let device_predicate = DeviceColumn::upload(&d, &predicate).unwrap();
    let indices = compact::selection_indices(
        &d,
        device_predicate.values(),
        device_predicate.validity(),
        n,
    )
    .unwrap();
    let out = gather::gather_column(&device_values, &indices)
        .unwrap()
        .to_arrow()
        .unwrap();
    assert_eq!(out.as_ref(), filter(&values, &predicate).unwrap().as_ref());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn filter_matches_arrow_on_random_sizes(n in 0usize..3000, seed in any::<u64>(), keep in 0u64..=100, nulls in 0u64..=100) {
        check_filter(&device(), n, seed, keep, nulls);
    }

    #[test]
    fn gather_matches_arrow_take(n in 1usize..2000, out_n in 0usize..3000, seed in any::<u64>(), null_idx in 0u64..30) {
        let d = device();
        let mut r = Lcg(seed);
        let idx: Vec<u32> = (0..out_n).map(|_| if r.chance(null_idx) { NULL_INDEX } else { (r.next() % n as u64) as u32 }).collect();
        let take_idx: UInt32Array = idx.iter().map(|&i| (i != NULL_INDEX).then_some(i)).collect();
        let indices = RowIndices::upload(&d, &idx, n).unwrap();
        for column in random_columns(n, seed, 15) {
            let device_column = DeviceColumn::upload(&d, column.as_ref()).unwrap();
            let got = gather::gather_column(&device_column, &indices).unwrap().to_arrow().unwrap();
            let expected = take(column.as_ref(), &take_idx, None).unwrap();
            prop_assert_eq!(got.as_ref(), expected.as_ref(), "{}", column.data_type());
        }
    }

    /// Every column of a batch gathered together (fixed-width and boolean columns six to a
    /// launch, strings one by one) is what arrow's take gives each, and the launches are
    /// one per six such columns plus the strings' own.
    #[test]
    fn gathering_columns_together_matches_arrow_take(n in 1usize..2000, out_n in 0usize..3000, seed in any::<u64>(), null_idx in 0u64..30) {
        let d = device();
        let mut r = Lcg(seed);
        let idx: Vec<u32> = (0..out_n).map(|_| if r.chance(null_idx) { NULL_INDEX } else { (r.next() % n as u64) as u32 }).collect();
        let take_idx: UInt32Array = idx.iter().map(|&i| (i != NULL_INDEX).then_some(i)).collect();
        let indices = RowIndices::upload(&d, &idx, n).unwrap();
        // Without nulls half the time: columns without a validity bitmap.
        let columns = random_columns(n, seed, if seed % 2 == 0 { 0 } else { 15 });
        let on_device: Vec<DeviceColumn> = columns.iter().map(|c| DeviceColumn::upload(&d, c.as_ref()).unwrap()).collect();
        let refs: Vec<&DeviceColumn> = on_device.iter().collect();
        let got = gather::gather_columns(&refs, &indices).unwrap();
        // The fixed-width and boolean columns take one launch per six (counted on an
        // emulated device of the test's own).
        let e = emulated();
        let fixed: Vec<DeviceColumn> = columns
            .iter()
            .filter(|c| !matches!(c.data_type(), DataType::Utf8 | DataType::LargeUtf8))
            .map(|c| DeviceColumn::upload(&e, c.as_ref()).unwrap())
            .collect();
        let e_indices = RowIndices::upload(&e, &idx, n).unwrap();
        let before = e.counts().launches;
        gather::gather_columns(&fixed.iter().collect::<Vec<_>>(), &e_indices).unwrap();
        let want = if out_n == 0 { 0 } else { fixed.len().div_ceil(gather::GATHER_MANY) as u64 };
        prop_assert_eq!(e.counts().launches - before, want, "{} columns", fixed.len());
        prop_assert_eq!(got.len(), columns.len());
        for (column, got) in columns.iter().zip(&got) {
            let got = got.to_arrow().unwrap();
            let expected = take(column.as_ref(), &take_idx, None).unwrap();
            prop_assert_eq!(got.as_ref(), expected.as_ref(), "{}", column.data_type());
        }
    }

    /// A join's output gathered at its two index sets together (the build side's columns
    /// at one, the probe side's at the other, of different lengths and with NULL indices
    /// on one side, as an outer join's) is what arrow's take gives each, and its
    /// fixed-width and boolean columns, of both sides, take one launch per six.
    #[test]
    fn gathering_two_sides_together_matches_arrow_take(n1 in 1usize..1500, n2 in 1usize..1500, out_n in 0usize..2500, seed in any::<u64>(), null_idx in 0u64..30) {
        let d = device();
        let mut r = Lcg(seed);
        let idx1: Vec<u32> = (0..out_n).map(|_| if r.chance(null_idx) { NULL_INDEX } else { (r.next() % n1 as u64) as u32 }).collect();
        let idx2: Vec<u32> = (0..out_n).map(|_| (r.next() % n2 as u64) as u32).collect();
        let take1: UInt32Array = idx1.iter().map(|&i| (i != NULL_INDEX).then_some(i)).collect();
        let take2 = UInt32Array::from(idx2.clone());
        let left = random_columns(n1, seed, 15);
        let right = random_columns(n2, seed ^ 0x5555, if seed % 2 == 0 { 0 } else { 15 });
        // Alternate the sides, so that every launch mixes them.
        let mut columns: Vec<(ArrayRef, usize)> = Vec::new();
        for k in 0..left.len().max(right.len()) {
            columns.extend(left.get(k).map(|c| (Arc::clone(c), 0)));
            columns.extend(right.get(k).map(|c| (Arc::clone(c), 1)));
        }
        let check = |dev: &Device| -> (Vec<DeviceColumn>, u64, usize) {
            let on_device: Vec<DeviceColumn> = columns.iter().map(|(c, _)| DeviceColumn::upload(dev, c.as_ref()).unwrap()).collect();
            let refs: Vec<&DeviceColumn> = on_device.iter().collect();
            let sides: Vec<usize> = columns.iter().map(|(_, s)| *s).collect();
            let (i1, i2) = (RowIndices::upload(dev, &idx1, n1).unwrap(), RowIndices::upload(dev, &idx2, n2).unwrap());
            let of = |dev: &Device| dev.kernel_counts().iter().filter(|k| k.kernel == Kernel::gather_many).map(|k| k.launches).sum::<u64>();
            let before = of(dev);
            let got = gather::gather_columns_started_by(&refs, &[&i1, &i2], &sides, (0..refs.len()).map(|_| None).collect()).unwrap();
            let fixed = columns.iter().filter(|(c, _)| !matches!(c.data_type(), DataType::Utf8 | DataType::LargeUtf8)).count();
            (got, of(dev) - before, fixed)
        };
        let (got, _, _) = check(&d);
        // The fixed-width and boolean columns of both sides: one launch per six (counted
        // on an emulated device of the test's own).
        let (_, launches, fixed) = check(&emulated());
        let want = if out_n == 0 { 0 } else { fixed.div_ceil(gather::GATHER_MANY) as u64 };
        prop_assert_eq!(launches, want, "{} fixed-width columns", fixed);
        prop_assert_eq!(got.len(), columns.len());
        for ((column, side), got) in columns.iter().zip(&got) {
            let got = got.to_arrow().unwrap();
            let expected = take(column.as_ref(), if *side == 0 { &take1 } else { &take2 }, None).unwrap();
            prop_assert_eq!(got.as_ref(), expected.as_ref(), "{} of side {}", column.data_type(), side);
        }
    }

    #[test]
    fn scan_matches_a_host_prefix_sum(values in proptest::collection::vec(0u64..1_000_000, 0..5000)) {
        let d = device();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let input = d.upload(&bytes).unwrap();
        let (out, total) = scan::exclusive_scan(&d, &input, values.len()).unwrap();
        let host = out.to_host().unwrap();
        let mut running = 0u64;
        for (i, v) in values.iter().enumerate() {
            prop_assert_eq!(u64::from_le_bytes(host[i * 8..i * 8 + 8].try_into().unwrap()), running);
            running += v;
        }
        prop_assert_eq!(total, running);
    }

    /// Segments scanned together each scan as if alone, from zero; the values in a
    /// segment's padding are neither read nor written, and each total goes to its own word.
    #[test]
    fn segments_scan_as_if_alone(n in 0usize..3000, segments in 1usize..5, seed in any::<u64>()) {
        let d = device();
        let stride = if segments > 1 { scan::segment_stride(n) } else { n };
        let mut state = seed | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        // Padding holds a marker the scan must not add in.
        let values: Vec<u64> = (0..segments * stride)
            .map(|i| if i % stride.max(1) < n { next() % 1000 } else { 1 << 40 })
            .collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let input = d.upload(&bytes).unwrap();
        let words = d.upload(&vec![0u8; 8 * (segments + 1)]).unwrap();
        let out = scan::segments_queued(&d, &input, n, segments, Word::of(&words, 1).unwrap())
            .unwrap();
        let host = out.to_host().unwrap();
        let totals = words.to_host().unwrap();
        let word = |b: &[u8], i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
        prop_assert_eq!(word(&totals, 0), 0, "the word before the first is not written");
        for s in 0..segments {
            let mut running = 0u64;
            for i in 0..n {
                prop_assert_eq!(word(&host, s * stride + i), running, "segment {} value {}", s, i);
                running += values[s * stride + i];
            }
            prop_assert_eq!(word(&totals, 1 + s), running, "segment {}'s total", s);
        }
        if segments > 1 {
            // Words 1 ..= segments of a buffer of `segments` words.
            let short = d.upload(&vec![0u8; 8 * segments]).unwrap();
            let first = Word::of(&short, 1).unwrap();
            prop_assert!(
                scan::segments_queued(&d, &input, n, segments, first).is_err(),
                "totals past the buffer"
            );
        }
    }
}

/// A scan whose tiles (over all its segments) fit the stream's look-back state takes one
/// launch, and a longer one three, with the same answers: each value's prefix and each
/// segment's total. The scans follow each other on two streams, each with its state kept
/// from scan to scan (and zeroed by one more launch before the stream's first scan of more
/// than one tile a segment).
#[test]
fn scans_take_one_launch_up_to_the_look_back_tiles_and_three_past() {
    let device = emulated();
    let tile = scan::TILE as usize;
    let max = (scan::LOOKBACK_TILES * scan::TILE) as usize;
    let mut zeroed = [false; 2];
    for (k, (n, segments, launches)) in [
        (1, 1, 1),
        (tile, 1, 1),
        (tile, 3, 1),
        (tile + 1, 1, 1),
        (tile + 1, 3, 1),
        (1 << 20, 2, 1),
        (3 * tile + 5, 7, 1),
        (max, 1, 1),
        (max + 1, 1, 3),
        (max / 2, 2, 1),
        (max / 2 + 1, 2, 3),
        (2 * tile - 1, 2, 1),
        (tile * 5, 1, 1),
    ]
    .into_iter()
    .enumerate()
    {
        let d = device.on_stream(k % 2);
        let stride = if segments > 1 {
            scan::segment_stride(n)
        } else {
            n
        };
        let values: Vec<u64> = (0..segments * stride)
            .map(|i| (i as u64).wrapping_mul(0x9E37_79B9) % 97)
            .collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let input = d.upload(&bytes).unwrap();
        let words = d.upload(&vec![0u8; 8 * segments]).unwrap();
        let before = d.counts().launches;
        let out =
            scan::segments_queued(&d, &input, n, segments, Word::of(&words, 0).unwrap()).unwrap();
        let zeroing = launches == 1 && n > tile && !std::mem::replace(&mut zeroed[k % 2], true);
        assert_eq!(
            d.counts().launches - before,
            launches + u64::from(zeroing),
            "n={n} segments={segments}"
        );
        let host = out.to_host().unwrap();
        let totals = words.to_host().unwrap();
        let word = |b: &[u8], i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
        for s in 0..segments {
            let mut running = 0u64;
            for i in 0..n {
                assert_eq!(
                    word(&host, s * stride + i),
                    running,
                    "n={n} segment {s} value {i}"
                );
                running += values[s * stride + i];
            }
            assert_eq!(word(&totals, s), running, "n={n} segment {s}'s total");
        }
    }
}

#[test]
fn hashes_match_the_host_reference_and_respect_nulls() {
    let d = device();
    for &n in SIZES {
        let columns = random_columns(n, n as u64, 20);
        let hashable: Vec<&ArrayRef> = columns
            .iter()
            .filter(|c| c.data_type() != &DataType::Boolean)
            .collect();
        let device_columns: Vec<DeviceColumn> = hashable
            .iter()
            .map(|c| DeviceColumn::upload(&d, c.as_ref()).unwrap())
            .collect();
        // One column at a time, then all of them combined (more than one launch's worth).
        assert!(hashable.len() > 6, "{} columns", hashable.len());
        for (column, device_column) in hashable.iter().zip(&device_columns) {
            let got = hash::hash_columns(&d, &[device_column])
                .unwrap()
                .to_host()
                .unwrap();
            let expected = hash::hash_rows_host(&[column.as_ref()]).unwrap();
            let got: Vec<u64> = got[..n * 8]
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
                .collect();
            assert_eq!(got, expected, "{}", column.data_type());
            for (i, h) in got.iter().enumerate() {
                if column.is_null(i) {
                    assert_eq!(*h, hash::NULL_HASH);
                }
            }
        }
        let all: Vec<&DeviceColumn> = device_columns.iter().collect();
        let launches = d.counts().launches;
        let hashes = hash::hash_columns(&d, &all).unwrap();
        if std::env::var("FULMEN_TEST_DEVICE").as_deref() != Ok("cuda") {
            // Six columns to a launch (the CUDA test device is shared by every test).
            assert_eq!(d.counts().launches - launches, all.len().div_ceil(6) as u64);
        }
        let got = hashes.to_host().unwrap();
        let arrays: Vec<&dyn Array> = hashable.iter().map(|c| c.as_ref() as &dyn Array).collect();
        let expected = hash::hash_rows_host(&arrays).unwrap();
        let got: Vec<u64> = got[..n * 8]
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, expected);
    }
}

#[test]
fn equal_values_hash_equal_across_widths_and_float_quirks() {
    let floats = Float64Array::from(vec![0.0, -0.0, f64::NAN, -f64::NAN, 1.5]);
    let h = hash::hash_rows_host(&[&floats]).unwrap();
    assert_eq!(h[0], h[1], "-0.0 groups with 0.0");
    assert_eq!(h[2], h[3], "NaNs group together");
    assert_ne!(h[0], h[4]);
    let d = device();
    let got = hash::hash_columns(&d, &[&DeviceColumn::upload(&d, &floats).unwrap()])
        .unwrap()
        .to_host()
        .unwrap();
    let got: Vec<u64> = got
        .chunks_exact(8)
        .take(5)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(got, h);
    let strings = StringArray::from(vec!["ab", "ab", "ba", ""]);
    let h = hash::hash_rows_host(&[&strings]).unwrap();
    assert_eq!(h[0], h[1]);
    assert_ne!(h[0], h[2]);
}

/// A hash join by the device table against a nested loop on the host.
fn check_join(d: &Device, build: &Int64Array, probe: &Int64Array) {
    let bd = DeviceColumn::upload(d, build).unwrap();
    let pd = DeviceColumn::upload(d, probe).unwrap();
    let bh = hash::hash_columns(d, &[&bd]).unwrap();
    let ph = hash::hash_columns(d, &[&pd]).unwrap();
    let table = hash_table::HashTable::build(d, &bh, bd.validity(), build.len()).unwrap();
    let pairs = table.probe(&ph, pd.validity(), probe.len(), None).unwrap();
    let b = pairs.build.to_host().unwrap();
    let p = pairs.probe.to_host().unwrap();
    // Candidates share a hash; keep those whose keys are equal, as a join does.
    let mut got: Vec<(u32, u32)> = b
        .iter()
        .zip(&p)
        .filter(|(bi, pi)| build.value(**bi as usize) == probe.value(**pi as usize))
        .map(|(&bi, &pi)| (bi, pi))
        .collect();
    got.sort();
    let mut expected = Vec::new();
    for (bi, bv) in build.iter().enumerate() {
        for (pi, pv) in probe.iter().enumerate() {
            if let (Some(bv), Some(pv)) = (bv, pv)
                && bv == pv
            {
                expected.push((bi as u32, pi as u32));
            }
        }
    }
    expected.sort();
    assert_eq!(got, expected, "build={} probe={}", build.len(), probe.len());
    assert!(
        p.windows(2).all(|w| w[0] <= w[1]),
        "probe rows come out in probe order"
    );
}

#[test]
fn hash_table_joins_like_a_nested_loop() {
    let d = device();
    let mut r = Lcg(7);
    for (nb, np, distinct) in [
        (0, 10, 5),
        (10, 0, 5),
        (1, 1, 1),
        (300, 500, 50),
        (1000, 1000, 1),
        (2000, 700, 100_000),
        (257, 1025, 3),
    ] {
        let build: Int64Array = (0..nb)
            .map(|_| (!r.chance(10)).then(|| (r.next() % distinct) as i64))
            .collect();
        let probe: Int64Array = (0..np)
            .map(|_| (!r.chance(10)).then(|| (r.next() % distinct) as i64))
            .collect();
        check_join(&d, &build, &probe);
    }
}

/// A bounded probe counts, scans and writes its pairs in one launch (`hash_table_probe`,
/// its blocks chained by the look-back) and finds what the three-launch probe finds, in the
/// same order; with less room than pairs it reports the total and writes only the pairs
/// before its room's end.
#[test]
fn a_bounded_probe_takes_one_launch_and_finds_what_the_exact_probe_finds() {
    // Launches are counted on an emulated device of the test's own: the CUDA test device
    // is shared by every test.
    for (d, counted) in [(device(), false), (emulated(), true)] {
        let mut r = Lcg(23);
        for (nb, np, distinct) in [
            (10, 1, 5),
            (300, 500, 50),
            (1000, 1000, 1),
            (257, 1025, 3),
            (2000, 5000, 700),
            (3000, 70_001, 2500),
        ] {
            let keys = |r: &mut Lcg, n: usize| -> Int64Array {
                (0..n)
                    .map(|_| (!r.chance(10)).then(|| (r.next() % distinct) as i64))
                    .collect()
            };
            let (build, probe) = (keys(&mut r, nb), keys(&mut r, np));
            let bd = DeviceColumn::upload(&d, &build).unwrap();
            let pd = DeviceColumn::upload(&d, &probe).unwrap();
            let bh = hash::hash_columns(&d, &[&bd]).unwrap();
            let ph = hash::hash_columns(&d, &[&pd]).unwrap();
            let table = hash_table::HashTable::build(&d, &bh, bd.validity(), nb).unwrap();
            // The exact probe (count, scan, emit) also makes the stream's look-back state.
            let exact = table.probe(&ph, pd.validity(), np, None).unwrap();
            let (eb, ep) = (
                exact.build.to_host().unwrap(),
                exact.probe.to_host().unwrap(),
            );
            let total = eb.len();
            let mut expected: Vec<(u32, u32)> =
                eb.iter().copied().zip(ep.iter().copied()).collect();
            expected.sort();
            for cap in [total + 100, total, total / 2, 0] {
                let words = d.upload(&[0; 8]).unwrap();
                let before = d.counts().launches;
                let (ob, op) = table
                    .probe_bounded(
                        &ph,
                        pd.validity(),
                        np,
                        cap,
                        Word::of(&words, 0).unwrap(),
                        None,
                    )
                    .unwrap();
                if counted {
                    assert_eq!(d.counts().launches - before, 1, "np={np} cap={cap}");
                }
                let what = format!("nb={nb} np={np} distinct={distinct} cap={cap}");
                let got_total =
                    u64::from_le_bytes(words.to_host().unwrap()[..8].try_into().unwrap());
                assert_eq!(got_total, total as u64, "{what}");
                let kept = cap.min(total);
                let u32s = |b: Vec<u8>| -> Vec<u32> {
                    b.chunks_exact(4)
                        .take(kept)
                        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                        .collect()
                };
                let (gb, gp) = (u32s(ob.to_host().unwrap()), u32s(op.to_host().unwrap()));
                // Every pair of a probe row carries its probe row, so the probe rows agree
                // exactly; the build rows too, but for the one probe row cut by the room's end,
                // whose pairs are left unsorted.
                assert_eq!(gp, ep[..kept], "{what}");
                let cut = (kept < total).then(|| ep[kept]);
                for (k, (b, p)) in gb.iter().zip(&gp).enumerate() {
                    if Some(*p) == cut {
                        assert!(
                            expected.binary_search(&(*b, *p)).is_ok(),
                            "{what}: pair {k}"
                        );
                    } else {
                        assert_eq!(*b, eb[k], "{what}: pair {k}");
                    }
                }
            }
        }
    }
}

#[test]
fn hash_join_of_a_million_rows() {
    let d = device();
    let n = 1 << 20;
    // Build keys 0..n/2 each twice; probe keys spread over 0..n with some NULLs.
    let build: Int64Array = (0..n as i64).map(|i| Some(i / 2)).collect();
    let mut r = Lcg(11);
    let probe: Int64Array = (0..n)
        .map(|_| (!r.chance(5)).then(|| (r.next() % n as u64) as i64))
        .collect();
    let bd = DeviceColumn::upload(&d, &build).unwrap();
    let pd = DeviceColumn::upload(&d, &probe).unwrap();
    let bh = hash::hash_columns(&d, &[&bd]).unwrap();
    let ph = hash::hash_columns(&d, &[&pd]).unwrap();
    let host = hash::hash_rows_host(&[&probe]).unwrap();
    let device_hashes: Vec<u64> = ph.to_host().unwrap()[..n * 8]
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(device_hashes, host);
    let table = hash_table::HashTable::build(&d, &bh, bd.validity(), n).unwrap();
    let pairs = table.probe(&ph, pd.validity(), n, None).unwrap();
    let b = pairs.build.to_host().unwrap();
    let p = pairs.probe.to_host().unwrap();
    let matched = b
        .iter()
        .zip(&p)
        .filter(|(bi, pi)| build.value(**bi as usize) == probe.value(**pi as usize))
        .count();
    let expected: usize = probe
        .iter()
        .map(|v| matches!(v, Some(k) if (k as usize) < n / 2) as usize * 2)
        .sum();
    assert_eq!(matched, expected);
}

// --- The emulator's own guarantees -------------------------------------------------------

#[test]
fn barriers_make_a_block_scan_correct() {
    let d = device();
    for n in [1usize, 31, 32, 33, 256, 1000, 1024] {
        let input: Vec<u32> = (0..n as u32).map(|i| i % 7 + 1).collect();
        let got = selftest::block_scan(&d, &input).unwrap();
        let expected: Vec<u32> = input
            .iter()
            .scan(0, |s, v| {
                *s += v;
                Some(*s)
            })
            .collect();
        assert_eq!(got, expected, "n={n}");
    }
}

#[test]
fn warp_vote_and_shuffle_follow_cuda() {
    let d = device();
    let input: Vec<i32> = (0..256).map(|i| (i * 37 % 101) - 20).collect();
    let got = selftest::warp_ops(&d, &input, 128).unwrap();
    for w in 0..8 {
        let lanes = &input[w * 32..w * 32 + 32];
        assert_eq!(got.sums[w], lanes.iter().sum::<i32>());
        let ballot = lanes
            .iter()
            .enumerate()
            .fold(0u32, |b, (l, &v)| b | (u32::from(v > 0) << l));
        assert_eq!(got.ballots[w], ballot);
        let any_negative = lanes.iter().any(|&v| v < 0) as u32;
        let all_positive = lanes.iter().all(|&v| v > 0) as u32;
        assert_eq!(got.votes[w], any_negative | (all_positive << 1));
        for l in 0..32 {
            assert_eq!(got.rotated[w * 32 + l], lanes[(l + 1) % 32]);
            assert_eq!(got.all_sums[w * 32 + l], lanes.iter().sum::<i32>());
            assert_eq!(got.ups[w * 32 + l], lanes[l.saturating_sub(1)]);
        }
    }
}

#[test]
fn atomics_are_exact_under_contention() {
    let d = device();
    let n = 100_000u64;
    let got = selftest::atomics(&d, n, 8, 256).unwrap();
    assert_eq!(got.counter, n as u32);
    assert_eq!(got.max, (n - 1) as i32);
    assert_eq!(got.min, -((n - 1) as i32));
    assert_eq!(got.sum64, n * (n - 1) / 2);
    assert_eq!(got.cas_sum, n * (n - 1) / 2);
    assert_eq!(got.fsum, n as f32);
    assert_eq!(got.dsum, n as f64 * 0.5);
    assert_eq!(got.bits, u32::MAX);
}

#[test]
fn the_shuffled_order_exposes_a_race() {
    let d = emulated();
    let expected: Vec<u32> = (0..256u32).map(|t| (t + 1) % 256 + 1).collect();
    assert_eq!(
        selftest::racy(&d, 256, true).unwrap(),
        expected,
        "with the barrier it is right"
    );
    let racy = selftest::racy(&d, 256, false).unwrap();
    let wrong = racy.iter().zip(&expected).filter(|(a, b)| a != b).count();
    assert!(
        wrong > 0,
        "without the barrier some thread must read its neighbour's slot too early"
    );
}

#[test]
fn out_of_bounds_writes_and_divergent_barriers_are_typed_errors() {
    let d = emulated();
    let e = selftest::out_of_bounds(&d, 1000).unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::OutOfBounds {
                kernel: "selftest_oob",
                ..
            }
        ),
        "{e}"
    );
    // Found when the stream ran the kernel: as a GPU's sticky error, it takes the device
    // out of use, naming the kernel that did it.
    let reason = d.quarantined().expect("a faulting kernel loses the device");
    assert!(reason.contains("selftest_oob"), "{reason}");
    let predicate = BooleanArray::from(vec![true, false, true]);
    let e = DeviceColumn::upload(&d, &predicate).unwrap_err();
    assert!(matches!(e, KernelError::Quarantined { .. }), "{e}");
    let d = emulated();
    let e = selftest::divergent_barrier(&d).unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::LaunchFailed {
                kernel: "selftest_divergent",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("deadlock"), "{e}");
}

#[test]
fn allocations_past_the_budget_are_refused_and_memory_comes_back() {
    let d = small_device(1 << 20);
    let a = d.alloc(600 << 10).unwrap();
    let e = d.alloc(600 << 10).unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::OutOfDeviceMemory {
                budget: 1048576,
                ..
            }
        ),
        "{e}"
    );
    drop(a);
    assert_eq!(d.memory_usage().0, 0);
    d.alloc(600 << 10).expect("freed memory is usable again");
    // A filter whose working set does not fit fails with the typed error, not a crash.
    let values: Int64Array = (0..200_000).map(Some).collect();
    let e = DeviceColumn::upload(&d, &values).unwrap_err();
    assert!(matches!(e, KernelError::OutOfDeviceMemory { .. }), "{e}");
}

#[test]
fn injected_faults_surface_as_typed_errors_and_then_clear() {
    let d = emulated();
    let values: Int64Array = (0..10_000).map(Some).collect();
    let predicate = selection(10_000, 5, 40, 5);
    let run = |d: &Device| -> Result<ArrayRef, KernelError> {
        let v = DeviceColumn::upload(d, &values)?;
        let p = DeviceColumn::upload(d, &predicate)?;
        let idx = compact::selection_indices(d, p.values(), p.validity(), 10_000)?;
        gather::gather_column(&v, &idx)?.to_arrow()
    };
    let expected = filter(&values, &predicate).unwrap();
    let (allocs_before, launches_before) = d.counters();
    run(&d).unwrap();
    let (allocs, launches) = d.counters();
    let (allocs, launches) = (allocs - allocs_before, launches - launches_before);
    // Each allocation and each launch (the selection's one pass, the gather) fails in turn.
    assert!(
        allocs > 3 && launches >= 2,
        "{allocs} allocations, {launches} launches"
    );
    for k in 1..=allocs {
        d.inject_faults(FaultPlan {
            fail_allocation: Some(k),
            ..FaultPlan::default()
        })
        .unwrap();
        let e = run(&d).unwrap_err();
        assert!(
            matches!(
                e,
                KernelError::InjectedFault {
                    what: "allocation",
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(
            run(&d).unwrap().as_ref(),
            expected.as_ref(),
            "the next run is clean"
        );
    }
    for k in 1..=launches {
        d.inject_faults(FaultPlan {
            fail_launch: Some(k),
            ..FaultPlan::default()
        })
        .unwrap();
        let e = run(&d).unwrap_err();
        assert!(
            matches!(e, KernelError::InjectedFault { what: "launch", .. }),
            "{e}"
        );
        assert_eq!(run(&d).unwrap().as_ref(), expected.as_ref());
    }
}

/// A launch that loses the device (as a sticky CUDA error does) quarantines it: that call
/// fails with `DeviceLost`, and every later allocation, copy and launch fails at once with
/// `Quarantined`, without reaching the device (its counters stand still).
#[test]
fn a_lost_device_is_quarantined_and_never_touched_again() {
    let d = emulated();
    let values = Int64Array::from_iter_values(0..1000);
    let predicate = BooleanArray::from_iter((0..1000).map(|i| Some(i % 3 == 0)));
    let column = DeviceColumn::upload(&d, &values).unwrap();
    let p = DeviceColumn::upload(&d, &predicate).unwrap();
    let select = || {
        let idx = compact::selection_indices(&d, p.values(), p.validity(), 1000)?;
        gather::gather_column(&column, &idx)
    };
    d.inject_faults(FaultPlan {
        lose_device_at_launch: Some(1),
        ..FaultPlan::default()
    })
    .unwrap();
    let e = select().unwrap_err();
    assert!(matches!(e, KernelError::DeviceLost { .. }), "{e}");
    assert!(e.device_gone() && !e.is_expected(), "{e}");
    let reason = d.quarantined().expect("quarantined");
    assert!(reason.contains("sticky"), "{reason}");
    let before = d.counters();
    for e in [
        d.alloc(64).map(|_| ()).unwrap_err(),
        column.to_arrow().map(|_| ()).unwrap_err(),
        select().map(|_| ()).unwrap_err(),
    ] {
        assert!(matches!(e, KernelError::Quarantined { .. }), "{e}");
        assert!(e.is_expected() && e.device_gone(), "{e}");
    }
    assert_eq!(d.counters(), before, "a quarantined device was touched");
}

/// Uploads that go round the two pinned staging halves more than once, with no wait in
/// between, each keep their own bytes: a half is refilled only once the stream has passed
/// the copies out of it. (On the test device: through the stand-in driver a queued copy
/// reads pinned memory when it runs, so refilling a half too soon gives wrong bytes.)
#[test]
fn uploads_round_the_staging_halves_keep_their_bytes() {
    use fulmen_kernels::device::UPLOAD_HALF_BYTES;
    let d = device();
    let pattern = |k: usize, len: usize| -> Vec<u8> {
        (0..len)
            .map(|i| (i.wrapping_mul(31) ^ (k * 97)) as u8)
            .collect()
    };
    // 0.6 + 0.6 + 0.6 + 0.6 + 1.3 halves: the third refills the first half, the last spans
    // both.
    let lens = [6, 6, 6, 6, 13].map(|tenths| UPLOAD_HALF_BYTES / 10 * tenths + tenths);
    let buffers: Vec<_> = lens
        .iter()
        .enumerate()
        .map(|(k, &len)| d.upload(&pattern(k, len)).unwrap())
        .collect();
    for (k, (b, &len)) in buffers.iter().zip(&lens).enumerate() {
        assert!(
            b.to_host().unwrap() == pattern(k, len),
            "upload {k} came back changed"
        );
    }
}

/// A device counts its work as the CUDA backend's driver calls: a copy per upload piece of
/// at most one staging half, a copy and a wait per 16 MiB read piece, a copy per
/// device-to-device copy, no wait for launches, uploads or copies (they are queued), a wait
/// where an upload refills a staging half the host has not waited for since, and the sizes
/// of the buffers each launch was given. (That the driver receives exactly these calls is
/// checked against the stand-in driver's own counts by scripts/test.sh.)
#[test]
fn device_work_is_counted_as_the_driver_calls_it_makes() {
    use fulmen_kernels::device::{STAGING_BYTES, UPLOAD_HALF_BYTES};
    let d = emulated();
    let start = d.counts();
    let bytes = vec![7u8; UPLOAD_HALF_BYTES + 1];
    let a = d.upload(&bytes).unwrap();
    let b = d.alloc(bytes.len()).unwrap();
    d.copy(&b, &a).unwrap();
    let queued = d.counts();
    assert_eq!(queued.h2d_copies - start.h2d_copies, 2, "{queued:?}");
    assert_eq!(queued.h2d_bytes - start.h2d_bytes, bytes.len() as u64);
    assert_eq!(
        (
            queued.d2d_copies - start.d2d_copies,
            queued.d2d_bytes - start.d2d_bytes
        ),
        (1, bytes.len() as u64)
    );
    assert_eq!(queued.syncs, start.syncs, "uploads and copies do not wait");
    assert_eq!(b.to_host().unwrap(), bytes);
    let c = d.counts();
    let pieces = bytes.len().div_ceil(STAGING_BYTES) as u64;
    assert_eq!(c.d2h_copies - start.d2h_copies, pieces);
    assert_eq!(c.d2h_bytes - start.d2h_bytes, bytes.len() as u64);
    assert_eq!(c.syncs - start.syncs, pieces, "a wait per read piece");
    assert_eq!(c.allocations - start.allocations, 2);
    assert_eq!(c.driver_allocations - start.driver_allocations, 2);
    assert_eq!(c.launches, start.launches);
    // Both halves were passed by that read: uploading as much again does not wait; a third
    // time, with no wait in between, refilling the first half does, once.
    let again = d.upload(&bytes).unwrap();
    assert_eq!(d.counts().syncs, c.syncs);
    let third = d.upload(&bytes).unwrap();
    assert_eq!(d.counts().syncs, c.syncs + 1);
    assert_eq!(third.to_host().unwrap(), bytes);
    assert_eq!(again.to_host().unwrap(), bytes);
    drop((again, third));
    // A launch does not wait; the selection's count, which the host reads, does, once.
    let predicate = BooleanArray::from(vec![true, false, true]);
    let p = DeviceColumn::upload(&d, &predicate).unwrap();
    let before = d.counts();
    compact::selection_indices(&d, p.values(), p.validity(), 3).unwrap();
    let after = d.counts();
    assert!(after.launches - before.launches >= 1);
    assert_eq!(after.syncs - before.syncs, 1, "{after:?}");
    assert!(after.device_bytes - before.device_bytes >= p.values().len() as u64);
    // Freed buffers go back to the pool, and are reused without the driver.
    drop((a, b));
    let reused = d.counts();
    let _again = d.alloc(bytes.len()).unwrap();
    assert_eq!(d.counts().driver_allocations, reused.driver_allocations);
}

/// Work is queued: nothing a launch or an upload writes is there before the stream has run
/// it, and a read (or a synchronize) is what runs it, in order.
#[test]
fn the_emulated_stream_runs_queued_work_in_order_when_the_host_waits() {
    let d = emulated();
    let a = d.upload(&[1u8; 64]).unwrap();
    a.write(0, &[2u8; 64]).unwrap();
    let b = d.alloc(64).unwrap();
    d.copy(&b, &a).unwrap();
    a.write(0, &[3u8; 64]).unwrap();
    assert_eq!(
        b.to_host().unwrap(),
        vec![2u8; 64],
        "the copy saw the second write"
    );
    assert_eq!(a.to_host().unwrap(), vec![3u8; 64]);
    // A buffer dropped while its work is queued, and its block reused at once: the new
    // owner's work runs after the old owner's, so neither sees the other's bytes.
    let old = d.upload(&[5u8; 64]).unwrap();
    let kept = d.alloc(64).unwrap();
    d.copy(&kept, &old).unwrap();
    drop(old);
    let new = d.upload(&[9u8; 64]).unwrap();
    assert_eq!(kept.to_host().unwrap(), vec![5u8; 64]);
    assert_eq!(new.to_host().unwrap(), vec![9u8; 64]);
    d.synchronize().unwrap();
}

/// Every selection of a GPU gets its one device, and a memory limit is a quota on it: the
/// limited handle is refused past its limit while the device still has room.
#[test]
fn a_memory_limit_is_a_quota_on_the_one_device() {
    let d = device();
    if d.kind() == fulmen_kernels::DeviceKind::Cuda {
        let auto = fulmen_kernels::open_devices(
            &fulmen_kernels::DeviceSelection::Auto,
            &EmulatorOptions::default(),
            Some(64 << 20),
        )
        .unwrap();
        assert_eq!(auto[0], d, "auto and cuda:0 are one device");
        assert_eq!(auto[0].memory_budget(), 64 << 20);
        assert_eq!(Device::cuda(0, Some(1 << 20)).unwrap(), d);
    }
    let limited = d.with_memory_limit(1 << 20);
    assert_eq!(limited, d, "a limit does not make another device");
    assert_eq!(limited.memory_budget(), 1 << 20);
    let held = limited.alloc(1 << 20).unwrap();
    let e = limited.alloc(256).unwrap_err();
    assert!(
        matches!(
            e,
            KernelError::OutOfDeviceMemory {
                budget: 1048576,
                ..
            }
        ),
        "{e}"
    );
    let beside = d.alloc(1 << 20).expect("the device itself still has room");
    assert_eq!(limited.memory_usage().0, 1 << 20);
    drop((held, beside));
    assert_eq!(limited.memory_usage().0, 0);
    limited.alloc(1 << 20).expect("freed quota is usable again");
}

// --- NVRTC -------------------------------------------------------------------------------

#[test]
fn every_kernel_compiles_with_nvrtc_for_ampere_and_hopper() {
    if std::env::var_os("FULMEN_SKIP_NVRTC").is_some() {
        eprintln!("FULMEN_SKIP_NVRTC is set: NVRTC compilation NOT checked");
        return;
    }
    assert!(
        fulmen_kernels::nvrtc::nvrtc_present(),
        "NVRTC not found: run scripts/install-nvrtc.sh and put its lib folder on LD_LIBRARY_PATH \
         (scripts/test.sh does both), or set FULMEN_SKIP_NVRTC=1 to skip this check"
    );
    for arch in ["compute_80", "compute_90"] {
        for (file, _) in fulmen_kernels::kernels::SOURCES {
            let ptx =
                fulmen_kernels::nvrtc::compile_ptx(file, arch).unwrap_or_else(|e| panic!("{e}"));
            for kernel in Kernel::ALL.iter().filter(|k| k.source_file() == *file) {
                assert!(
                    ptx.contains(&format!(".entry {}(", kernel.name())),
                    "{file} for {arch} has no entry point {}",
                    kernel.name()
                );
            }
        }
    }
}

#[test]
fn every_kernel_compiles_to_a_cached_cubin_for_exact_architectures() {
    if std::env::var_os("FULMEN_SKIP_NVRTC").is_some() {
        eprintln!("FULMEN_SKIP_NVRTC is set: NVRTC compilation NOT checked");
        return;
    }
    let cache = std::env::temp_dir().join(format!("fulmen-kernel-cache-{}", std::process::id()));
    for cc in [(8, 0), (9, 0)] {
        for (file, _) in fulmen_kernels::kernels::SOURCES {
            let cubin = fulmen_kernels::nvrtc::kernel_image_in(Some(&cache), file, cc)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(
                &cubin[..4],
                b"\x7fELF",
                "{file} sm_{}{} is an ELF cubin",
                cc.0,
                cc.1
            );
            let again = fulmen_kernels::nvrtc::kernel_image_in(Some(&cache), file, cc).unwrap();
            assert_eq!(again, cubin, "the second call reads the cache");
        }
    }
    let cached = std::fs::read_dir(&cache).unwrap().count();
    assert_eq!(cached, 2 * fulmen_kernels::kernels::SOURCES.len());
    let _ = std::fs::remove_dir_all(&cache);
}

/// When NVRTC was there at build time (as it is wherever it is there at test time: the
/// build looks where scripts/install-nvrtc.sh puts it), every kernel file is embedded as
/// sm_80 and sm_90 cubins and compute_80 PTX, each holding every kernel of its file, and a
/// GPU of an embedded architecture loads a cubin built ahead, never NVRTC's.
#[test]
fn every_kernel_is_built_ahead_for_ampere_and_hopper_with_ptx_for_newer_gpus() {
    use fulmen_kernels::images::{self, ImageOrigin};
    let Some(built_with) = images::embedded_with() else {
        if std::env::var_os("FULMEN_SKIP_NVRTC").is_some() {
            eprintln!("FULMEN_SKIP_NVRTC is set and this build embeds no kernels: NOT checked");
            return;
        }
        panic!(
            "this build embeds no kernels: NVRTC was not found when fulmen-kernels was built \
             (run scripts/install-nvrtc.sh, then rebuild), or set FULMEN_SKIP_NVRTC=1"
        )
    };
    let embedded: Vec<_> = images::embedded().collect();
    for (file, _) in fulmen_kernels::kernels::SOURCES {
        for arch in images::EMBEDDED_ARCHS {
            assert!(
                embedded.contains(&(*file, *arch)),
                "{file} is not embedded for {arch}"
            );
        }
        for (cc, origin) in [
            ((9, 0), ImageOrigin::EmbeddedCubin("sm_90")),
            ((8, 0), ImageOrigin::EmbeddedCubin("sm_80")),
            ((8, 9), ImageOrigin::EmbeddedCubin("sm_80")),
        ] {
            let image = images::module_image(file, cc).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(image.origin, origin, "{file} on compute {cc:?}");
            let bytes = image.bytes.as_ref();
            assert_eq!(&bytes[..4], b"\x7fELF", "{file}: a cubin");
            for kernel in Kernel::ALL.iter().filter(|k| k.source_file() == *file) {
                let section = format!(".text.{}\0", kernel.name());
                assert!(
                    bytes
                        .windows(section.len())
                        .any(|w| w == section.as_bytes()),
                    "{file}'s {origin} cubin has no kernel {}",
                    kernel.name()
                );
            }
        }
    }
    eprintln!("kernels embedded by {built_with}: {embedded:?}");
}

#[test]
fn join_table_matches_like_a_nested_loop() {
    use fulmen_kernels::ops::join::JoinTable;
    let d = device();
    let mut r = Lcg(11);
    for (n_build, n_probe, distinct) in [
        (0, 10, 5),
        (10, 0, 5),
        (300, 500, 7),
        (2000, 3000, 100_000),
        (1500, 40, 1),
    ] {
        let keys = |r: &mut Lcg, n: usize| -> (Int64Array, StringArray) {
            (
                (0..n)
                    .map(|_| (!r.chance(10)).then(|| (r.next() % distinct) as i64))
                    .collect(),
                (0..n)
                    .map(|_| {
                        (!r.chance(5)).then(|| ["x", "yy", ""][r.next() as usize % 3].to_string())
                    })
                    .collect(),
            )
        };
        let (b1, b2) = keys(&mut r, n_build);
        let (p1, p2) = keys(&mut r, n_probe);
        let valid = |a: &Int64Array, b: &StringArray| -> Vec<bool> {
            (0..a.len())
                .map(|i| a.is_valid(i) && b.is_valid(i))
                .collect()
        };
        let bitmap = |v: &[bool]| {
            let mut bytes = vec![0u8; v.len().div_ceil(8).max(1)];
            for (i, &x) in v.iter().enumerate() {
                if x {
                    bytes[i / 8] |= 1 << (i % 8);
                }
            }
            d.upload(&bytes).unwrap()
        };
        let (bv, pv) = (valid(&b1, &b2), valid(&p1, &p2));
        let up = |a: &dyn Array| DeviceColumn::upload(&d, a).unwrap();
        let table = JoinTable::build(
            &d,
            vec![up(&b1), up(&b2)],
            Some(&bitmap(&bv)),
            n_build,
            false,
        )
        .unwrap();
        let (q1, q2) = (up(&p1), up(&p2));
        // Probe rows with NULL keys need no validity: the verification rejects them.
        let got = if n_probe % 2 == 0 {
            table.probe(&[&q1, &q2], None, n_probe).unwrap()
        } else {
            table
                .probe(&[&q1, &q2], Some(&bitmap(&pv)), n_probe)
                .unwrap()
        };
        let mut want = Vec::new();
        for (p, &p_valid) in pv.iter().enumerate() {
            for (b, &b_valid) in bv.iter().enumerate() {
                if p_valid && b_valid && p1.value(p) == b1.value(b) && p2.value(p) == b2.value(b) {
                    want.push((p as u32, b as u32));
                }
            }
        }
        let pairs: Vec<(u32, u32)> = got
            .probe
            .iter()
            .copied()
            .zip(got.build.iter().copied())
            .collect();
        assert!(
            pairs.windows(2).all(|w| w[0] < w[1]),
            "pairs come in probe, then build order"
        );
        assert_eq!(pairs, want, "{n_build} build rows, {n_probe} probe rows");
    }
}

/// A probe bringing its pairs to the host waits once, for its totals and its pairs
/// together, when its candidates fit the room it guessed; a build key more duplicated
/// than the guess overflows it, the probe is done again with exact sizes (the same
/// pairs), and the next probe of the table guesses from what it saw (more cases in
/// `queued.rs`).
#[test]
fn a_join_probe_waits_once_unless_its_candidates_outgrow_the_guess() {
    use fulmen_kernels::ops::join::JoinTable;
    // Counted on an emulated device of the test's own (the CUDA test device is shared by
    // every test); the matches are checked on the test device by the test above.
    let d = emulated();
    // 3000 build rows, each key 30 times; 2000 probe rows, each key once or absent.
    let build: Int64Array = (0..3000).map(|i| Some(i % 100)).collect();
    let probe: Int64Array = (0..2000).map(|i| Some(i * 7 % 150)).collect();
    let table = JoinTable::build(
        &d,
        vec![DeviceColumn::upload(&d, &build).unwrap()],
        None,
        3000,
        false,
    )
    .unwrap();
    let keys = DeviceColumn::upload(&d, &probe).unwrap();
    let mut want = Vec::new();
    for p in 0..2000u32 {
        for b in 0..3000u32 {
            if probe.value(p as usize) == build.value(b as usize) {
                want.push((p, b));
            }
        }
    }
    let mut syncs = Vec::new();
    for _ in 0..2 {
        let before = d.counts().syncs;
        let got = table.probe(&[&keys], None, 2000).unwrap();
        syncs.push(d.counts().syncs - before);
        let pairs: Vec<(u32, u32)> = got.probe.iter().copied().zip(got.build).collect();
        assert_eq!(pairs, want);
    }
    assert!(
        syncs[0] > 2,
        "the first probe overflowed its guess: {syncs:?}"
    );
    assert_eq!(
        syncs[1], 1,
        "then one wait for the totals and the pairs: {syncs:?}"
    );
}
