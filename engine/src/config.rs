//! Fulmen's settings: the `fulmen.*` namespace of DataFusion's configuration.
//!
//! Registered as a DataFusion config extension, so `SET fulmen.gpu.mode = force` works in the
//! shell, in the library and in `.slt` files, and `SHOW ALL` lists every setting with its
//! description. Each setting is documented in `docs/configuration.md`.

use std::any::Any;
use std::fmt;
use std::str::FromStr;

use datafusion::common::config::{ConfigEntry, ConfigExtension, ExtensionOptions};
use datafusion::error::{DataFusionError, Result};
use fulmen_kernels::DeviceSelection;

use crate::error::did_you_mean;

/// Where operators that can run on a GPU are placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuMode {
    /// Never use a GPU.
    Off,
    /// Use a GPU where the operator is supported and the input is large enough to pay for
    /// the trip over PCIe (`fulmen.gpu.min_rows`).
    #[default]
    Auto,
    /// Use a GPU wherever the operator is supported, whatever the size (what tests use).
    Force,
}

impl FromStr for GpuMode {
    type Err = DataFusionError;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "off" | "false" => Ok(Self::Off),
            "auto" => Ok(Self::Auto),
            "force" | "on" | "true" => Ok(Self::Force),
            other => Err(DataFusionError::Configuration(format!(
                "invalid value '{other}' for fulmen.gpu.mode (expected off, auto or force)"
            ))),
        }
    }
}

impl fmt::Display for GpuMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Off => "off",
            Self::Auto => "auto",
            Self::Force => "force",
        })
    }
}

/// What a GPU operator does when its device fails at something other than running out of
/// memory (a kernel error, a driver error, an out-of-bounds write the emulator caught).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnError {
    /// Redo the work on the CPU: the query still answers; the error is logged with the
    /// kernel's name and counted per device.
    #[default]
    Fallback,
    /// Fail the query with the device's error (what every test runs with, so that a kernel
    /// defect cannot hide behind a correct CPU answer).
    Fail,
}

impl FromStr for OnError {
    type Err = DataFusionError;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "fallback" => Ok(Self::Fallback),
            "fail" => Ok(Self::Fail),
            other => Err(DataFusionError::Configuration(format!(
                "invalid value '{other}' for fulmen.gpu.on_error (expected fallback or fail)"
            ))),
        }
    }
}

impl fmt::Display for OnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Fallback => "fallback",
            Self::Fail => "fail",
        })
    }
}

/// Fulmen's settings, kept in DataFusion's `ConfigOptions` under the prefix `fulmen`.
#[derive(Debug, Clone, PartialEq)]
pub struct FulmenConfig {
    /// `fulmen.devices`: which devices the session may use.
    pub devices: DeviceSelection,
    /// `fulmen.gpu.mode`: off, auto or force.
    pub gpu_mode: GpuMode,
    /// `fulmen.gpu.min_rows`: in `auto` mode, inputs estimated below this many rows stay on
    /// the CPU, where the GPU's fixed costs would dominate.
    pub gpu_min_rows: usize,
    /// `fulmen.gpu.batch_rows`: the most rows per device batch (see `gpu_batch_bytes`).
    pub gpu_batch_rows: usize,
    /// `fulmen.gpu.batch_bytes`: DataFusion's batches are coalesced into a device batch
    /// until they hold this many bytes of column data or `gpu_batch_rows` rows, whichever
    /// comes first.
    pub gpu_batch_bytes: usize,
    /// Whether filters may run on a GPU.
    pub gpu_filter: bool,
    /// Whether projections may run on a GPU.
    pub gpu_projection: bool,
    /// Whether aggregations (GROUP BY, aggregate functions) may run on a GPU.
    pub gpu_aggregate: bool,
    /// Whether hash joins may match rows on a GPU.
    pub gpu_join: bool,
    /// `fulmen.gpu.single_stage_aggregation`: whether an aggregation whose partial stage
    /// would run on one device for every partition runs as one stage there (`gpu::one_stage`).
    pub gpu_single_stage_aggregation: bool,
    /// `fulmen.gpu.memory_limit`: bytes of device memory one query may hold on each device
    /// (`None`: the whole device, or 2 GiB per emulated device).
    pub gpu_memory_limit: Option<usize>,
    /// `fulmen.gpu.on_error`: what a device error does to the query.
    pub gpu_on_error: OnError,
    /// `fulmen.stream.incremental`: whether windowed sinks keep their open windows' partial
    /// aggregate states (where their query allows) instead of re-reading open windows.
    pub stream_incremental: bool,
    /// `fulmen.cache.memory_limit`: bytes of each device that cached tables (`CACHE
    /// TABLE`) may hold together (`None`: half the device's memory).
    pub cache_memory_limit: Option<usize>,
    /// `fulmen.cache.replicate_below`: tables cached without a shard key whose rows take at
    /// most this many bytes go whole to every device (`0`: never).
    pub cache_replicate_below: usize,
    /// `fulmen.cache.chunk_bytes`: the most bytes of column data (on the host, every
    /// column) in one cached chunk; a chunk also holds at most `gpu_batch_rows` rows.
    pub cache_chunk_bytes: usize,
    /// `fulmen.cache.dictionary_limit`: a cached string column with at most this many
    /// distinct values is held on the devices dictionary-encoded (`0`: never).
    pub cache_dictionary_limit: usize,
}

