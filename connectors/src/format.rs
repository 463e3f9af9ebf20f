//! Message formats: Kafka message values to Arrow rows ([`Decoder`]) and back ([`Encoder`]).
//!
//! Decoding takes a chunk of messages at a time. The fast path decodes the whole chunk in one
//! go; when that fails or yields a different number of rows than messages, each message is
//! decoded alone so that exactly the bad ones are set aside, each with its error.

use std::sync::Arc;

use datafusion::arrow::array::{
    ArrayRef, BinaryArray, LargeStringArray, RecordBatch, RecordBatchOptions, StringArray,
};
use datafusion::arrow::compute::{cast, concat_batches};
use datafusion::arrow::datatypes::{DataType, SchemaRef};
use datafusion::error::{DataFusionError, Result};

use crate::avro::AvroCodec;
use crate::options::Format;

/// Messages decoded into rows, and the messages that could not be.
#[derive(Debug)]
pub struct Decoded {
    /// One row per good message, in message order.
    pub batch: RecordBatch,
    /// The positions (in the chunk) of the messages that made `batch`'s rows.
    pub good: Vec<usize>,
    /// The positions of undecodable messages, with the reason.
    pub bad: Vec<(usize, String)>,
}

/// Decodes message values into the payload columns of a table.
#[derive(Debug, Clone)]
pub struct Decoder {
    format: Format,
    schema: SchemaRef,
    avro: Option<Arc<AvroCodec>>,
}

impl Decoder {
    /// A decoder producing `schema` (the table's columns other than metadata columns).
    pub fn try_new(format: &Format, schema: SchemaRef) -> Result<Self> {
        let avro = match format {
            Format::Avro(spec) => Some(Arc::new(AvroCodec::try_new(spec, schema.clone())?)),
            _ => None,
        };
        if *format == Format::Raw {
            let ok = schema.fields().len() == 1
                && crate::live::is_text_or_bytes(schema.field(0).data_type());
            if !ok {
                return Err(DataFusionError::Configuration(
                    "format 'raw' needs exactly one column besides metadata columns, of type \
                     VARCHAR or BYTEA"
                        .into(),
                ));
            }
        }
        Ok(Self {
            format: format.clone(),
            schema,
            avro,
        })
    }

    /// Decodes `values` (a missing value is a message without a body).
    pub fn decode(&self, values: &[Option<&[u8]>]) -> Decoded {
        if values.is_empty() {
            return Decoded {
                batch: RecordBatch::new_empty(self.schema.clone()),
                good: Vec::new(),
                bad: Vec::new(),
            };
        }
        if self.format == Format::Raw {
            return self.decode_raw(values);
        }
        if let Some(avro) = &self.avro {
            return avro.decode(values);
        }
        if values.iter().all(|v| v.is_some())
            && let Ok(batch) = self.decode_text(values.iter().map(|v| v.unwrap_or_default()))
            && batch.num_rows() == values.len()
        {
            return Decoded {
                batch,
                good: (0..values.len()).collect(),
                bad: Vec::new(),
            };
        }
        let mut batches = Vec::new();
        let mut good = Vec::new();
        let mut bad = Vec::new();
        for (i, value) in values.iter().enumerate() {
            let Some(value) = value else {
                bad.push((i, "the message has no value".to_owned()));
                continue;
            };
            match self.decode_text(std::iter::once(*value)) {
                Ok(batch) if batch.num_rows() == 1 => {
                    batches.push(batch);
                    good.push(i);
                }
                Ok(batch) => bad.push((
                    i,
                    format!("the message holds {} records, not one", batch.num_rows()),
                )),
                Err(e) => bad.push((i, e.to_string())),
            }
        }
        let batch = concat_batches(&self.schema, &batches)
            .unwrap_or_else(|_| RecordBatch::new_empty(self.schema.clone()));
        Decoded { batch, good, bad }
    }

