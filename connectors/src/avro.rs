//! Avro message values (`'format' 'avro'`), through `arrow-avro`.
//!
//! Every message holds one Avro record, framed one of three ways ([`Framing`]): Confluent's
//! wire format (a zero byte and the registry's 4-byte schema id), Avro's single-object
//! encoding (`C3 01` and the schema's 8-byte Rabin fingerprint), or bare (the record alone).
//! Without a schema registry to ask, the writer schema is the table's option
//! `'avro.schema'`, or, where that is absent, the one `arrow-avro` derives from the table's
//! columns. A message framed with any other schema id or fingerprint is undecodable (counted
//! and dead-lettered like any bad message). Table columns are matched to the record's
//! top-level fields by name and cast to their declared types; fields no column names are
//! skipped.
//!
//! `arrow-avro`'s streaming decoder appends a record field by field, so a bad record leaves
//! it half-written: the good messages since the last bad one are then decoded again in a
//! fresh decoder, which goes on with the rest (each message is decoded at most twice).

use std::sync::{Arc, Mutex};

use arrow_avro::reader::{Decoder as AvroStreamDecoder, ReaderBuilder};
use arrow_avro::schema::{
    AvroSchema, CONFLUENT_MAGIC, Fingerprint, FingerprintAlgorithm, FingerprintStrategy,
    SCHEMA_METADATA_KEY, SINGLE_OBJECT_MAGIC, SchemaStore,
};
use arrow_avro::writer::format::{AvroBinaryFormat, AvroSoeFormat};
use arrow_avro::writer::{Encoder as AvroRowEncoder, WriterBuilder};
use datafusion::arrow::array::{
    Array, ArrayRef, BooleanArray, RecordBatch, RecordBatchOptions, new_null_array,
};
use datafusion::arrow::compute::{can_cast_types, cast, concat_batches, filter_record_batch};
use datafusion::arrow::datatypes::{DataType, Schema, SchemaRef};
use datafusion::error::{DataFusionError, Result};
use fulmen_engine::error::did_you_mean;

use crate::format::Decoded;

/// How each message frames its Avro record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// Confluent's wire format: `0x00`, then this schema id (4 bytes, big-endian).
    Confluent(u32),
    /// Avro's single-object encoding: `C3 01`, then the schema's Rabin fingerprint.
    SingleObject,
    /// The record's bytes alone.
    Bare,
}

/// Format `avro`'s options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AvroSpec {
    /// `avro.schema`: the writer schema's JSON (else derived from the table's columns).
    pub schema: Option<String>,
    /// `avro.framing` and `avro.schema_id`.
    pub framing: Framing,
}

/// Reads and writes one table's Avro messages.
#[derive(Debug)]
pub struct AvroCodec {
    framing: Framing,
    store: SchemaStore,
    fingerprint: Fingerprint,
    /// The bytes that frame a record: what a bare record is given so that the framed
    /// decoder reads it, and what a message must not end with after its record.
    prefix: Vec<u8>,
    /// The writer schema's JSON.
    writer_json: String,
    /// The Arrow form of the whole writer record.
    record: SchemaRef,
    /// Indices into `record` of the fields the table reads, in record order (`None`: all of
    /// them, where arrow-avro cannot project the record).
    projection: Option<Vec<usize>>,
    /// The table's payload columns.
    schema: SchemaRef,
    /// A clean decoder (no rows held) of [`REUSED_ROWS`] rows, kept between calls.
    idle: Mutex<Option<AvroStreamDecoder>>,
    /// A flushed row writer, kept between calls of [`AvroCodec::encode`].
    idle_writer: Mutex<Option<AvroRowEncoder>>,
}

/// The rows of the decoder kept between calls: a live table's largest chunk.
const REUSED_ROWS: usize = 4096;

fn config(message: impl Into<String>) -> DataFusionError {
    DataFusionError::Configuration(message.into())
}

/// What a call of [`AvroCodec::decode`] has collected so far.
#[derive(Default)]
struct Collected {
    batches: Vec<RecordBatch>,
    good: Vec<usize>,
    bad: Vec<(usize, String)>,
}

