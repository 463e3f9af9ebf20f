//! Loading a table into the cache: its rows cut into chunks, encoded, and dealt over the
//! devices (or held back to be replicated) while they fit.

use std::sync::Arc;

use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::compute::concat_batches;
use datafusion::error::{DataFusionError, Result};
use fulmen_kernels::column::{DeviceDictionary, dictionary_type};
use fulmen_kernels::{Device, DeviceBatch, DeviceColumn};

use super::{CachedChunk, batch_bytes, dictionary, size};
use crate::physical_plan::coalesce::{BatchLimit, Coalescer, host_bytes};

/// Adds `next`'s rows to the chunk `pending` makes up for `part`, placing each chunk as it
/// fills. Batches are cut to what the chunk still has room for, in rows and in bytes (a
/// slice shares its buffers), so that no chunk passes the limit.
pub(super) fn feed(
    loader: &mut Loader,
    pending: &mut Coalescer<RecordBatch>,
    part: usize,
    batch: BatchLimit,
    next: RecordBatch,
) -> Result<()> {
    let per_row = (host_bytes(&next) / next.num_rows().max(1)).max(1);
    let mut at = 0;
    while at < next.num_rows() {
        let rows_room = batch.rows.saturating_sub(pending.rows()).max(1);
        let bytes_room = (batch.bytes.saturating_sub(pending.bytes()) / per_row).max(1);
        let piece = next.slice(at, rows_room.min(bytes_room).min(next.num_rows() - at));
        at += piece.num_rows();
        if pending.closes_before(&piece) {
            loader.place(part, pending.take())?;
        }
        pending.push(piece);
        if pending.is_full() {
            loader.place(part, pending.take())?;
        }
    }
    Ok(())
}

/// Deals a table's chunks over the devices while they fit, then only counts the rest.
pub(super) struct Loader<'a> {
    pub(super) name: &'a str,
    /// The device of the first chunk.
    pub(super) first: usize,
    pub(super) devices: &'a [Device],
    /// What the cache may still take of each device, before this table.
    pub(super) room: Vec<usize>,
    /// What this table holds of each device so far.
    pub(super) held: Vec<usize>,
    pub(super) shards: Vec<Vec<CachedChunk>>,
    pub(super) rows: usize,
    /// Rows placed so far in each part.
    pub(super) part_rows: Vec<usize>,
    pub(super) chunks: usize,
    /// Whether part p goes to device p mod n (else chunks go to the devices in turn).
    pub(super) sharded: bool,
    /// Why the rows stopped fitting, once they did.
    pub(super) full: Option<String>,
    /// Device bytes of the rows so far (estimated from the host's for those not uploaded).
    pub(super) needed: usize,
    /// The chunks held back on the host while the table may still go to every device.
    pub(super) replicas: Option<Replicas>,
    /// The dictionaries of the string columns held encoded.
    pub(super) encoders: dictionary::Encoders,
    /// A column that passed the dictionary limit: the load is to start again.
    pub(super) overflow: Option<usize>,
    /// By device: the encoded columns' dictionaries there (made by `encode`).
    pub(super) dictionaries: Vec<Vec<(usize, Arc<DeviceDictionary>)>>,
}

/// A table's chunks held back while they may still be replicated.
pub(super) struct Replicas {
    /// The most host bytes a replicated table has.
    pub(super) below: usize,
    pub(super) bytes: usize,
    pub(super) held: Vec<Held>,
}

/// A chunk of a table being cached, on the host.
pub(super) struct Held {
    chunk: RecordBatch,
    part: usize,
    first_row: usize,
    /// Its place among the table's chunks.
    index: usize,
}