    fn decode_text<'a>(&self, values: impl Iterator<Item = &'a [u8]>) -> Result<RecordBatch> {
        let mut text = Vec::new();
        let mut count = 0;
        for value in values {
            count += 1;
            text.extend_from_slice(value);
            if !value.ends_with(b"\n") {
                text.push(b'\n');
            }
        }
        let batches: Vec<RecordBatch> = match self.format {
            Format::Json => {
                let reader = datafusion::arrow::json::ReaderBuilder::new(self.schema.clone())
                    .with_batch_size(count + 1)
                    .build(std::io::Cursor::new(text))?;
                reader.collect::<std::result::Result<_, _>>()?
            }
            Format::Csv { delimiter } => {
                let reader = datafusion::arrow::csv::ReaderBuilder::new(self.schema.clone())
                    .with_header(false)
                    .with_delimiter(delimiter)
                    .with_batch_size(count + 1)
                    .build(std::io::Cursor::new(text))?;
                reader.collect::<std::result::Result<_, _>>()?
            }
            Format::Raw | Format::Avro(_) => {
                unreachable!("raw and Avro values are not text records")
            }
        };
        Ok(concat_batches(&self.schema, &batches)?)
    }

    fn decode_raw(&self, values: &[Option<&[u8]>]) -> Decoded {
        let field = self.schema.field(0);
        let mut bad = Vec::new();
        let mut good = Vec::new();
        let column: ArrayRef =
            if matches!(field.data_type(), DataType::Binary | DataType::BinaryView) {
                good.extend(0..values.len());
                Arc::new(BinaryArray::from_iter(values.iter().copied()))
            } else {
                let mut texts = Vec::with_capacity(values.len());
                for (i, value) in values.iter().enumerate() {
                    match value.map(std::str::from_utf8) {
                        Some(Err(e)) => bad.push((i, format!("the value is not UTF-8 text: {e}"))),
                        Some(Ok(text)) => {
                            texts.push(Some(text));
                            good.push(i);
                        }
                        None => {
                            texts.push(None);
                            good.push(i);
                        }
                    }
                }
                Arc::new(StringArray::from(texts))
            };
        let column = match cast(&column, field.data_type()) {
            Ok(column) => column,
            Err(e) => {
                let bad = (0..values.len()).map(|i| (i, e.to_string())).collect();
                return Decoded {
                    batch: RecordBatch::new_empty(self.schema.clone()),
                    good: Vec::new(),
                    bad,
                };
            }
        };
        let options = RecordBatchOptions::new().with_row_count(Some(good.len()));
        let batch = RecordBatch::try_new_with_options(self.schema.clone(), vec![column], &options)
            .unwrap_or_else(|_| RecordBatch::new_empty(self.schema.clone()));
        Decoded { batch, good, bad }
    }
}

/// Writes rows as message values: each row of a batch becomes one message in the table's
/// format, holding the table's payload columns (taken from the batch by name and cast to
/// their declared types).
#[derive(Debug, Clone)]
pub struct Encoder {
    format: Format,
    schema: SchemaRef,
    avro: Option<Arc<AvroCodec>>,
}

impl Encoder {
    /// An encoder writing `schema` (the table's columns other than metadata columns).
    pub fn try_new(format: &Format, schema: SchemaRef) -> Result<Self> {
        let avro = match format {
            Format::Avro(spec) => {
                let codec = AvroCodec::try_new(spec, schema.clone())?;
                codec.check_writable()?;
                Some(Arc::new(codec))
            }
            _ => None,
        };
        Ok(Self {
            format: format.clone(),
            schema,
            avro,
        })
    }