impl Collected {
    /// Takes the rows of `decoder` (the messages `pending`) into `batches` and their
    /// messages into `good`, or all into `bad` where the rows cannot be taken.
    fn flush(&mut self, decoder: &mut AvroStreamDecoder, pending: &mut Vec<usize>) {
        match decoder.flush() {
            Ok(Some(batch)) => {
                self.batches.push(batch);
                self.good.append(pending);
            }
            Ok(None) => {}
            Err(e) => self
                .bad
                .extend(pending.drain(..).map(|j| (j, e.to_string()))),
        }
    }
}

/// Whether an Avro field read as `from` may fill a column of type `to`: the same kind of
/// value (numbers, times, text, bytes, or nested values arrow can cast), or text from
/// any scalar.
fn readable_as(from: &DataType, to: &DataType) -> bool {
    let nested = |t: &DataType| t.is_nested();
    let temporal = |t: &DataType| t.is_temporal();
    let text =
        |t: &DataType| matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View);
    let bytes = |t: &DataType| {
        matches!(
            t,
            DataType::Binary
                | DataType::LargeBinary
                | DataType::BinaryView
                | DataType::FixedSizeBinary(_)
        )
    };
    if from == to {
        return true;
    }
    if let DataType::Dictionary(_, value) = from {
        return readable_as(value, to);
    }
    if nested(from) || nested(to) {
        return nested(from) && nested(to) && can_cast_types(from, to);
    }
    let same_kind = text(to)
        || (from.is_numeric() && to.is_numeric())
        || (temporal(from) && temporal(to))
        || (bytes(from) && bytes(to))
        || matches!(to, DataType::Dictionary(_, value) if readable_as(from, value));
    same_kind && can_cast_types(from, to)
}

fn avro(error: arrow_avro::errors::AvroError) -> DataFusionError {
    DataFusionError::External(Box::new(error))
}

impl AvroCodec {
    /// A codec producing (and writing) `schema`, the table's columns besides metadata.
    pub fn try_new(spec: &AvroSpec, schema: SchemaRef) -> Result<Self> {
        let writer = match &spec.schema {
            Some(json) => AvroSchema::new(json.clone()),
            None => AvroSchema::try_from(schema.as_ref()).map_err(|e| {
                config(format!(
                    "format 'avro' cannot derive an Avro schema from the table's columns ({e}); \
                     give one with the option 'avro.schema'"
                ))
            })?,
        };
        let invalid = |e: &dyn std::fmt::Display| {
            config(format!(
                "option 'avro.schema' is not a usable Avro schema: {e}"
            ))
        };
        let (store, fingerprint) = match spec.framing {
            Framing::Confluent(id) => {
                let mut store = SchemaStore::new_with_type(FingerprintAlgorithm::Id);
                let fingerprint = Fingerprint::Id(id);
                store
                    .set(fingerprint, writer.clone())
                    .map_err(|e| invalid(&e))?;
                (store, fingerprint)
            }
            Framing::SingleObject | Framing::Bare => {
                let mut store = SchemaStore::new();
                let fingerprint = store.register(writer.clone()).map_err(|e| invalid(&e))?;
                (store, fingerprint)
            }
        };
        let prefix = match fingerprint {
            Fingerprint::Rabin(fp) => [&SINGLE_OBJECT_MAGIC[..], &fp.to_le_bytes()].concat(),
            Fingerprint::Id(id) => [&CONFLUENT_MAGIC[..], &id.to_be_bytes()].concat(),
            other => {
                return Err(DataFusionError::Internal(format!(
                    "unexpected Avro fingerprint {other:?}"
                )));
            }
        };
        let record = ReaderBuilder::new()
            .with_writer_schema_store(store.clone())
            .with_active_fingerprint(fingerprint)
            .build_decoder()
            .map_err(|e| invalid(&e))?
            .schema();
        if record.fields().is_empty() {
            return Err(config(
                "format 'avro' needs a record schema with at least one field",
            ));
        }
        let mut projection = Vec::with_capacity(schema.fields().len());
        for field in schema.fields() {
            let Some((index, found)) = record.column_with_name(field.name()) else {
                let names = record.fields().iter().map(|f| f.name().as_str());
                let hint = did_you_mean(field.name(), names, "");
                return Err(config(format!(
                    "column '{}' is not a field of the Avro record{hint}",
                    field.name()
                )));
            };
            if !readable_as(found.data_type(), field.data_type()) {
                return Err(config(format!(
                    "column '{}' is {}, but its Avro field reads as {}",
                    field.name(),
                    field.data_type(),
                    found.data_type()
                )));
            }
            projection.push(index);
        }
        projection.sort_unstable();
        projection.dedup();
        let mut codec = Self {
            framing: spec.framing,
            store,
            fingerprint,
            prefix,
            writer_json: writer.json_string,
            record,
            projection: Some(projection),
            schema,
            idle: Mutex::new(None),
            idle_writer: Mutex::new(None),
        };
        // Projection resolves the kept fields alone; one naming a type that a skipped field
        // defines does not resolve, and then every field is read.
        if codec.decoder(1).is_err() {
            codec.projection = None;
            codec.decoder(1).map_err(|e| invalid(&e))?;
        }
        Ok(codec)
    }