impl Default for FulmenConfig {
    fn default() -> Self {
        Self {
            devices: DeviceSelection::Auto,
            gpu_mode: GpuMode::Auto,
            gpu_min_rows: 100_000,
            gpu_batch_rows: 1 << 22,
            gpu_batch_bytes: 64 << 20,
            gpu_filter: true,
            gpu_projection: true,
            gpu_aggregate: true,
            gpu_single_stage_aggregation: true,
            gpu_join: true,
            gpu_memory_limit: None,
            gpu_on_error: OnError::Fallback,
            stream_incremental: true,
            cache_memory_limit: None,
            cache_replicate_below: 64 << 20,
            cache_chunk_bytes: 512 << 20,
            cache_dictionary_limit: 1 << 16,
        }
    }
}

/// One setting: its key below the `fulmen.` prefix and its description for `SHOW ALL`.
struct Setting {
    key: &'static str,
    description: &'static str,
}

const SETTINGS: &[Setting] = &[
    Setting {
        key: "devices",
        description: "Devices this session may use: auto (every CUDA device), none, \
                      cuda:0,1 (those CUDA devices) or emulated:N (N emulated devices). \
                      Defaults to the FULMEN_DEVICES environment variable, else auto.",
    },
    Setting {
        key: "gpu.mode",
        description: "Where operators that can run on a GPU run: off, auto (on a GPU when \
                      supported and large enough to pay) or force (on a GPU whenever \
                      supported).",
    },
    Setting {
        key: "gpu.min_rows",
        description: "In auto mode, inputs estimated to have fewer rows than this stay on \
                      the CPU.",
    },
    Setting {
        key: "gpu.batch_rows",
        description: "The most rows in a device batch: smaller batches are coalesced until \
                      they reach this many rows or fulmen.gpu.batch_bytes, whichever comes \
                      first, before they are uploaded to a GPU.",
    },
    Setting {
        key: "gpu.batch_bytes",
        description: "Bytes of column data in a device batch (suffixes K, M, G allowed): \
                      smaller batches are coalesced until they hold this much or \
                      fulmen.gpu.batch_rows rows, whichever comes first.",
    },
    Setting {
        key: "gpu.filter",
        description: "Whether filters (WHERE, HAVING) may run on a GPU: true or false.",
    },
    Setting {
        key: "gpu.projection",
        description: "Whether projections (computed SELECT columns) may run on a GPU: true \
                      or false.",
    },
    Setting {
        key: "gpu.aggregate",
        description: "Whether aggregations (GROUP BY, count, sum, min, max, avg) may run on \
                      a GPU: true or false.",
    },
    Setting {
        key: "gpu.join",
        description: "Whether hash joins may match rows on a GPU: true or false.",
    },
    Setting {
        key: "gpu.single_stage_aggregation",
        description: "Whether an aggregation that one device would run for every partition \
                      runs there as one stage over all of them (one group table, no partial \
                      states brought down, shuffled on the CPU and sent up again), instead of \
                      DataFusion's partial and final stages: true or false.",
    },
    Setting {
        key: "gpu.memory_limit",
        description: "Device memory one query may hold on each device (its working memory), \
                      in bytes (suffixes K, M, G allowed), or 0 for the whole device. Operators \
                      whose state outgrows it finish on the CPU.",
    },
    Setting {
        key: "gpu.on_error",
        description: "What a device error (a failed kernel or driver call, not exhausted \
                      memory) does: fallback (redo the work on the CPU, log the error and \
                      count it for the device) or fail (the query fails with the error).",
    },
    Setting {
        key: "cache.memory_limit",
        description: "Device memory that cached tables (CACHE TABLE) may hold together on \
                      each device, in bytes (suffixes K, M, G allowed), or 0 for half the \
                      device's memory. A CACHE TABLE that would pass it fails and caches \
                      nothing; the rest of the device is the queries' working memory.",
    },
    Setting {
        key: "cache.replicate_below",
        description: "A table cached without a shard key whose rows take at most this many \
                      bytes (suffixes K, M, G allowed) is copied whole to every device, so \
                      that joins against it build where their other side lies; 0 never \
                      copies. Each copy counts against the device's cache room.",
    },
    Setting {
        key: "cache.chunk_bytes",
        description: "The most bytes of column data (every column, as held on the host) in \
                      one chunk of a cached table whose source tells its rows, in bytes \
                      (suffixes K, M, G allowed); a chunk also holds at most \
                      gpu.batch_rows rows; at most 1G. A query over a cached \
                      table runs chunk by chunk, each costing launches and waits, so larger \
                      chunks cost less. Read at CACHE time.",
    },
    Setting {
        key: "cache.dictionary_limit",
        description: "A string column of a table being cached whose first chunk holds at \
                      most this many distinct values (and at most one per two rows) is held \
                      on the devices as 32-bit codes into one dictionary of its strings, \
                      as long as the whole column stays within the limit; filters read it \
                      through the dictionary, and gathers and downloads move only the \
                      codes. 0 never encodes. Read at CACHE time.",
    },
    Setting {
        key: "stream.incremental",
        description: "Whether a windowed sink (CREATE SINK over TUMBLE, HOP or SESSION) \
                      keeps its open windows' partial aggregate states, adding each tick's \
                      new rows, instead of re-reading its open windows at every tick: true \
                      or false (read when the sink starts).",
    },
];