    /// One message value per row of `batch`.
    pub fn encode(&self, batch: &RecordBatch) -> Result<Vec<Vec<u8>>> {
        let schema = &self.schema;
        let columns = schema
            .fields()
            .iter()
            .map(|field| {
                let column = batch.column_by_name(field.name()).ok_or_else(|| {
                    DataFusionError::Plan(format!("the query has no column '{}'", field.name()))
                })?;
                Ok(cast(column, field.data_type())?)
            })
            .collect::<Result<Vec<_>>>()?;
        let batch = RecordBatch::try_new_with_options(
            schema.clone(),
            columns,
            &RecordBatchOptions::new().with_row_count(Some(batch.num_rows())),
        )?;
        let mut out = Vec::with_capacity(batch.num_rows());
        match &self.format {
            Format::Avro(_) => {
                let avro = self.avro.as_ref().ok_or_else(|| {
                    DataFusionError::Internal("an Avro encoder without its codec".into())
                })?;
                out = avro.encode(&batch)?;
            }
            Format::Raw => {
                let column = batch.column(0);
                let column = match column.data_type() {
                    DataType::Binary | DataType::BinaryView => cast(column, &DataType::Binary)?,
                    _ => cast(column, &DataType::Utf8)?,
                };
                for row in 0..batch.num_rows() {
                    let value = if let Some(text) = column.as_any().downcast_ref::<StringArray>() {
                        text.value(row).as_bytes().to_vec()
                    } else if let Some(text) = column.as_any().downcast_ref::<LargeStringArray>() {
                        text.value(row).as_bytes().to_vec()
                    } else if let Some(bytes) = column.as_any().downcast_ref::<BinaryArray>() {
                        bytes.value(row).to_vec()
                    } else {
                        return Err(DataFusionError::Plan(
                            "format 'raw' writes one VARCHAR or BYTEA column".into(),
                        ));
                    };
                    out.push(value);
                }
            }
            Format::Json | Format::Csv { .. } => {
                let mut text = Vec::new();
                if let Format::Csv { delimiter } = self.format {
                    let mut writer = datafusion::arrow::csv::WriterBuilder::new()
                        .with_header(false)
                        .with_delimiter(delimiter)
                        .build(&mut text);
                    writer.write(&batch)?;
                } else {
                    let mut writer = datafusion::arrow::json::LineDelimitedWriter::new(&mut text);
                    writer.write(&batch)?;
                    writer.finish()?;
                }
                out.extend(
                    text.split(|b| *b == b'\n')
                        .filter(|line| !line.is_empty())
                        .map(<[u8]>::to_vec),
                );
            }
        }
        if out.len() != batch.num_rows() {
            return Err(DataFusionError::Internal(format!(
                "encoded {} messages for {} rows",
                out.len(),
                batch.num_rows()
            )));
        }
        Ok(out)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use datafusion::arrow::datatypes::{Field, Schema, TimeUnit};

    use crate::avro::{AvroSpec, Framing};

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("card", DataType::Utf8, true),
            Field::new("amount", DataType::Float64, true),
            Field::new("ts", DataType::Timestamp(TimeUnit::Millisecond, None), true),
        ]))
    }

    #[test]
    fn bad_messages_are_set_aside_one_by_one() {
        let decoder = Decoder::try_new(&Format::Json, schema()).unwrap();
        let values: Vec<Option<&[u8]>> = vec![
            Some(br#"{"card":"a","amount":1.5,"ts":"2026-01-01T00:00:00Z"}"#),
            Some(br#"{"card":"b","amount":"lots"}"#),
            Some(b"{not json"),
            None,
            Some(br#"{"card":"c","amount":2}{"card":"d"}"#),
            Some(br#"{"card":"e"}"#),
        ];
        let decoded = decoder.decode(&values);
        assert_eq!(decoded.good, vec![0, 5]);
        assert_eq!(decoded.batch.num_rows(), 2);
        let bad: Vec<usize> = decoded.bad.iter().map(|(i, _)| *i).collect();
        assert_eq!(bad, vec![1, 2, 3, 4]);

        let csv = Decoder::try_new(&Format::Csv { delimiter: b',' }, schema()).unwrap();
        let values: Vec<Option<&[u8]>> = vec![
            Some(b"a,1.5,2026-01-01T00:00:00"),
            Some(b"b,x,"),
            Some(b"c,2,"),
        ];
        let decoded = csv.decode(&values);
        assert_eq!(decoded.good, vec![0, 2]);
    }

    #[test]
    fn rows_round_trip_through_every_format() {
        let decoder = Decoder::try_new(&Format::Json, schema()).unwrap();
        let values: Vec<Option<&[u8]>> = vec![
            Some(br#"{"card":"a,b","amount":1.5,"ts":"2026-01-01T00:00:01Z"}"#),
            Some(br#"{"card":null,"amount":-2}"#),
        ];
        let batch = decoder.decode(&values).batch;
        let avro = |framing| {
            Format::Avro(Arc::new(crate::avro::AvroSpec {
                schema: None,
                framing,
            }))
        };
        for format in [
            Format::Json,
            Format::Csv { delimiter: b',' },
            avro(Framing::Confluent(7)),
            avro(Framing::SingleObject),
            avro(Framing::Bare),
        ] {
            let messages = Encoder::try_new(&format, schema())
                .unwrap()
                .encode(&batch)
                .unwrap();
            let refs: Vec<Option<&[u8]>> = messages.iter().map(|m| Some(m.as_slice())).collect();
            let again = Decoder::try_new(&format, schema()).unwrap().decode(&refs);
            assert!(again.bad.is_empty(), "{format:?}: {:?}", again.bad);
            assert_eq!(again.batch, batch, "{format:?}");
        }
    }

    /// A writer schema of the kind a producer registers: a timestamp-millis field, a
    /// nullable union, and a field the table does not read.
    pub(crate) const TX_SCHEMA: &str = r#"{"type":"record","name":"Tx","namespace":"bank","fields":[
        {"name":"card","type":"string"},
        {"name":"merchant","type":"string"},
        {"name":"amount","type":["null","double"]},
        {"name":"ts","type":{"type":"long","logicalType":"timestamp-millis"}}]}"#;

    fn tx_format(framing: Framing) -> Format {
        Format::Avro(Arc::new(AvroSpec {
            schema: Some(TX_SCHEMA.into()),
            framing,
        }))
    }

    /// Avro's binary encoding written out by hand: zig-zag varints, length-prefixed strings,
    /// union branch index, little-endian doubles.
    fn zigzag(v: i64) -> Vec<u8> {
        let mut n = ((v << 1) ^ (v >> 63)) as u64;
        let mut out = Vec::new();
        loop {
            if n < 0x80 {
                out.push(n as u8);
                return out;
            }
            out.push((n as u8 & 0x7f) | 0x80);
            n >>= 7;
        }
    }

    pub(crate) fn tx_body(card: &str, merchant: &str, amount: Option<f64>, ts_ms: i64) -> Vec<u8> {
        let mut out = Vec::new();
        for text in [card, merchant] {
            out.extend(zigzag(text.len() as i64));
            out.extend_from_slice(text.as_bytes());
        }
        match amount {
            None => out.extend(zigzag(0)),
            Some(a) => {
                out.extend(zigzag(1));
                out.extend_from_slice(&a.to_le_bytes());
            }
        }
        out.extend(zigzag(ts_ms));
        out
    }

    pub(crate) fn confluent(id: u32, body: &[u8]) -> Vec<u8> {
        let mut out = vec![0];
        out.extend_from_slice(&id.to_be_bytes());
        out.extend_from_slice(body);
        out
    }

    #[test]
    fn avro_records_are_read_by_field_name_and_bad_ones_set_aside() {
        let decoder = Decoder::try_new(&tx_format(Framing::Confluent(42)), schema()).unwrap();
        let good_a = confluent(42, &tx_body("c1", "shop", Some(12.5), 1_767_225_600_000));
        let good_b = confluent(42, &tx_body("c2", "cafe", None, 1_767_225_601_000));
        let other_id = confluent(43, &tx_body("c3", "x", Some(1.0), 0));
        let mut truncated = good_a.clone();
        truncated.truncate(good_a.len() - 3);
        let mut trailing = good_b.clone();
        trailing.extend_from_slice(&[1, 2, 3]);
        let unframed = tx_body("c4", "y", None, 0);
        let values: Vec<Option<&[u8]>> = vec![
            Some(&good_a),
            Some(&truncated),
            Some(&good_b),
            Some(&other_id),
            None,
            Some(&trailing),
            Some(&unframed),
            Some(&good_a),
        ];
        let decoded = decoder.decode(&values);
        // Again with the decoder the first call left behind, and once with more messages
        // than it holds rows.
        let again = decoder.decode(&values);
        assert_eq!(
            (again.good, again.batch),
            (decoded.good.clone(), decoded.batch.clone())
        );
        let many: Vec<Option<&[u8]>> = (0..5000).map(|_| Some(good_b.as_slice())).collect();
        let decoded_many = decoder.decode(&many);
        assert_eq!(
            (decoded_many.batch.num_rows(), decoded_many.bad.len()),
            (5000, 0)
        );
        assert_eq!(decoded.good, vec![0, 2, 7]);
        let bad: Vec<usize> = decoded.bad.iter().map(|(i, _)| *i).collect();
        assert_eq!(bad, vec![1, 3, 4, 5, 6], "{:?}", decoded.bad);
        assert!(
            decoded.bad[0].1.contains("undecodable Avro record"),
            "{:?}",
            decoded.bad
        );
        assert!(
            decoded.bad[1].1.contains("schema id 42"),
            "{:?}",
            decoded.bad
        );
        assert!(
            decoded.bad[3].1.contains("bytes after"),
            "{:?}",
            decoded.bad
        );
        let text = datafusion::arrow::util::pretty::pretty_format_batches(&[decoded.batch])
            .unwrap()
            .to_string();
        let expected = "\
+------+--------+---------------------+
| card | amount | ts                  |
+------+--------+---------------------+
| c1   | 12.5   | 2026-01-01T00:00:00 |
| c2   |        | 2026-01-01T00:00:01 |
| c1   | 12.5   | 2026-01-01T00:00:00 |
+------+--------+---------------------+";
        assert_eq!(text, expected);
    }

    #[test]
    fn avro_written_as_the_spec_lays_it_out() {
        let decoder = Decoder::try_new(&tx_format(Framing::Confluent(42)), schema()).unwrap();
        let body = tx_body("c1", "shop", Some(12.5), 1_767_225_600_000);
        let framed = confluent(42, &body);
        let batch = decoder.decode(&[Some(framed.as_slice())]).batch;
        // A sink table reading only card, amount and ts writes merchant (not nullable in the
        // schema) from nowhere: refused when the sink is created.
        let e = Encoder::try_new(&tx_format(Framing::Confluent(42)), schema()).unwrap_err();
        assert!(
            e.to_string().contains("field 'merchant' is not nullable"),
            "{e}"
        );
        let full = Arc::new(Schema::new(vec![
            Field::new("card", DataType::Utf8, true),
            Field::new("merchant", DataType::Utf8, true),
            Field::new("amount", DataType::Float64, true),
            Field::new("ts", DataType::Timestamp(TimeUnit::Millisecond, None), true),
        ]));
        let batch = RecordBatch::try_new(
            full.clone(),
            vec![
                batch.column(0).clone(),
                Arc::new(StringArray::from(vec!["shop"])),
                batch.column(1).clone(),
                batch.column(2).clone(),
            ],
        )
        .unwrap();
        for (framing, expected) in [
            (Framing::Confluent(42), framed.clone()),
            (Framing::Bare, body.clone()),
        ] {
            let encoder = Encoder::try_new(&tx_format(framing), full.clone()).unwrap();
            // Twice: the second batch goes through the writer the first one left behind.
            for _ in 0..2 {
                assert_eq!(
                    encoder.encode(&batch).unwrap(),
                    vec![expected.clone()],
                    "{framing:?}"
                );
            }
        }
        let single = Encoder::try_new(&tx_format(Framing::SingleObject), full.clone()).unwrap();
        let message = single.encode(&batch).unwrap().remove(0);
        assert_eq!(&message[..2], &[0xC3, 0x01]);
        assert_eq!(&message[10..], body.as_slice());
    }

    #[test]
    fn avro_options_are_checked_against_the_columns() {
        let e = Decoder::try_new(
            &tx_format(Framing::Bare),
            Arc::new(Schema::new(vec![Field::new("crad", DataType::Utf8, true)])),
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("column 'crad' is not a field of the Avro record (did you mean 'card'?)"),
            "{e}"
        );
        let e = Decoder::try_new(
            &tx_format(Framing::Bare),
            Arc::new(Schema::new(vec![Field::new(
                "ts",
                DataType::List(Arc::new(Field::new("item", DataType::Int32, true))),
                true,
            )])),
        )
        .unwrap_err();
        assert!(e.to_string().contains("column 'ts' is List"), "{e}");
        let e = Decoder::try_new(
            &tx_format(Framing::Bare),
            Arc::new(Schema::new(vec![Field::new("card", DataType::Int64, true)])),
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("column 'card' is Int64, but its Avro field reads as Utf8"),
            "{e}"
        );
        let broken = Format::Avro(Arc::new(AvroSpec {
            schema: Some("{\"type\": \"record\"".into()),
            framing: Framing::Bare,
        }));
        let e = Decoder::try_new(&broken, schema()).unwrap_err();
        assert!(e.to_string().contains("not a usable Avro schema"), "{e}");
    }

    /// The types `CREATE EXTERNAL TABLE` gives SQL's column types round-trip through Avro
    /// with the schema derived from the columns, NULLs included.
    #[test]
    fn sql_column_types_round_trip_through_derived_avro() {
        use datafusion::arrow::array::{
            BooleanArray, Date32Array, Decimal128Array, Float64Array, Int32Array, Int64Array,
            StringViewArray, TimestampNanosecondArray,
        };
        let schema = Arc::new(Schema::new(vec![
            Field::new("s", DataType::Utf8View, true),
            Field::new("i", DataType::Int32, true),
            Field::new("b", DataType::Int64, true),
            Field::new("f", DataType::Float64, true),
            Field::new("ok", DataType::Boolean, true),
            Field::new("d", DataType::Date32, true),
            Field::new("m", DataType::Decimal128(10, 2), true),
            Field::new("t", DataType::Timestamp(TimeUnit::Nanosecond, None), true),
        ]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(StringViewArray::from(vec![Some("héllo"), None, Some("")])),
                Arc::new(Int32Array::from(vec![Some(-7), Some(i32::MAX), None])),
                Arc::new(Int64Array::from(vec![None, Some(i64::MIN), Some(1)])),
                Arc::new(Float64Array::from(vec![Some(0.5), None, Some(-1e300)])),
                Arc::new(BooleanArray::from(vec![Some(true), Some(false), None])),
                Arc::new(Date32Array::from(vec![Some(20_454), None, Some(-1)])),
                Arc::new(
                    Decimal128Array::from(vec![Some(12_345), None, Some(-1)])
                        .with_precision_and_scale(10, 2)
                        .unwrap(),
                ),
                Arc::new(TimestampNanosecondArray::from(vec![
                    Some(1_767_225_600_123_456_789),
                    None,
                    Some(-1),
                ])),
            ],
        )
        .unwrap();
        for framing in [Framing::Confluent(1), Framing::SingleObject, Framing::Bare] {
            let format = Format::Avro(Arc::new(AvroSpec {
                schema: None,
                framing,
            }));
            let messages = Encoder::try_new(&format, schema.clone())
                .unwrap()
                .encode(&batch)
                .unwrap();
            let refs: Vec<Option<&[u8]>> = messages.iter().map(|m| Some(m.as_slice())).collect();
            let decoded = Decoder::try_new(&format, schema.clone())
                .unwrap()
                .decode(&refs);
            assert!(decoded.bad.is_empty(), "{framing:?}: {:?}", decoded.bad);
            assert_eq!(decoded.batch, batch, "{framing:?}");
        }
    }

    #[test]
    fn avro_values_that_do_not_fit_and_trailing_frames_are_set_aside_alone() {
        // amount NOT NULL; a long into an INT column.
        let schema = Arc::new(Schema::new(vec![
            Field::new("amount", DataType::Float64, false),
            Field::new("n", DataType::Int32, true),
        ]));
        let format = Format::Avro(Arc::new(AvroSpec {
            schema: Some(
                r#"{"type":"record","name":"R","fields":[
                    {"name":"amount","type":["null","double"]},{"name":"n","type":"long"}]}"#
                    .into(),
            ),
            framing: Framing::Confluent(3),
        }));
        let record = |amount: Option<f64>, n: i64| {
            let mut body = Vec::new();
            match amount {
                None => body.extend(zigzag(0)),
                Some(a) => {
                    body.extend(zigzag(1));
                    body.extend_from_slice(&a.to_le_bytes());
                }
            }
            body.extend(zigzag(n));
            confluent(3, &body)
        };
        let ok = record(Some(1.5), 7);
        let null_amount = record(None, 8);
        let too_big = record(Some(2.5), 1 << 40);
        // A record followed by one more frame prefix: read whole, it would leave the
        // decoder waiting for a body.
        let mut trailing_frame = record(Some(3.5), 9);
        trailing_frame.extend_from_slice(&[0, 0, 0, 0, 3]);
        let values: Vec<Option<&[u8]>> = vec![
            Some(&ok),
            Some(&null_amount),
            Some(&too_big),
            Some(&trailing_frame),
            Some(&ok),
        ];
        let decoder = Decoder::try_new(&format, schema).unwrap();
        for _ in 0..2 {
            let decoded = decoder.decode(&values);
            assert_eq!(decoded.good, vec![0, 4], "{:?}", decoded.bad);
            assert_eq!(decoded.batch.num_rows(), 2);
            let reasons: Vec<&str> = decoded.bad.iter().map(|(_, r)| r.as_str()).collect();
            assert!(reasons[0].contains("'amount' is null"), "{reasons:?}");
            assert!(reasons[1].contains("does not fit"), "{reasons:?}");
            assert!(reasons[2].contains("bytes after"), "{reasons:?}");
        }
    }

    #[test]
    fn avro_fields_naming_a_type_defined_by_a_skipped_field_are_read() {
        let format = Format::Avro(Arc::new(AvroSpec {
            schema: Some(
                r#"{"type":"record","name":"P","fields":[
                    {"name":"home","type":{"type":"record","name":"Addr",
                        "fields":[{"name":"city","type":"string"}]}},
                    {"name":"work","type":"Addr"}]}"#
                    .into(),
            ),
            framing: Framing::Bare,
        }));
        let city = Field::new("city", DataType::Utf8, false);
        let schema = Arc::new(Schema::new(vec![Field::new(
            "work",
            DataType::Struct(vec![city].into()),
            true,
        )]));
        let decoder = Decoder::try_new(&format, schema).unwrap();
        let mut body = Vec::new();
        for text in ["Oslo", "Bergen"] {
            body.extend(zigzag(text.len() as i64));
            body.extend_from_slice(text.as_bytes());
        }
        let decoded = decoder.decode(&[Some(body.as_slice())]);
        assert!(decoded.bad.is_empty(), "{:?}", decoded.bad);
        let text = datafusion::arrow::util::pretty::pretty_format_batches(&[decoded.batch])
            .unwrap()
            .to_string();
        assert!(text.contains("{city: Bergen}"), "{text}");
    }
}
