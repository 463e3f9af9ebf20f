//! Dictionary-encoded strings (the cache's encoding of low-cardinality string columns):
//! downloads, gathers, concatenations, programs and join keys give what the same strings
//! held plainly give, and only the codes move.

use std::collections::HashMap;

use arrow::compute::{cast, concat};
use fulmen_kernels::column::{DeviceDictionary, Layout};
use fulmen_kernels::ops::expr::{self, Cmp, Op, OutKind, Program};
use fulmen_kernels::ops::join::JoinTable;

use super::*;

/// `n` strings from `distinct` values (one of them empty, one with a multi-byte letter),
/// `nulls` percent NULL; and their encoding: the dictionary, in first-seen order, and the
/// codes (0 under a NULL).
fn encoded(
    n: usize,
    distinct: usize,
    nulls: u64,
    seed: u64,
) -> (StringArray, StringArray, UInt32Array) {
    let mut r = Lcg(seed);
    let words: Vec<String> = (0..distinct)
        .map(|k| match k {
            0 => String::new(),
            1 => "Zürich".to_string(),
            _ => format!("value-{k}-{}", "x".repeat(k % 7)),
        })
        .collect();
    let strings: StringArray = (0..n)
        .map(|_| (!r.chance(nulls)).then(|| words[r.next() as usize % distinct].clone()))
        .collect();
    let mut seen: HashMap<&str, u32> = HashMap::new();
    let mut dictionary: Vec<&str> = Vec::new();
    let codes: UInt32Array = strings
        .iter()
        .map(|s| match s {
            None => Some(0),
            Some(s) => Some(*seen.entry(s).or_insert_with(|| {
                dictionary.push(s);
                dictionary.len() as u32 - 1
            })),
        })
        .collect();
    if dictionary.is_empty() {
        dictionary.push("");
    }
    let codes = UInt32Array::new(codes.values().clone(), strings.nulls().cloned());
    (strings.clone(), StringArray::from(dictionary), codes)
}

fn on_device(d: &Device, dictionary: &StringArray, codes: &UInt32Array) -> DeviceColumn {
    let dictionary = DeviceDictionary::upload(d, dictionary).expect("dictionary upload");
    let codes = DeviceColumn::upload(d, codes).expect("codes upload");
    // SAFETY: `encoded` makes every code an index into its dictionary.
    unsafe { DeviceColumn::with_dictionary(codes, dictionary) }.expect("dictionary column")
}

fn as_utf8(array: &ArrayRef) -> ArrayRef {
    cast(array, &DataType::Utf8).expect("cast to utf8")
}

#[test]
fn a_dictionary_column_downloads_gathers_and_decodes_as_its_strings() {
    let d = device();
    for (k, &n) in SIZES.iter().enumerate() {
        let (strings, dictionary, codes) = encoded(n, 1 + k % 9, 20, k as u64);
        let column = on_device(&d, &dictionary, &codes);
        assert_eq!(column.layout(), Layout::Dict);
        assert_eq!(
            column.device_bytes(),
            n * 4 + codes.nulls().map_or(0, |_| n.div_ceil(8))
        );
        let want: ArrayRef = Arc::new(strings.clone());
        let got = column.to_arrow().expect("download");
        assert!(
            matches!(got.data_type(), DataType::Dictionary(..)),
            "{n} rows"
        );
        assert_eq!(&as_utf8(&got), &want, "download of {n} rows");
        let decoded = column.decoded().expect("decode");
        assert_eq!(decoded.layout(), Layout::Var(4));
        assert_eq!(
            &decoded.to_arrow().expect("download"),
            &want,
            "decoded, {n} rows"
        );
        // A gather moves the codes and keeps the dictionary.
        let mut r = Lcg(n as u64);
        let picks: Vec<u32> = (0..n / 2 + 3)
            .map(|_| match (n, r.chance(10)) {
                (0, _) | (_, true) => NULL_INDEX,
                _ => (r.next() % n as u64) as u32,
            })
            .collect();
        let indices = RowIndices::upload(&d, &picks, n).expect("indices");
        let gathered = gather::gather_column(&column, &indices).expect("gather");
        assert!(Arc::ptr_eq(
            gathered.dictionary().expect("still encoded"),
            column.dictionary().expect("encoded")
        ));
        let taken = take(
            &want,
            &UInt32Array::from_iter(picks.iter().map(|&i| (i != NULL_INDEX).then_some(i))),
            None,
        )
        .expect("arrow take");
        assert_eq!(
            &as_utf8(&gathered.to_arrow().expect("download")),
            &taken,
            "gather of {n}"
        );
    }
}