impl FulmenConfig {
    /// The defaults, with `fulmen.devices` taken from `FULMEN_DEVICES` when it is set.
    pub fn from_env() -> Result<Self> {
        let mut config = Self::default();
        if let Ok(devices) = std::env::var("FULMEN_DEVICES") {
            config
                .set("devices", &devices)
                .map_err(|e| DataFusionError::Configuration(format!("FULMEN_DEVICES: {e}")))?;
        }
        Ok(config)
    }

    fn value_of(&self, key: &str) -> String {
        match key {
            "devices" => self.devices.to_string(),
            "gpu.mode" => self.gpu_mode.to_string(),
            "gpu.min_rows" => self.gpu_min_rows.to_string(),
            "gpu.batch_rows" => self.gpu_batch_rows.to_string(),
            "gpu.batch_bytes" => self.gpu_batch_bytes.to_string(),
            "gpu.filter" => self.gpu_filter.to_string(),
            "gpu.projection" => self.gpu_projection.to_string(),
            "gpu.aggregate" => self.gpu_aggregate.to_string(),
            "gpu.join" => self.gpu_join.to_string(),
            "gpu.single_stage_aggregation" => self.gpu_single_stage_aggregation.to_string(),
            "gpu.memory_limit" => self.gpu_memory_limit.unwrap_or(0).to_string(),
            "gpu.on_error" => self.gpu_on_error.to_string(),
            "stream.incremental" => self.stream_incremental.to_string(),
            "cache.memory_limit" => self.cache_memory_limit.unwrap_or(0).to_string(),
            "cache.replicate_below" => self.cache_replicate_below.to_string(),
            "cache.chunk_bytes" => self.cache_chunk_bytes.to_string(),
            "cache.dictionary_limit" => self.cache_dictionary_limit.to_string(),
            _ => String::new(),
        }
    }

