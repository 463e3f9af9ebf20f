//! Results as text: every cell formatted the way Arrow displays it, NULL as `NULL`. Used
//! wherever answers are compared as text (sqllogictest, the benchmark runner).

use arrow::array::RecordBatch;
use arrow::error::ArrowError;
use arrow::util::display::{ArrayFormatter, FormatOptions};

/// The rows of `batches`, each a list of cell texts.
pub fn rows_as_text(batches: &[RecordBatch]) -> Result<Vec<Vec<String>>, ArrowError> {
    let options = FormatOptions::default().with_null("NULL");
    let mut rows = Vec::new();
    for batch in batches {
        let formatters = batch
            .columns()
            .iter()
            .map(|c| ArrayFormatter::try_new(c.as_ref(), &options))
            .collect::<Result<Vec<_>, _>>()?;
        for row in 0..batch.num_rows() {
            rows.push(
                formatters
                    .iter()
                    .map(|f| f.value(row).to_string())
                    .collect(),
            );
        }
    }
    Ok(rows)
}