#[test]
fn dictionary_pieces_concatenate_by_their_codes_or_by_their_strings() {
    let d = device();
    let (a, dictionary, codes_a) = encoded(1000, 5, 10, 1);
    let column_a = on_device(&d, &dictionary, &codes_a);
    // Codes of the same dictionary (the cache's chunks of one column).
    let dictionary_shared = Arc::clone(column_a.dictionary().expect("encoded"));
    let (_, _, codes_b) = encoded(333, 5, 0, 1);
    let b: StringArray = codes_b
        .iter()
        .map(|c| c.map(|c| dictionary.value(c as usize).to_string()))
        .collect();
    let codes_b = DeviceColumn::upload(&d, &codes_b).expect("codes upload");
    // SAFETY: the codes come from the same encoding of the same five values.
    let column_b = unsafe { DeviceColumn::with_dictionary(codes_b, dictionary_shared) }
        .expect("dictionary column");
    let joined = concat_columns(&d, &[column_a.clone(), column_b.clone()]).expect("concat");
    assert!(
        joined.dictionary().is_some(),
        "one dictionary: the codes are joined"
    );
    let want = concat(&[&a as &dyn Array, &b]).expect("arrow concat");
    assert_eq!(&as_utf8(&joined.to_arrow().expect("download")), &want);
    // Another dictionary, and a plain piece: the strings are joined.
    let (c, dictionary_c, codes_c) = encoded(70, 3, 30, 9);
    let column_c = on_device(&d, &dictionary_c, &codes_c);
    let (plain, _, _) = encoded(41, 4, 30, 11);
    let column_plain = DeviceColumn::upload(&d, &plain).expect("upload");
    let mixed = concat_columns(&d, &[column_a, column_c, column_plain, column_b]).expect("concat");
    assert_eq!(mixed.layout(), Layout::Var(4));
    let want = concat(&[&a as &dyn Array, &c, &plain, &b]).expect("arrow concat");
    assert_eq!(&mixed.to_arrow().expect("download"), &want);
}

use fulmen_kernels::ops::concat::concat_columns;

/// `column = 'value-3-xxx' OR column LIKE 'Z%'`, and the column's length test through a
/// string comparison, over a dictionary column and over the same strings held plainly.
#[test]
fn programs_read_a_dictionary_column_as_its_strings() {
    let d = device();
    let mut program = Program::new();
    program.push(Op::LoadStr32, 0, 0);
    let k = program.string_constant(b"value-3-xxx");
    program.push(Op::StrConst, 0, k);
    program.push(Op::CmpS, Cmp::Eq as i64, 0);
    program.push(Op::LoadStr32, 0, 0);
    let k = program.string_constant(b"Z");
    program.push(Op::StrConst, 0, k);
    program.push(Op::StrPrefix, 0, 0);
    program.push(Op::Or, 0, 0);
    program.output(OutKind::Bool, DataType::Boolean);
    program.push(Op::LoadStr32, 0, 0);
    let k = program.string_constant(b"value-5");
    program.push(Op::StrConst, 0, k);
    program.push(Op::CmpS, Cmp::Lt as i64, 0);
    program.output(OutKind::Bool, DataType::Boolean);
    for (k, &n) in SIZES.iter().enumerate() {
        let (strings, dictionary, codes) = encoded(n, 8, 15, 100 + k as u64);
        let column = on_device(&d, &dictionary, &codes);
        let plain = DeviceColumn::upload(&d, &strings).expect("upload");
        let run = |c: &DeviceColumn| -> Vec<ArrayRef> {
            expr::evaluate(&d, &program, &[c], n)
                .expect("evaluate")
                .expect("no row left to the CPU")
                .iter()
                .map(|o| o.to_arrow().expect("download"))
                .collect()
        };
        let (got, want) = (run(&column), run(&plain));
        assert_eq!(got, want, "{n} rows");
        if n > 1000 {
            let hits = got[0].as_boolean().true_count();
            assert!(hits > 0 && hits < n, "the test selects some rows: {hits}");
        }
    }
}