    fn decoder(&self, rows: usize) -> Result<AvroStreamDecoder> {
        let mut builder = ReaderBuilder::new()
            .with_batch_size(rows.max(1))
            .with_writer_schema_store(self.store.clone())
            .with_active_fingerprint(self.fingerprint);
        if let Some(projection) = &self.projection {
            builder = builder.with_projection(projection.clone());
        }
        Ok(builder.build_decoder()?)
    }

    /// Decodes one message into `decoder`, which holds one row more afterwards; on an error
    /// the decoder may hold part of a row and must not be used again.
    fn feed(
        &self,
        decoder: &mut AvroStreamDecoder,
        value: Option<&[u8]>,
        framed: &mut Vec<u8>,
    ) -> std::result::Result<(), String> {
        let value = value.ok_or("the message has no value")?;
        let bytes = if self.framing == Framing::Bare {
            framed.clear();
            framed.extend_from_slice(&self.prefix);
            framed.extend_from_slice(value);
            framed.as_slice()
        } else {
            value
        };
        let room = decoder.capacity();
        let used = decoder.decode(bytes);
        let rows = room - decoder.capacity();
        let used = used.map_err(|e| match e.to_string() {
            _ if rows > 0 => "the message holds bytes after its Avro record".to_owned(),
            m if m.contains("Unknown fingerprint") || m.contains("Missing magic") => format!(
                "the message is not framed for this table's Avro schema ({}): {m}",
                self.framing_name()
            ),
            m => format!("undecodable Avro record: {m}"),
        })?;
        match (rows, used == bytes.len()) {
            // A record followed by one more frame prefix is read whole, and the decoder is
            // left waiting for the next record's body: a decoder of one row stops after
            // the record and tells the two apart.
            (1, true) if bytes.len() > self.prefix.len() * 2 && bytes.ends_with(&self.prefix) => {
                let mut one = self.decoder(1).map_err(|e| e.to_string())?;
                match one.decode(bytes) {
                    Ok(n) if n == bytes.len() => Ok(()),
                    _ => Err("the message holds bytes after its Avro record".into()),
                }
            }
            (1, true) => Ok(()),
            (0, _) => Err("the message ends inside its Avro record".into()),
            _ => Err("the message holds bytes after its Avro record".into()),
        }
    }

    fn framing_name(&self) -> String {
        match self.framing {
            Framing::Confluent(id) => format!("Confluent framing, schema id {id}"),
            Framing::SingleObject => "single-object encoding".into(),
            Framing::Bare => "bare records".into(),
        }
    }

