//! `fulmen_devices()`: a table function listing the devices of the session's selection
//! (`fulmen.devices`), one row each, with what the device has done and whether it is in
//! service. The shell's `\devices` prints it.
//!
//! ```sql
//! SELECT device, state, launches FROM fulmen_devices();
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

/// The table function (registered by `FulmenContext`).
#[derive(Debug, Default)]
pub struct DevicesFunction;

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
/// the pool, `driver_allocations` of those from the driver, and launches, host syncs and
/// copies as the driver calls the CUDA backend makes for them, on every backend alike),
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

impl TableFunctionImpl for DevicesFunction {
    fn call_with_args(&self, args: TableFunctionArgs) -> Result<Arc<dyn TableProvider>> {
        if !args.exprs().is_empty() {
            return Err(DataFusionError::Plan(format!(
                "{NAME}() takes no arguments"
            )));
        }
        let config = args
            .session()
            .config()
            .options()
            .extensions
            .get::<FulmenConfig>()
            .cloned()
            .unwrap_or_default();
        let batch = listing(&config)?;
        Ok(Arc::new(MemTable::try_new(schema(), vec![vec![batch]])?))
    }
}