#[test]
fn join_keys_of_a_dictionary_column_match_by_their_strings() {
    let d = device();
    let (build, dictionary, codes) = encoded(5000, 6, 10, 21);
    let build_column = on_device(&d, &dictionary, &codes);
    // The probe side in another dictionary of the same values (another table's column).
    let (probe, probe_dictionary, probe_codes) = encoded(3000, 6, 10, 22);
    assert_ne!(dictionary, probe_dictionary, "the encodings differ");
    for probe_column in [
        on_device(&d, &probe_dictionary, &probe_codes),
        DeviceColumn::upload(&d, &probe).expect("upload"),
    ] {
        let table = JoinTable::build(&d, vec![build_column.clone()], None, build.len(), false)
            .expect("build");
        let matches = table
            .probe(&[&probe_column], None, probe.len())
            .expect("probe");
        let mut got: Vec<(u32, u32)> = matches
            .build
            .iter()
            .copied()
            .zip(matches.probe.iter().copied())
            .collect();
        got.sort_unstable();
        let mut want = Vec::new();
        for (j, p) in probe.iter().enumerate() {
            for (i, b) in build.iter().enumerate() {
                if p.is_some() && p == b {
                    want.push((i as u32, j as u32));
                }
            }
        }
        want.sort_unstable();
        assert!(!want.is_empty());
        assert_eq!(got, want, "probe {}", probe_column.data_type());
    }
    // A dictionary column hashes as its strings, not as its codes.
    let plain = DeviceColumn::upload(&d, &build).expect("upload");
    let hashes = |c: &DeviceColumn| {
        let words = hash::hash_columns(&d, &[c])
            .expect("hash")
            .to_host()
            .expect("read");
        words[..build.len() * 8].to_vec()
    };
    assert_eq!(hashes(&build_column), hashes(&plain));
}

/// Groups of dictionary-encoded keys, from two dictionaries and from plain strings in one
/// table, are one group per string, and come back as the table's key type.
#[test]
fn group_keys_of_dictionaries_and_plain_strings_meet_by_their_strings() {
    use fulmen_kernels::ops::aggregate::{GroupTable, UpdateWith};
    let d = device();
    let mut table = GroupTable::new(&d, &[DataType::Utf8], &[]).expect("table");
    let mut all: Vec<Option<String>> = Vec::new();
    for (k, seed) in [31u64, 32, 33].into_iter().enumerate() {
        let (strings, dictionary, codes) = encoded(2000 + 7 * k, 6, 10, seed);
        let column = match k {
            1 => DeviceColumn::upload(&d, &strings).expect("upload"),
            _ => on_device(&d, &dictionary, &codes),
        };
        table
            .insert_groups(&[&column], strings.len(), UpdateWith::default())
            .expect("insert");
        all.extend(strings.iter().map(|s| s.map(str::to_string)));
    }
    let keys = table.keys().expect("keys");
    assert_eq!(keys[0].data_type(), &DataType::Utf8);
    let mut got: Vec<Option<String>> = keys[0]
        .as_string::<i32>()
        .iter()
        .map(|s| s.map(str::to_string))
        .collect();
    got.sort();
    all.sort();
    all.dedup();
    assert_eq!(got, all, "one group per string (and one for NULL)");
}

/// Decoding a dictionary of short strings (a concatenation with pieces of another
/// dictionary) queues its gather without waiting for the host: the bytes are sized by the
/// longest string.
#[test]
fn decoding_short_strings_waits_for_nothing() {
    let d = emulated();
    let (strings, dictionary, codes) = encoded(70_001, 7, 10, 5);
    let column = on_device(&d, &dictionary, &codes);
    let syncs = d.counts().syncs;
    let decoded = column.decoded().expect("decode");
    assert_eq!(d.counts().syncs, syncs, "decoding waited for the host");
    let want: ArrayRef = Arc::new(strings);
    assert_eq!(&decoded.to_arrow().expect("download"), &want);
}
