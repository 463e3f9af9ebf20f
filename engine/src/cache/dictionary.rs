//! Dictionary encoding of a cached table's low-cardinality string columns
//! (`fulmen.cache.dictionary_limit`).
//!
//! A string column whose first chunk holds at most the limit of distinct values, and at
//! most one per two rows, is held on the devices as u32 codes into one dictionary of its
//! strings, the same for all its chunks (one copy on each device that holds some). Codes
//! are given in the order values are first seen, so a chunk's codes stay valid as later
//! chunks add values. A column that passes the limit later is given up: the load starts
//! again with it held plainly (`Encoders::encode` says which).
//!
//! Programs read an encoded column as its strings, through the dictionary, and gathers,
//! concatenations and downloads move only the codes (`fulmen_kernels::column`); as join and
//! group keys it hashes and compares by the strings its codes stand for.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use datafusion::arrow::array::{Array, ArrayRef, AsArray, RecordBatch, StringArray, UInt32Array};
use datafusion::arrow::datatypes::{DataType, Field, Schema};

/// The string values of a column of strings, or `None` for other types.
/// (Not `LargeUtf8`: plans read it with 64-bit offsets, and an encoded column reads as
/// utf8.)
fn strings(column: &dyn Array) -> Option<Box<dyn Iterator<Item = Option<&str>> + '_>> {
    Some(match column.data_type() {
        DataType::Utf8 => Box::new(column.as_string::<i32>().iter()),
        DataType::Utf8View => Box::new(column.as_string_view().iter()),
        _ => return None,
    })
}

/// The most bytes of strings one dictionary holds: a column whose distinct values take more
/// is held plainly (a dictionary's strings keep 32-bit offsets, and each device holding
/// some of the table holds a copy).
const DICTIONARY_BYTES: usize = 64 << 20;

/// One column's dictionary so far.
#[derive(Debug, Default)]
struct Encoder {
    codes: HashMap<String, u32>,
    values: Vec<String>,
    /// The values' bytes.
    bytes: usize,
}

/// The encoders of a table's columns while it is cached.
#[derive(Debug)]
pub(super) struct Encoders {
    limit: usize,
    /// Columns never to encode (they passed the limit in an earlier try).
    plain: BTreeSet<usize>,
    /// By column: its encoder, when it is encoded; `None` until the first chunk decides.
    columns: Option<Vec<Option<Encoder>>>,
}

impl Encoders {
    /// Encoders for columns of at most `limit` distinct values (0: none), except `plain`.
    pub(super) fn new(limit: usize, plain: BTreeSet<usize>) -> Self {
        Self {
            limit,
            plain,
            columns: None,
        }
    }

    /// The first chunk decides which string columns (utf8 or utf8 views) are encoded.
    fn decide(&self, chunk: &RecordBatch) -> Vec<Option<Encoder>> {
        let rows = chunk.num_rows();
        (0..chunk.num_columns())
            .map(|c| {
                if self.limit == 0 || self.plain.contains(&c) {
                    return None;
                }
                let values = strings(chunk.column(c).as_ref())?;
                let mut distinct = HashSet::new();
                for value in values.flatten() {
                    distinct.insert(value);
                    if distinct.len() > self.limit || distinct.len() * 2 > rows {
                        return None;
                    }
                }
                Some(Encoder::default())
            })
            .collect()
    }