    fn unknown_key(key: &str) -> DataFusionError {
        let closest = did_you_mean(key, SETTINGS.iter().map(|s| s.key), "fulmen.");
        DataFusionError::Configuration(format!("unknown setting 'fulmen.{key}'{closest}"))
    }
}

impl ExtensionOptions for FulmenConfig {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }

    fn cloned(&self) -> Box<dyn ExtensionOptions> {
        Box::new(self.clone())
    }

    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "devices" => {
                self.devices = value
                    .parse()
                    .map_err(|e| DataFusionError::Configuration(format!("fulmen.devices: {e}")))?
            }
            "gpu.mode" => self.gpu_mode = value.parse()?,
            "gpu.min_rows" => {
                self.gpu_min_rows = value.trim().parse().map_err(|_| {
                    DataFusionError::Configuration(format!(
                        "invalid value '{value}' for fulmen.gpu.min_rows (expected a whole \
                         number of rows)"
                    ))
                })?
            }
            "gpu.batch_rows" => {
                self.gpu_batch_rows = value
                    .trim()
                    .parse()
                    .ok()
                    .filter(|&n: &usize| n > 0)
                    .ok_or_else(|| {
                        DataFusionError::Configuration(format!(
                            "invalid value '{value}' for fulmen.gpu.batch_rows (expected a \
                             positive number of rows)"
                        ))
                    })?
            }
            "gpu.batch_bytes" => {
                let expected = "a positive number of bytes, such as 67108864 or 64M";
                self.gpu_batch_bytes = Some(parse_bytes("gpu.batch_bytes", value, expected)?)
                    .filter(|&b| b > 0)
                    .ok_or_else(|| {
                        DataFusionError::Configuration(format!(
                            "invalid value '{value}' for fulmen.gpu.batch_bytes (expected \
                             {expected})"
                        ))
                    })?
            }
            "gpu.filter" => self.gpu_filter = parse_flag("gpu.filter", value)?,
            "gpu.projection" => self.gpu_projection = parse_flag("gpu.projection", value)?,
            "gpu.aggregate" => self.gpu_aggregate = parse_flag("gpu.aggregate", value)?,
            "gpu.join" => self.gpu_join = parse_flag("gpu.join", value)?,
            "gpu.single_stage_aggregation" => {
                self.gpu_single_stage_aggregation =
                    parse_flag("gpu.single_stage_aggregation", value)?
            }
            "gpu.memory_limit" => {
                self.gpu_memory_limit =
                    Some(parse_bytes("gpu.memory_limit", value, MEMORY_LIMIT)?).filter(|&b| b > 0)
            }
            "gpu.on_error" => self.gpu_on_error = value.parse()?,
            "stream.incremental" => {
                self.stream_incremental = parse_flag("stream.incremental", value)?
            }
            "cache.memory_limit" => {
                self.cache_memory_limit =
                    Some(parse_bytes("cache.memory_limit", value, CACHE_LIMIT)?).filter(|&b| b > 0)
            }
            "cache.replicate_below" => {
                self.cache_replicate_below =
                    parse_bytes("cache.replicate_below", value, REPLICATE_BELOW)?
            }
            "cache.chunk_bytes" => {
                // At most 1 GiB, so that a chunk's string column keeps 32-bit offsets.
                self.cache_chunk_bytes = Some(parse_bytes("cache.chunk_bytes", value, CHUNK_BYTES)?)
                    .filter(|&b| b > 0 && b <= 1 << 30)
                    .ok_or_else(|| {
                        DataFusionError::Configuration(format!(
                            "invalid value '{value}' for fulmen.cache.chunk_bytes (expected \
                             {CHUNK_BYTES})"
                        ))
                    })?
            }
            "cache.dictionary_limit" => {
                self.cache_dictionary_limit = value
                    .trim()
                    .parse()
                    .ok()
                    .filter(|&v: &usize| v <= u32::MAX as usize)
                    .ok_or_else(|| {
                        DataFusionError::Configuration(format!(
                            "invalid value '{value}' for fulmen.cache.dictionary_limit \
                             (expected a whole number of distinct values, 0 for none)"
                        ))
                    })?
            }
            other => return Err(Self::unknown_key(other)),
        }
        Ok(())
    }

    fn entries(&self) -> Vec<ConfigEntry> {
        SETTINGS
            .iter()
            .map(|s| ConfigEntry {
                key: format!("{}.{}", Self::PREFIX, s.key),
                value: Some(self.value_of(s.key)),
                description: s.description,
            })
            .collect()
    }
}