    /// Decodes each message's record; the bad ones are set aside with their errors.
    pub fn decode(&self, values: &[Option<&[u8]>]) -> Decoded {
        let all_bad = |e: &DataFusionError| Decoded {
            batch: RecordBatch::new_empty(self.schema.clone()),
            good: Vec::new(),
            bad: (0..values.len()).map(|i| (i, e.to_string())).collect(),
        };
        let rows = values.len().max(REUSED_ROWS);
        let idle = self.idle.lock().map(|mut d| d.take()).ok().flatten();
        let mut decoder = match idle.filter(|_| rows == REUSED_ROWS) {
            Some(decoder) => decoder,
            None => match self.decoder(rows) {
                Ok(decoder) => decoder,
                Err(e) => return all_bad(&e),
            },
        };
        let mut framed = Vec::new();
        let mut out = Collected::default();
        // The messages whose rows `decoder` holds.
        let mut pending: Vec<usize> = Vec::new();
        for (i, value) in values.iter().enumerate() {
            match self.feed(&mut decoder, *value, &mut framed) {
                Ok(()) => pending.push(i),
                Err(e) => {
                    out.bad.push((i, e));
                    // The decoder may hold half of message i: decode the rows before it again.
                    decoder = match self.decoder(rows) {
                        Ok(d) => d,
                        Err(e) => return all_bad(&e),
                    };
                    let mut clean = true;
                    for j in std::mem::take(&mut pending) {
                        match self.feed(&mut decoder, values[j], &mut framed) {
                            Ok(()) => pending.push(j),
                            Err(e) => {
                                out.bad.push((j, e));
                                clean = false;
                            }
                        }
                    }
                    out.flush(&mut decoder, &mut pending);
                    // Flushed, it goes on with the next message (unless the replay failed,
                    // which a deterministic decoder does not do).
                    if !clean || !decoder.batch_is_empty() {
                        decoder = match self.decoder(rows) {
                            Ok(d) => d,
                            Err(e) => return all_bad(&e),
                        };
                    }
                }
            }
        }
        out.flush(&mut decoder, &mut pending);
        // Flushed, the decoder holds nothing and serves the next call.
        if rows == REUSED_ROWS
            && decoder.batch_is_empty()
            && let Ok(mut idle) = self.idle.lock()
        {
            *idle = Some(decoder);
        }
        let Collected {
            batches,
            mut good,
            mut bad,
        } = out;
        bad.sort_by_key(|(i, _)| *i);
        match self.to_table(&batches) {
            Ok((batch, rejected)) => {
                if !rejected.is_empty() {
                    let mut dropped = vec![false; good.len()];
                    for (row, reason) in rejected {
                        dropped[row] = true;
                        bad.push((good[row], reason));
                    }
                    let mut row = 0;
                    good.retain(|_| {
                        row += 1;
                        !dropped[row - 1]
                    });
                    bad.sort_by_key(|(i, _)| *i);
                }
                Decoded { batch, good, bad }
            }
            Err(e) => {
                bad.extend(good.drain(..).map(|i| (i, e.to_string())));
                bad.sort_by_key(|(i, _)| *i);
                Decoded {
                    batch: RecordBatch::new_empty(self.schema.clone()),
                    good,
                    bad,
                }
            }
        }
    }

    /// Decoded batches (projected record fields) as the table's columns. A row whose value
    /// does not fit its column (the cast loses it, or it is NULL in a NOT NULL column) is
    /// left out and returned, by its row number, with the reason.
    fn to_table(&self, batches: &[RecordBatch]) -> Result<(RecordBatch, Vec<(usize, String)>)> {
        let Some(first) = batches.first() else {
            return Ok((RecordBatch::new_empty(self.schema.clone()), Vec::new()));
        };
        let decoded = concat_batches(&first.schema(), batches)?;
        let rows = decoded.num_rows();
        let mut rejected: Vec<Option<String>> = vec![None; rows];
        let mut columns = Vec::with_capacity(self.schema.fields().len());
        for field in self.schema.fields() {
            let column = decoded.column_by_name(field.name()).ok_or_else(|| {
                DataFusionError::Internal(format!(
                    "the Avro decoder gave no field '{}'",
                    field.name()
                ))
            })?;
            let cast_column = cast(column, field.data_type())?;
            let lost = cast_column.null_count() > column.null_count();
            if lost || (!field.is_nullable() && cast_column.null_count() > 0) {
                for (row, reason) in rejected.iter_mut().enumerate() {
                    if reason.is_some() || !cast_column.is_null(row) {
                        continue;
                    }
                    *reason = if column.is_valid(row) {
                        Some(format!(
                            "field '{}' holds a value that does not fit the column's type {}",
                            field.name(),
                            field.data_type()
                        ))
                    } else if !field.is_nullable() {
                        Some(format!(
                            "field '{}' is null, but the column is NOT NULL",
                            field.name()
                        ))
                    } else {
                        None
                    };
                }
            }
            columns.push(cast_column);
        }
        let options = RecordBatchOptions::new().with_row_count(Some(rows));
        let mut batch = RecordBatch::try_new_with_options(
            Arc::new(Schema::new(
                self.schema
                    .fields()
                    .iter()
                    .map(|f| f.as_ref().clone().with_nullable(true))
                    .collect::<Vec<_>>(),
            )),
            columns,
            &options,
        )?;
        let mut out = Vec::new();
        if rejected.iter().any(Option::is_some) {
            let keep = BooleanArray::from_iter(rejected.iter().map(|r| Some(r.is_none())));
            batch = filter_record_batch(&batch, &keep)?;
            out = rejected
                .into_iter()
                .enumerate()
                .filter_map(|(row, reason)| reason.map(|r| (row, r)))
                .collect();
        }
        let batch = RecordBatch::try_new_with_options(
            self.schema.clone(),
            batch.columns().to_vec(),
            &RecordBatchOptions::new().with_row_count(Some(batch.num_rows())),
        )?;
        Ok((batch, out))
    }

