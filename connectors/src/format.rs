//! Message formats: Kafka message values to Arrow rows ([`Decoder`]) and back ([`encode`]).
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
}

impl Decoder {
    /// A decoder producing `schema` (the table's columns other than metadata columns).
    pub fn try_new(format: Format, schema: SchemaRef) -> Result<Self> {
        if format == Format::Raw {
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
        Ok(Self { format, schema })
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
            Format::Raw => unreachable!("raw values are not text records"),
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

/// Encodes each row of `batch` as one message value in `format`, writing the columns of
/// `schema` (taken from `batch` by name and cast to their declared types).
pub fn encode(format: Format, schema: &SchemaRef, batch: &RecordBatch) -> Result<Vec<Vec<u8>>> {
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
    match format {
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
            match format {
                Format::Json => {
                    let mut writer = datafusion::arrow::json::LineDelimitedWriter::new(&mut text);
                    writer.write(&batch)?;
                    writer.finish()?;
                }
                Format::Csv { delimiter } => {
                    let mut writer = datafusion::arrow::csv::WriterBuilder::new()
                        .with_header(false)
                        .with_delimiter(delimiter)
                        .build(&mut text);
                    writer.write(&batch)?;
                }
                Format::Raw => unreachable!(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::arrow::datatypes::{Field, Schema, TimeUnit};

    fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("card", DataType::Utf8, true),
            Field::new("amount", DataType::Float64, true),
            Field::new("ts", DataType::Timestamp(TimeUnit::Millisecond, None), true),
        ]))
    }

    #[test]
    fn bad_messages_are_set_aside_one_by_one() {
        let decoder = Decoder::try_new(Format::Json, schema()).unwrap();
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

        let csv = Decoder::try_new(Format::Csv { delimiter: b',' }, schema()).unwrap();
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
        let decoder = Decoder::try_new(Format::Json, schema()).unwrap();
        let values: Vec<Option<&[u8]>> = vec![
            Some(br#"{"card":"a,b","amount":1.5,"ts":"2026-01-01T00:00:01Z"}"#),
            Some(br#"{"card":null,"amount":-2}"#),
        ];
        let batch = decoder.decode(&values).batch;
        for format in [Format::Json, Format::Csv { delimiter: b',' }] {
            let messages = encode(format, &schema(), &batch).unwrap();
            let refs: Vec<Option<&[u8]>> = messages.iter().map(|m| Some(m.as_slice())).collect();
            let again = Decoder::try_new(format, schema()).unwrap().decode(&refs);
            assert!(again.bad.is_empty(), "{format:?}: {:?}", again.bad);
            assert_eq!(again.batch, batch, "{format:?}");
        }
    }
}