const MEMORY_LIMIT: &str = "bytes, such as 268435456, 256M or 0 for the whole device";
const CACHE_LIMIT: &str = "bytes, such as 1073741824, 1G or 0 for half the device";
const REPLICATE_BELOW: &str = "bytes, such as 67108864, 64M or 0 for never";
const CHUNK_BYTES: &str = "bytes, more than 0 and at most 1G, such as 536870912 or 512M";

fn parse_flag(key: &str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "true" | "on" | "1" => Ok(true),
        "false" | "off" | "0" => Ok(false),
        _ => Err(DataFusionError::Configuration(format!(
            "invalid value '{value}' for fulmen.{key} (expected true or false)"
        ))),
    }
}

/// A byte count: a whole number with an optional K, M or G (powers of 1024; `KiB`, `MB`
/// and the like are read the same way). `expected`: what the error says the setting takes.
fn parse_bytes(key: &str, value: &str, expected: &str) -> Result<usize> {
    let v = value.trim().to_ascii_uppercase();
    let digits = v.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let unit = match v[digits.len()..]
        .trim_end_matches("IB")
        .trim_end_matches('B')
    {
        "" => Some(1usize),
        "K" => Some(1 << 10),
        "M" => Some(1 << 20),
        "G" => Some(1 << 30),
        _ => None,
    };
    unit.zip(digits.trim().parse::<usize>().ok())
        .and_then(|(unit, n)| n.checked_mul(unit))
        .ok_or_else(|| {
            DataFusionError::Configuration(format!(
                "invalid value '{value}' for fulmen.{key} (expected {expected})"
            ))
        })
}