    /// `chunk` with the strings of its encoded columns replaced by their codes (UInt32,
    /// 0 under a NULL); `Err(c)` when column `c` passed the limit.
    pub(super) fn encode(&mut self, chunk: RecordBatch) -> std::result::Result<RecordBatch, usize> {
        if self.columns.is_none() {
            self.columns = Some(self.decide(&chunk));
        }
        let encoders = self.columns.as_mut().unwrap_or_else(|| unreachable!());
        if encoders.iter().all(Option::is_none) {
            return Ok(chunk);
        }
        let schema = chunk.schema();
        let mut fields = Vec::with_capacity(chunk.num_columns());
        let mut columns = Vec::with_capacity(chunk.num_columns());
        for (c, (field, column)) in schema.fields().iter().zip(chunk.columns()).enumerate() {
            let (Some(encoder), Some(values)) = (&mut encoders[c], strings(column.as_ref())) else {
                fields.push(Arc::clone(field));
                columns.push(Arc::clone(column));
                continue;
            };
            let mut codes = Vec::with_capacity(column.len());
            for value in values {
                let code = match value {
                    None => 0,
                    Some(v) => match encoder.codes.get(v) {
                        Some(&code) => code,
                        None => {
                            if encoder.values.len() >= self.limit
                                || encoder.bytes + v.len() > DICTIONARY_BYTES
                            {
                                return Err(c);
                            }
                            encoder.bytes += v.len();
                            let code = encoder.values.len() as u32;
                            encoder.codes.insert(v.to_string(), code);
                            encoder.values.push(v.to_string());
                            code
                        }
                    },
                };
                codes.push(code);
            }
            let codes = UInt32Array::new(codes.into(), column.logical_nulls());
            fields.push(Arc::new(Field::new(
                field.name(),
                DataType::UInt32,
                field.is_nullable(),
            )));
            columns.push(Arc::new(codes) as ArrayRef);
        }
        let schema = Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()));
        // The same rows: only the columns' types change.
        Ok(RecordBatch::try_new(schema, columns).unwrap_or_else(|_| unreachable!()))
    }

    /// The dictionary of each encoded column (at least one string: an empty one for a
    /// column of NULLs), by column.
    pub(super) fn dictionaries(&self) -> Vec<(usize, StringArray)> {
        let Some(columns) = &self.columns else {
            return Vec::new();
        };
        columns
            .iter()
            .enumerate()
            .filter_map(|(c, e)| {
                let e = e.as_ref()?;
                let values = match e.values.is_empty() {
                    true => StringArray::from(vec![""]),
                    false => StringArray::from_iter_values(&e.values),
                };
                Some((c, values))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::array::StringViewArray;

    fn batch(values: Vec<Option<&str>>, other: Vec<&str>) -> RecordBatch {
        let schema = Schema::new(vec![
            Field::new("a", DataType::Utf8View, true),
            Field::new("b", DataType::Utf8, false),
        ]);
        RecordBatch::try_new(
            Arc::new(schema),
            vec![
                Arc::new(StringViewArray::from(values)),
                Arc::new(StringArray::from(other)),
            ],
        )
        .unwrap()
    }

    #[test]
    fn low_cardinality_columns_are_coded_in_first_seen_order_until_the_limit() {
        let mut e = Encoders::new(3, BTreeSet::new());
        // `b` has as many values as rows: not encoded.
        let first = e
            .encode(batch(
                vec![Some("x"), None, Some("y"), Some("x")],
                vec!["1", "2", "3", "4"],
            ))
            .unwrap();
        assert_eq!(first.schema().field(0).data_type(), &DataType::UInt32);
        assert_eq!(first.schema().field(1).data_type(), &DataType::Utf8);
        let codes = first
            .column(0)
            .as_primitive::<datafusion::arrow::datatypes::UInt32Type>();
        assert_eq!(
            codes.iter().collect::<Vec<_>>(),
            [Some(0), None, Some(1), Some(0)]
        );
        let second = e
            .encode(batch(vec![Some("z"), Some("y")], vec!["5", "6"]))
            .unwrap();
        let codes = second
            .column(0)
            .as_primitive::<datafusion::arrow::datatypes::UInt32Type>();
        assert_eq!(codes.values().to_vec(), [2, 1]);
        let dictionaries = e.dictionaries();
        assert_eq!(dictionaries.len(), 1);
        assert_eq!(dictionaries[0].0, 0);
        assert_eq!(
            dictionaries[0].1.iter().collect::<Vec<_>>(),
            [Some("x"), Some("y"), Some("z")]
        );
        // A fourth value passes the limit of 3.
        assert_eq!(e.encode(batch(vec![Some("w")], vec!["7"])).unwrap_err(), 0);
        // Asked to keep column 0 plain, or with no limit, nothing is encoded.
        for mut e in [
            Encoders::new(3, BTreeSet::from([0])),
            Encoders::new(0, BTreeSet::new()),
        ] {
            let b = batch(vec![Some("x"), Some("x")], vec!["1", "1"]);
            let out = e.encode(b.clone()).unwrap();
            assert_eq!(out.schema().field(0).data_type(), &DataType::Utf8View);
            assert!(e.dictionaries().iter().all(|(c, _)| *c != 0));
        }
        // Large utf8 is read with 64-bit offsets: held plainly.
        let schema = Schema::new(vec![Field::new("l", DataType::LargeUtf8, false)]);
        let large = RecordBatch::try_new(
            Arc::new(schema),
            vec![Arc::new(datafusion::arrow::array::LargeStringArray::from(
                vec!["x"; 4],
            ))],
        )
        .unwrap();
        let mut e = Encoders::new(3, BTreeSet::new());
        let out = e.encode(large).unwrap();
        assert_eq!(out.schema().field(0).data_type(), &DataType::LargeUtf8);
        assert!(e.dictionaries().is_empty());
    }
}
