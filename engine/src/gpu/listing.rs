//! `fulmen_devices()`: a table function listing the devices of the session's selection
//! (`fulmen.devices`), one row each, with what the device has done and whether it is in
//! service. The shell's `\devices` prints it. `fulmen_kernels()` breaks each device's
//! launches and device bytes down by kernel.
//!
//! ```sql
//! SELECT device, state, launches FROM fulmen_devices();
//! SELECT kernel, launches FROM fulmen_kernels() ORDER BY launches DESC LIMIT 5;
//! ```

use std::sync::Arc;

use datafusion::arrow::array::{ArrayRef, RecordBatch, StringArray, UInt64Array};
use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::catalog::{TableFunctionArgs, TableFunctionImpl, TableProvider};
use datafusion::datasource::MemTable;
use datafusion::error::{DataFusionError, Result};

use super::devices::devices;
use crate::config::FulmenConfig;

/// The name SQL calls it by.
pub const NAME: &str = "fulmen_devices";

/// The name SQL calls the per-kernel listing by.
pub const KERNELS_NAME: &str = "fulmen_kernels";

/// The table function (registered by `FulmenContext`).
#[derive(Debug, Default)]
pub struct DevicesFunction;

/// The per-kernel table function (registered by `FulmenContext`).
#[derive(Debug, Default)]
pub struct KernelsFunction;

/// The listing's columns.
pub fn schema() -> SchemaRef {
    let text = |name: &str, nullable| Field::new(name, DataType::Utf8, nullable);
    let count = |name: &str| Field::new(name, DataType::UInt64, false);
    Arc::new(Schema::new(vec![
        text("device", false),
        text("name", false),
        text("compute_capability", true),
        text("state", false),
        text("reason", true),
        count("memory_total"),
        count("memory_budget"),
        count("memory_in_use"),
        count("memory_peak"),
        count("memory_cached"),
        count("memory_working"),
        text("cached_tables", false),
        count("allocations"),
        count("driver_allocations"),
        count("launches"),
        count("kernel_time_us"),
        count("syncs"),
        count("stream_waits"),
        count("h2d_copies"),
        count("h2d_bytes"),
        count("d2h_copies"),
        count("d2h_bytes"),
        count("d2d_copies"),
        count("d2d_bytes"),
        count("device_bytes"),
        count("device_errors"),
    ]))
}

/// The listing of the devices `config` selects: `compute_capability` is a GPU's (`9.0`;
/// NULL on the emulator); `state` is `in service` or `quarantined` (with the `reason`);
/// `memory_total` is the device's memory, `memory_budget` what Fulmen may use of it (90 %
/// of a GPU's), and `memory_in_use` and `memory_peak` are the whole device's
/// (`fulmen.gpu.memory_limit` is each query's quota within it);
/// `memory_cached` is what cached tables hold of the device, `memory_working` the rest of
/// what the device holds (queries' working memory), and `cached_tables` names the cached
/// tables with their bytes and chunks there; the counts are what Fulmen asked of the
/// device since the process opened it ([`fulmen_kernels::DeviceCounts`]: `allocations` from
/// the pool, `driver_allocations` of those from the driver, and launches, host syncs,
/// waits of one stream for another on the device (`stream_waits`) and copies as the
/// driver calls the CUDA backend makes for them, on every backend alike),
/// `kernel_time_us` the time operators spent in the device's work (the sum of their
/// `kernel_time` in EXPLAIN ANALYZE: queuing launches and copies and waiting for what they
/// read back, timed on the host, not by the device), and `device_errors` the device errors
/// operators met.
pub fn listing(config: &FulmenConfig) -> Result<RecordBatch> {
    let devices = devices(&config.devices)
        .map_err(|e| DataFusionError::Execution(format!("fulmen.devices: {e}")))?;
    let quarantine: Vec<Option<String>> = devices.iter().map(|d| d.quarantined()).collect();
    let all: Vec<fulmen_kernels::DeviceCounts> = devices.iter().map(|d| d.counts()).collect();
    let counts = |f: &dyn Fn(&fulmen_kernels::Device) -> u64| -> ArrayRef {
        Arc::new(UInt64Array::from_iter_values(devices.iter().map(f)))
    };
    let of = |f: &dyn Fn(&fulmen_kernels::DeviceCounts) -> u64| -> ArrayRef {
        Arc::new(UInt64Array::from_iter_values(all.iter().map(f)))
    };
    let columns: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from_iter_values(
            devices.iter().map(|d| d.to_string()),
        )),
        Arc::new(StringArray::from_iter_values(
            devices.iter().map(|d| d.name().to_string()),
        )),
        Arc::new(StringArray::from_iter(devices.iter().map(|d| {
            d.compute_capability()
                .map(|(major, minor)| format!("{major}.{minor}"))
        }))),
        Arc::new(StringArray::from_iter_values(quarantine.iter().map(|q| {
            if q.is_some() {
                "quarantined"
            } else {
                "in service"
            }
        }))),
        Arc::new(StringArray::from(quarantine)),
        counts(&|d| d.total_memory() as u64),
        counts(&|d| d.memory_budget() as u64),
        counts(&|d| d.device_memory_usage().0 as u64),
        counts(&|d| d.device_memory_usage().1 as u64),
        counts(&|d| crate::cache::cached_bytes_on(d) as u64),
        counts(&|d| {
            let cached = crate::cache::cached_bytes_on(d);
            d.device_memory_usage().0.saturating_sub(cached) as u64
        }),
        Arc::new(StringArray::from_iter_values(
            devices.iter().map(crate::cache::statements::tables_on),
        )),
        of(&|c| c.allocations),
        of(&|c| c.driver_allocations),
        of(&|c| c.launches),
        counts(&|d| u64::try_from(d.work_time().as_micros()).unwrap_or(u64::MAX)),
        of(&|c| c.syncs),
        of(&|c| c.stream_waits),
        of(&|c| c.h2d_copies),
        of(&|c| c.h2d_bytes),
        of(&|c| c.d2h_copies),
        of(&|c| c.d2h_bytes),
        of(&|c| c.d2d_copies),
        of(&|c| c.d2d_bytes),
        of(&|c| c.device_bytes),
        counts(&|d| d.errors()),
    ];
    Ok(RecordBatch::try_new(schema(), columns)?)
}