    /// Checks that every field of the writer record can be written from the table's columns:
    /// a field no column names is written as null, so it must be nullable; a column must
    /// cast to its field's type; enum fields are not written (arrow-avro needs the enum's
    /// own symbol dictionary).
    pub fn check_writable(&self) -> Result<()> {
        for field in self.record.fields() {
            match self.schema.column_with_name(field.name()) {
                None if !field.is_nullable() => {
                    return Err(config(format!(
                        "the Avro record's field '{}' is not nullable and the table has no \
                         column of that name to write it from",
                        field.name()
                    )));
                }
                None => {}
                Some((_, column)) => {
                    if matches!(field.data_type(), DataType::Dictionary(_, _)) {
                        return Err(config(format!(
                            "the Avro record's field '{}' is an enum, which Fulmen does not \
                             write yet",
                            field.name()
                        )));
                    }
                    if !can_cast_types(column.data_type(), field.data_type()) {
                        return Err(config(format!(
                            "column '{}' ({}) cannot be written as its Avro field ({})",
                            field.name(),
                            column.data_type(),
                            field.data_type()
                        )));
                    }
                }
            }
        }
        self.encode(&RecordBatch::new_empty(self.schema.clone()))
            .map(|_| ())
            .map_err(|e| config(format!("format 'avro' cannot write this table: {e}")))
    }

    /// arrow-avro's row writer for this record and framing.
    fn writer(&self) -> Result<AvroRowEncoder> {
        let mut metadata = self.record.metadata().clone();
        metadata.insert(SCHEMA_METADATA_KEY.to_owned(), self.writer_json.clone());
        let builder = WriterBuilder::new(Schema::new_with_metadata(
            self.record.fields().clone(),
            metadata,
        ));
        match self.framing {
            Framing::Confluent(id) => builder
                .with_fingerprint_strategy(FingerprintStrategy::Id(id))
                .build_encoder::<AvroSoeFormat>(),
            Framing::SingleObject => builder
                .with_fingerprint_strategy(FingerprintStrategy::Rabin)
                .build_encoder::<AvroSoeFormat>(),
            Framing::Bare => builder.build_encoder::<AvroBinaryFormat>(),
        }
        .map_err(avro)
    }

    /// One message value per row of `batch` (the table's payload columns).
    pub fn encode(&self, batch: &RecordBatch) -> Result<Vec<Vec<u8>>> {
        let rows = batch.num_rows();
        let columns = self
            .record
            .fields()
            .iter()
            .map(|field| match batch.column_by_name(field.name()) {
                Some(column) => Ok(cast(column, field.data_type())?),
                None => Ok(new_null_array(field.data_type(), rows)),
            })
            .collect::<Result<Vec<ArrayRef>>>()?;
        let record = RecordBatch::try_new_with_options(
            Arc::clone(&self.record),
            columns,
            &RecordBatchOptions::new().with_row_count(Some(rows)),
        )?;
        let idle = self.idle_writer.lock().map(|mut w| w.take()).ok().flatten();
        let mut writer = match idle {
            Some(writer) => writer,
            None => self.writer()?,
        };
        writer.encode(&record).map_err(avro)?;
        let messages = writer.flush().iter().map(|row| row.to_vec()).collect();
        // Flushed, the writer holds nothing and serves the next batch (one that failed is
        // dropped above, with whatever it held).
        if let Ok(mut idle) = self.idle_writer.lock() {
            *idle = Some(writer);
        }
        Ok(messages)
    }
}