impl Loader<'_> {
    /// Places the chunk `group` makes of `part`'s rows: held back on the host while the
    /// table may still be replicated; else on the part's device when sharded, or on the
    /// next device in turn.
    pub(super) fn place(&mut self, part: usize, group: Vec<RecordBatch>) -> Result<()> {
        if group.is_empty() || self.overflow.is_some() {
            return Ok(());
        }
        let chunk = match group.len() {
            1 => group.into_iter().next().unwrap_or_else(|| unreachable!()),
            _ => concat_batches(&group[0].schema(), &group)?,
        };
        // A table that no longer fits is only counted: its chunks are not encoded.
        let encoded = match self.full {
            Some(_) => Ok(chunk),
            None => self.encoders.encode(chunk),
        };
        let chunk = match encoded {
            Ok(chunk) => chunk,
            Err(column) => {
                // Given up: what was uploaded is freed, and the load starts again.
                self.overflow = Some(column);
                self.shards.iter_mut().for_each(Vec::clear);
                return Ok(());
            }
        };
        let held = Held {
            first_row: self.part_rows[part],
            index: self.chunks,
            part,
            chunk,
        };
        self.part_rows[part] += held.chunk.num_rows();
        self.rows += held.chunk.num_rows();
        self.chunks += 1;
        if let Some(replicas) = &mut self.replicas {
            replicas.bytes += host_bytes(&held.chunk);
            replicas.held.push(held);
            if replicas.bytes <= replicas.below {
                return Ok(());
            }
            // Too large to replicate: the chunks held back are dealt as any other.
            let held = std::mem::take(&mut replicas.held);
            self.replicas = None;
            return self.deal(held);
        }
        self.deal(vec![held])
    }

    /// Puts chunks on the devices they are dealt to.
    fn deal(&mut self, held: Vec<Held>) -> Result<()> {
        held.into_iter().try_for_each(|h| self.deal_one(h))
    }

    /// Puts a chunk on the device it is dealt to.
    fn deal_one(&mut self, held: Held) -> Result<()> {
        let n = self.devices.len();
        let d = match self.sharded {
            true => held.part % n,
            false => (self.first + held.index) % n,
        };
        self.put(d, &held)
    }

    /// Ends the load: a table still held back (small enough) goes to every device, each
    /// chunk once per device. Whether it was replicated.
    pub(super) fn finish(&mut self) -> Result<bool> {
        let Some(replicas) = self.replicas.take() else {
            return Ok(false);
        };
        let n = self.devices.len();
        let fits = (0..n).all(|d| self.room[d] >= replicas.bytes);
        if fits {
            for held in &replicas.held {
                for d in 0..n {
                    self.put(d, held)?;
                }
            }
            if self.full.is_none() {
                // Replicated tables take turns at being read first, so that one-chunk
                // tables spread their reads.
                static TURN: std::sync::atomic::AtomicUsize =
                    std::sync::atomic::AtomicUsize::new(0);
                self.first = TURN.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % n;
                return Ok(!replicas.held.is_empty());
            }
        }
        // A copy that does not fit on every device (by the host bytes, or once uploaded in
        // the device's size classes, or a device out of memory): the table is dealt
        // instead, from nothing held.
        log::info!(
            "CACHE TABLE {}: a copy of its {} does not fit on every device; dealt instead \
             of replicated",
            self.name,
            size(replicas.bytes)
        );
        self.full = None;
        self.needed = 0;
        self.held.iter_mut().for_each(|h| *h = 0);
        self.shards.iter_mut().for_each(Vec::clear);
        self.deal(replicas.held).map(|_| false)
    }

    /// Uploads a chunk to `devices[d]` while the table fits, else only counts its bytes.
    fn put(&mut self, d: usize, held: &Held) -> Result<()> {
        let estimate = host_bytes(&held.chunk);
        if self.full.is_none() && self.held[d] + estimate > self.room[d] {
            let left = self.room[d].saturating_sub(self.held[d]);
            self.stop(format!(
                "{} has room for {} more of the cache",
                self.devices[d],
                size(left)
            ));
        }
        if self.full.is_some() {
            self.needed += estimate;
            return Ok(());
        }
        match DeviceBatch::upload(&self.devices[d], &held.chunk) {
            Ok(batch) => {
                let bytes = batch_bytes(&batch);
                self.held[d] += bytes;
                self.needed += bytes;
                self.shards[d].push(CachedChunk {
                    batch,
                    part: held.part,
                    first_row: held.first_row,
                });
                // The device's size classes can make a chunk larger than its host bytes.
                if self.held[d] > self.room[d] {
                    let over = format!(
                        "{} has room for {} of the cache, and the chunks took {}",
                        self.devices[d],
                        size(self.room[d]),
                        size(self.held[d])
                    );
                    self.stop(over);
                }
            }
            Err(e @ fulmen_kernels::KernelError::OutOfDeviceMemory { .. }) => {
                self.stop(format!("the device ran out of memory: {e}"));
                self.needed += estimate;
            }
            Err(e) => {
                return Err(DataFusionError::Execution(format!(
                    "CACHE TABLE {}: {}: {e}; nothing was cached",
                    self.name, self.devices[d]
                )));
            }
        }
        Ok(())
    }

    /// Ends the encoding: each device holding chunks gets the encoded columns'
    /// dictionaries, and its chunks' codes become dictionary columns.
    pub(super) fn encode(&mut self) -> Result<()> {
        let dictionaries = self.encoders.dictionaries();
        if dictionaries.is_empty() || self.full.is_some() {
            return Ok(());
        }
        let failed = |d: &Device, e: fulmen_kernels::KernelError| {
            DataFusionError::Execution(format!(
                "CACHE TABLE {}: {d}: a dictionary of strings: {e}; nothing was cached",
                self.name
            ))
        };
        // First every device's dictionaries (a device out of memory: the table does not fit).
        let mut uploaded = Vec::with_capacity(self.devices.len());
        for (d, device) in self.devices.iter().enumerate() {
            if self.shards[d].is_empty() {
                uploaded.push(Vec::new());
                continue;
            }
            let on_device = dictionaries
                .iter()
                .map(|(c, values)| Ok((*c, DeviceDictionary::upload(device, values)?)))
                .collect::<Result<Vec<_>, fulmen_kernels::KernelError>>();
            match on_device {
                Ok(on_device) => uploaded.push(on_device),
                Err(e @ fulmen_kernels::KernelError::OutOfDeviceMemory { .. }) => {
                    self.needed = self.held.iter().sum();
                    self.stop(format!("the device ran out of memory: {e}"));
                    return Ok(());
                }
                Err(e) => return Err(failed(device, e)),
            }
        }
        for (d, on_device) in uploaded.into_iter().enumerate() {
            let device = &self.devices[d];
            for chunk in self.shards[d].iter_mut() {
                let batch = &chunk.batch;
                let mut columns = batch.columns().to_vec();
                let mut fields: Vec<_> = batch
                    .schema()
                    .fields()
                    .iter()
                    .map(|f| f.as_ref().clone())
                    .collect();
                for (c, dictionary) in &on_device {
                    // SAFETY: the encoder gave each code as the index of a value it then
                    // added to the dictionary, which only grows, and 0 to a NULL (every
                    // dictionary holds a string).
                    columns[*c] = unsafe {
                        DeviceColumn::with_dictionary(columns[*c].clone(), Arc::clone(dictionary))
                    }
                    .map_err(|e| failed(device, e))?;
                    fields[*c] = fields[*c].clone().with_data_type(dictionary_type());
                }
                let schema = Arc::new(datafusion::arrow::datatypes::Schema::new_with_metadata(
                    fields,
                    batch.schema().metadata().clone(),
                ));
                chunk.batch = DeviceBatch::try_new(schema, columns, batch.num_rows())
                    .map_err(|e| failed(device, e))?;
            }
            self.held[d] += on_device
                .iter()
                .map(|(_, x)| x.reserved_bytes())
                .sum::<usize>();
            self.dictionaries[d] = on_device;
            if self.held[d] > self.room[d] {
                let over = format!(
                    "{} has room for {} of the cache, and the chunks with their \
                     dictionaries took {}",
                    self.devices[d],
                    size(self.room[d]),
                    size(self.held[d])
                );
                self.needed = self.held.iter().sum();
                self.stop(over);
                return Ok(());
            }
        }
        Ok(())
    }

    /// The rows do not fit: what was uploaded is freed at once.
    fn stop(&mut self, why: String) {
        self.full = Some(why);
        self.shards.iter_mut().for_each(Vec::clear);
        self.dictionaries.iter_mut().for_each(Vec::clear);
    }
}