/// The per-kernel listing's columns.
pub fn kernels_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("device", DataType::Utf8, false),
        Field::new("kernel", DataType::Utf8, false),
        Field::new("source", DataType::Utf8, false),
        Field::new("launches", DataType::UInt64, false),
        Field::new("device_bytes", DataType::UInt64, false),
    ]))
}

/// Each kernel every device `config` selects has launched since the process opened it, one
/// row per (device, kernel), most launches first on each device: `source` is the `.cu` file
/// defining it, `launches` and `device_bytes` its share of the device's figures in
/// [`listing`] (which are their sums).
pub fn kernels_listing(config: &FulmenConfig) -> Result<RecordBatch> {
    let devices = devices(&config.devices)
        .map_err(|e| DataFusionError::Execution(format!("fulmen.devices: {e}")))?;
    let mut rows = Vec::new();
    for device in devices.iter() {
        let mut kernels = device.kernel_counts();
        kernels.sort_by(|a, b| {
            b.launches
                .cmp(&a.launches)
                .then(a.kernel.name().cmp(b.kernel.name()))
        });
        rows.extend(kernels.into_iter().map(|k| (device.to_string(), k)));
    }
    let columns: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from_iter_values(rows.iter().map(|(d, _)| d))),
        Arc::new(StringArray::from_iter_values(
            rows.iter().map(|(_, k)| k.kernel.name()),
        )),
        Arc::new(StringArray::from_iter_values(
            rows.iter().map(|(_, k)| k.kernel.source_file()),
        )),
        Arc::new(UInt64Array::from_iter_values(
            rows.iter().map(|(_, k)| k.launches),
        )),
        Arc::new(UInt64Array::from_iter_values(
            rows.iter().map(|(_, k)| k.device_bytes),
        )),
    ];
    Ok(RecordBatch::try_new(kernels_schema(), columns)?)
}

/// The session's Fulmen settings, for a table function called without arguments.
fn no_args_config(name: &str, args: &TableFunctionArgs) -> Result<FulmenConfig> {
    if !args.exprs().is_empty() {
        return Err(DataFusionError::Plan(format!(
            "{name}() takes no arguments"
        )));
    }
    Ok(args
        .session()
        .config()
        .options()
        .extensions
        .get::<FulmenConfig>()
        .cloned()
        .unwrap_or_default())
}

impl TableFunctionImpl for DevicesFunction {
    fn call_with_args(&self, args: TableFunctionArgs) -> Result<Arc<dyn TableProvider>> {
        let batch = listing(&no_args_config(NAME, &args)?)?;
        Ok(Arc::new(MemTable::try_new(schema(), vec![vec![batch]])?))
    }
}

impl TableFunctionImpl for KernelsFunction {
    fn call_with_args(&self, args: TableFunctionArgs) -> Result<Arc<dyn TableProvider>> {
        let batch = kernels_listing(&no_args_config(KERNELS_NAME, &args)?)?;
        Ok(Arc::new(MemTable::try_new(
            kernels_schema(),
            vec![vec![batch]],
        )?))
    }
}