impl ConfigExtension for FulmenConfig {
    const PREFIX: &'static str = "fulmen";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_setting_can_be_set_and_is_listed() {
        let mut c = FulmenConfig::default();
        c.set("devices", "emulated:2").unwrap();
        c.set("gpu.mode", "FORCE").unwrap();
        c.set("gpu.min_rows", "10").unwrap();
        c.set("gpu.batch_rows", "4096").unwrap();
        c.set("gpu.batch_bytes", "16M").unwrap();
        c.set("gpu.filter", "false").unwrap();
        c.set("gpu.projection", "off").unwrap();
        c.set("gpu.aggregate", "false").unwrap();
        c.set("gpu.join", "false").unwrap();
        c.set("gpu.single_stage_aggregation", "false").unwrap();
        assert!(c.set("gpu.single_stage_aggregation", "sometimes").is_err());
        c.set("gpu.memory_limit", "1G").unwrap();
        c.set("gpu.on_error", "Fail").unwrap();
        c.set("stream.incremental", "false").unwrap();
        c.set("cache.replicate_below", "1M").unwrap();
        c.set("cache.chunk_bytes", "8M").unwrap();
        assert!(c.set("cache.chunk_bytes", "0").is_err());
        assert!(c.set("cache.chunk_bytes", "2G").is_err());
        assert_eq!(c.cache_chunk_bytes, 8 << 20);
        c.set("cache.dictionary_limit", "100").unwrap();
        assert!(c.set("cache.dictionary_limit", "-1").is_err());
        assert!(c.set("cache.dictionary_limit", "many").is_err());
        assert_eq!(c.cache_dictionary_limit, 100);
        assert!(!c.stream_incremental);
        assert_eq!(c.cache_replicate_below, 1 << 20);
        assert_eq!(c.gpu_on_error, OnError::Fail);
        assert!(!c.gpu_filter && !c.gpu_projection && c.gpu_batch_rows == 4096);
        assert_eq!(c.gpu_batch_bytes, 16 << 20);
        assert!(!c.gpu_aggregate && c.gpu_memory_limit == Some(1 << 30));
        assert_eq!(c.devices, DeviceSelection::Emulated(2));
        assert_eq!(c.gpu_mode, GpuMode::Force);
        assert_eq!(c.gpu_min_rows, 10);
        let entries: Vec<_> = c
            .entries()
            .into_iter()
            .map(|e| (e.key, e.value.unwrap()))
            .collect();
        assert_eq!(
            entries,
            vec![
                ("fulmen.devices".to_string(), "emulated:2".to_string()),
                ("fulmen.gpu.mode".to_string(), "force".to_string()),
                ("fulmen.gpu.min_rows".to_string(), "10".to_string()),
                ("fulmen.gpu.batch_rows".to_string(), "4096".to_string()),
                ("fulmen.gpu.batch_bytes".to_string(), "16777216".to_string()),
                ("fulmen.gpu.filter".to_string(), "false".to_string()),
                ("fulmen.gpu.projection".to_string(), "false".to_string()),
                ("fulmen.gpu.aggregate".to_string(), "false".to_string()),
                ("fulmen.gpu.join".to_string(), "false".to_string()),
                (
                    "fulmen.gpu.single_stage_aggregation".to_string(),
                    "false".to_string()
                ),
                (
                    "fulmen.gpu.memory_limit".to_string(),
                    "1073741824".to_string()
                ),
                ("fulmen.gpu.on_error".to_string(), "fail".to_string()),
                ("fulmen.cache.memory_limit".to_string(), "0".to_string()),
                (
                    "fulmen.cache.replicate_below".to_string(),
                    "1048576".to_string()
                ),
                (
                    "fulmen.cache.chunk_bytes".to_string(),
                    "8388608".to_string()
                ),
                (
                    "fulmen.cache.dictionary_limit".to_string(),
                    "100".to_string()
                ),
                ("fulmen.stream.incremental".to_string(), "false".to_string()),
            ]
        );
    }

    #[test]
    fn bad_values_and_keys_are_clear_errors() {
        let mut c = FulmenConfig::default();
        let e = c.set("gpu.mode", "fast").unwrap_err().to_string();
        assert!(
            e.contains("'fast'") && e.contains("off, auto or force"),
            "{e}"
        );
        let e = c.set("gpu.min_rows", "-1").unwrap_err().to_string();
        assert!(e.contains("fulmen.gpu.min_rows"), "{e}");
        let e = c.set("gpu.batch_rows", "0").unwrap_err().to_string();
        assert!(e.contains("positive"), "{e}");
        for bad in ["0", "0M", "-5", "big"] {
            let e = c.set("gpu.batch_bytes", bad).unwrap_err().to_string();
            assert!(
                e.contains("fulmen.gpu.batch_bytes") && e.contains("positive"),
                "{e}"
            );
        }
        assert_eq!(c.gpu_batch_bytes, 64 << 20);
        c.set("gpu.memory_limit", "64M").unwrap();
        assert_eq!(c.gpu_memory_limit, Some(64 << 20));
        c.set("gpu.memory_limit", "0").unwrap();
        assert_eq!(c.gpu_memory_limit, None);
        assert!(c.set("gpu.memory_limit", "lots").is_err());
        let e = c.set("gpu.on_error", "ignore").unwrap_err().to_string();
        assert!(e.contains("fallback or fail"), "{e}");
        let e = c.set("gpu.filter", "maybe").unwrap_err().to_string();
        assert!(e.contains("true or false"), "{e}");
        let e = c.set("gpu.mdoe", "off").unwrap_err().to_string();
        assert!(e.contains("did you mean 'fulmen.gpu.mode'"), "{e}");
        let e = c.set("devices", "tpu:0").unwrap_err().to_string();
        assert!(e.contains("tpu"), "{e}");
        assert_eq!(c, FulmenConfig::default(), "failed sets change nothing");
    }
}
