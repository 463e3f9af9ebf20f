//! Columns concatenated on the device: every type's pieces, with NULLs or without, empty
//! pieces and pieces not a multiple of eight rows, give what Arrow's `concat` gives, and
//! the host waits for nothing while they are joined.

use arrow::compute::concat;
use fulmen_kernels::ops::concat::concat_columns;

use super::*;

/// `count_waits` on a device of the test's own (the CUDA test device is shared by every
/// test, whose waits it would count).
fn check_pieces(d: &Device, sizes: &[usize], nulls: u64, seed: u64, count_waits: bool) {
    let pieces: Vec<Vec<ArrayRef>> = sizes
        .iter()
        .enumerate()
        .map(|(k, &n)| random_columns(n, seed + k as u64, nulls))
        .collect();
    for c in 0..pieces[0].len() {
        let arrays: Vec<&dyn Array> = pieces.iter().map(|p| p[c].as_ref()).collect();
        let on_device: Vec<DeviceColumn> = arrays
            .iter()
            .map(|a| DeviceColumn::upload(d, *a).expect("upload"))
            .collect();
        let syncs = d.counts().syncs;
        let joined = concat_columns(d, &on_device).expect("concat");
        if count_waits {
            assert_eq!(d.counts().syncs, syncs, "concatenating waited for the host");
        }
        let got = joined.to_arrow().expect("download");
        let want = concat(&arrays).expect("arrow concat");
        let t = want.data_type();
        assert_eq!(got.len(), want.len(), "{t}, pieces {sizes:?}");
        assert_eq!(&got, &want, "{t}, pieces {sizes:?}, {nulls}% NULL");
    }
}

#[test]
fn concatenated_pieces_are_arrows_concat() {
    let (d, own) = (device(), emulated());
    let layouts: &[&[usize]] = &[
        &[1, 1],
        &[3, 0, 13, 5],
        &[0, 0, 7],
        &[8, 16, 1],
        &[31, 33, 257],
        &[1025, 5000, 1, 70_001],
    ];
    for (k, sizes) in layouts.iter().enumerate() {
        for nulls in [0, 10, 100] {
            check_pieces(&d, sizes, nulls, 1000 * k as u64 + nulls, false);
            check_pieces(&own, sizes, nulls, 1000 * k as u64 + nulls, true);
        }
    }
}

/// Some pieces with NULLs and some without: the bits of those without are set.
#[test]
fn pieces_with_and_without_nulls_concatenate() {
    let d = device();
    let with: ArrayRef = Arc::new(Int32Array::from(vec![Some(1), None, Some(3)]));
    let without: ArrayRef = Arc::new(Int32Array::from_iter_values(0..11));
    let strings: ArrayRef = Arc::new(StringArray::from(vec![None, Some("é"), Some("")]));
    let plain: ArrayRef = Arc::new(StringArray::from(vec!["ab", "cde"]));
    for arrays in [
        vec![without.clone(), with, without],
        vec![plain.clone(), strings, plain],
    ] {
        let refs: Vec<&dyn Array> = arrays.iter().map(|a| a.as_ref()).collect();
        let pieces: Vec<DeviceColumn> = refs
            .iter()
            .map(|a| DeviceColumn::upload(&d, *a).expect("upload"))
            .collect();
        let got = concat_columns(&d, &pieces)
            .expect("concat")
            .to_arrow()
            .expect("download");
        assert_eq!(&got, &concat(&refs).expect("arrow concat"));
    }
}

/// A piece read for fewer rows than its buffers hold (a prefix) keeps only its rows: the
/// next piece's strings follow its last row's bytes, not its buffer's end.
#[test]
fn a_prefix_piece_keeps_only_its_rows() {
    let d = device();
    let a: ArrayRef = Arc::new(StringArray::from(vec!["one", "two", "three"]));
    let b: ArrayRef = Arc::new(StringArray::from(vec!["four", "five"]));
    let pieces = vec![
        DeviceColumn::upload(&d, a.as_ref())
            .expect("upload")
            .prefix(2),
        DeviceColumn::upload(&d, b.as_ref()).expect("upload"),
    ];
    let got = concat_columns(&d, &pieces)
        .expect("concat")
        .to_arrow()
        .expect("download");
    let want: ArrayRef = Arc::new(StringArray::from(vec!["one", "two", "four", "five"]));
    assert_eq!(&got, &want);
}

/// Pieces of different types, or on another device, are refused with a typed error.
#[test]
fn mismatched_pieces_are_refused() {
    let d = emulated();
    let other = Device::emulated(1, &EmulatorOptions::default());
    let int = DeviceColumn::upload(&d, &Int32Array::from(vec![1])).expect("upload");
    let long = DeviceColumn::upload(&d, &Int64Array::from(vec![1])).expect("upload");
    let e = concat_columns(&d, &[int.clone(), long]).expect_err("types differ");
    assert!(matches!(e, KernelError::Unsupported(_)), "{e}");
    let away = DeviceColumn::upload(&other, &Int32Array::from(vec![2])).expect("upload");
    let e = concat_columns(&d, &[int, away]).expect_err("devices differ");
    assert!(matches!(e, KernelError::Unsupported(_)), "{e}");
    let e = concat_columns(&d, &[]).expect_err("nothing to join");
    assert!(matches!(e, KernelError::InvalidData(_)), "{e}");
}
