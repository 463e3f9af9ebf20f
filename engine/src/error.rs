//! The engine's error type for failures that are not DataFusion's own.
//!
//! Inside the engine, DataFusion's `plan_err!` / `exec_err!` are used where a query is at
//! fault; [`EngineError`] covers the rest and converts into `DataFusionError::External`.

use datafusion::common::utils::datafusion_strsim::levenshtein;
use datafusion::error::DataFusionError;

/// ` (did you mean '<prefix><candidate>'?)` for the candidate nearest to a misspelled `key`
/// (at most 3 edits away), or nothing when none is that close.
pub fn did_you_mean<'a>(
    key: &str,
    candidates: impl IntoIterator<Item = &'a str>,
    prefix: &str,
) -> String {
    candidates
        .into_iter()
        .map(|c| (levenshtein(key, c), c))
        .min()
        .filter(|(distance, _)| *distance <= 3)
        .map(|(_, c)| format!(" (did you mean '{prefix}{c}'?)"))
        .unwrap_or_default()
}

/// Errors raised by Fulmen's engine outside of DataFusion's own checks.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A path given to `register_path` has no format Fulmen can read.
    #[error(
        "cannot tell the format of '{path}': {reason} \
         (use a .parquet, .csv, .tsv, .json, .ndjson or .arrow file or folder, \
         or CREATE EXTERNAL TABLE … STORED AS …)"
    )]
    UnknownFormat {
        /// The path as given.
        path: String,
        /// Why no format could be chosen.
        reason: String,
    },
    /// A path given to `register_path` does not exist.
    #[error("no such file or folder: '{0}'")]
    NotFound(String),
    /// The TPC-H scale factor is out of range.
    #[error("TPC-H scale factor must be a number above 0 and at most 1000, got {0}")]
    InvalidScaleFactor(f64),
    /// The device layer refused something.
    #[error(transparent)]
    Device(#[from] fulmen_kernels::KernelError),
}

impl From<EngineError> for DataFusionError {
    fn from(e: EngineError) -> Self {
        DataFusionError::External(Box::new(e))
    }
}
