//! Output formats: how result batches are printed.
//!
//! `table` and `markdown` are for people: rows are gathered and drawn once (`table` fits the
//! terminal width and shows at most `max_rows` rows, saying how many it left out). `csv`,
//! `tsv`, `json` and `ndjson` are for programs: every row is written as it arrives.

use std::fmt;
use std::io::Write;
use std::str::FromStr;

use arrow::array::RecordBatch;
use arrow::csv::WriterBuilder;
use arrow::datatypes::SchemaRef;
use arrow::error::ArrowError;
use arrow::json::writer::{LineDelimited, WriterBuilder as JsonWriterBuilder};
use comfy_table::{Cell, ContentArrangement, Table, presets};

/// Terminals narrower than this are not fitted: wrapping every cell to a few characters
/// helps nobody.
const MIN_FIT_WIDTH: u16 = 20;

/// The output formats of the shell (`--format`, `\format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputFormat {
    /// An aligned table fitted to the terminal.
    #[default]
    Table,
    /// Comma-separated values with a header row.
    Csv,
    /// Tab-separated values with a header row.
    Tsv,
    /// One JSON array of objects.
    Json,
    /// One JSON object per line.
    Ndjson,
    /// A Markdown table.
    Markdown,
}

/// Every format name, for help texts and completion.
pub const FORMAT_NAMES: &[&str] = &["table", "csv", "tsv", "json", "ndjson", "markdown"];

impl FromStr for OutputFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "table" => Ok(Self::Table),
            "csv" => Ok(Self::Csv),
            "tsv" => Ok(Self::Tsv),
            "json" => Ok(Self::Json),
            "ndjson" | "jsonl" => Ok(Self::Ndjson),
            "markdown" | "md" => Ok(Self::Markdown),
            other => Err(format!(
                "unknown format '{other}' (choose one of {})",
                FORMAT_NAMES.join(", ")
            )),
        }
    }
}

impl fmt::Display for OutputFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Table => "table",
            Self::Csv => "csv",
            Self::Tsv => "tsv",
            Self::Json => "json",
            Self::Ndjson => "ndjson",
            Self::Markdown => "markdown",
        })
    }
}

/// Receives one statement's result batch by batch and prints it.
pub struct ResultPrinter<W: Write> {
    format: OutputFormat,
    max_rows: usize,
    schema: SchemaRef,
    out: W,
    /// Rows kept for drawing (table, markdown).
    kept: Vec<RecordBatch>,
    kept_rows: usize,
    rows: usize,
    wrote_any: bool,
}

impl<W: Write> ResultPrinter<W> {
    /// A printer for a result with `schema`; `max_rows` limits the `table` format (0: all).
    pub fn new(format: OutputFormat, max_rows: usize, schema: SchemaRef, out: W) -> Self {
        Self {
            format,
            max_rows,
            schema,
            out,
            kept: Vec::new(),
            kept_rows: 0,
            rows: 0,
            wrote_any: false,
        }
    }

    /// Rows seen so far.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Takes the next batch of the result.
    pub fn push(&mut self, batch: &RecordBatch) -> Result<(), ArrowError> {
        self.rows += batch.num_rows();
        match self.format {
            OutputFormat::Table | OutputFormat::Markdown => {
                let limit = if self.format == OutputFormat::Table && self.max_rows > 0 {
                    self.max_rows
                } else {
                    usize::MAX
                };
                let room = limit.saturating_sub(self.kept_rows);
                if room > 0 && batch.num_rows() > 0 {
                    let take = room.min(batch.num_rows());
                    self.kept.push(batch.slice(0, take));
                    self.kept_rows += take;
                }
                Ok(())
            }
            _ => self.write_stream(batch),
        }
    }

    fn write_stream(&mut self, batch: &RecordBatch) -> Result<(), ArrowError> {
        let first = !self.wrote_any;
        match self.format {
            OutputFormat::Csv | OutputFormat::Tsv => {
                let delimiter = if self.format == OutputFormat::Tsv {
                    b'\t'
                } else {
                    b','
                };
                let mut writer = WriterBuilder::new()
                    .with_header(first)
                    .with_delimiter(delimiter)
                    .build(&mut self.out);
                writer.write(batch)?;
            }
            OutputFormat::Ndjson => {
                let mut writer = ndjson_writer(&mut self.out);
                writer.write(batch)?;
                writer.finish()?;
            }
            OutputFormat::Json => {
                let mut lines = Vec::new();
                let mut writer = ndjson_writer(&mut lines);
                writer.write(batch)?;
                writer.finish()?;
                let text = String::from_utf8_lossy(&lines);
                for (i, line) in text.lines().enumerate() {
                    let sep = if first && i == 0 { "[\n  " } else { ",\n  " };
                    write!(self.out, "{sep}{line}")?;
                }
                if batch.num_rows() == 0 {
                    return Ok(());
                }
            }
            OutputFormat::Table | OutputFormat::Markdown => unreachable!("drawn at the end"),
        }
        self.wrote_any = true;
        Ok(())
    }

    /// Finishes the output after the last batch and returns the number of rows.
    pub fn finish(mut self) -> Result<usize, ArrowError> {
        match self.format {
            OutputFormat::Table | OutputFormat::Markdown => self.draw()?,
            OutputFormat::Csv | OutputFormat::Tsv if !self.wrote_any => {
                // No rows: still print the header.
                let empty = RecordBatch::new_empty(self.schema.clone());
                self.write_stream(&empty)?;
            }
            OutputFormat::Json => {
                if self.wrote_any {
                    writeln!(self.out, "\n]")?;
                } else {
                    writeln!(self.out, "[]")?;
                }
            }
            _ => {}
        }
        self.out.flush()?;
        Ok(self.rows)
    }

    fn draw(&mut self) -> Result<(), ArrowError> {
        let mut table = Table::new();
        if self.format == OutputFormat::Markdown {
            table.load_style(presets::ASCII_MARKDOWN);
        } else {
            table.load_style(presets::UTF8_FULL_CONDENSED);
            // Fit the terminal, unless it reports a width too small to mean anything (a
            // pseudo-terminal nobody sized reports 0 columns).
            if table.width().is_some_and(|w| w >= MIN_FIT_WIDTH) {
                table.set_content_arrangement(ContentArrangement::Dynamic);
            }
        }
        table.set_header(self.schema.fields().iter().map(|f| Cell::new(f.name())));
        let markdown = self.format == OutputFormat::Markdown;
        for row in fulmen_engine::display::rows_as_text(&self.kept)? {
            table.add_row(row.into_iter().map(|text| {
                if markdown {
                    Cell::new(text.replace('|', "\\|").replace('\n', " "))
                } else {
                    Cell::new(text)
                }
            }));
        }
        writeln!(self.out, "{table}")?;
        let hidden = self.rows - self.kept_rows;
        if hidden > 0 {
            writeln!(
                self.out,
                "({hidden} more row{} not shown; \\maxrows 0 shows all)",
                if hidden == 1 { "" } else { "s" }
            )?;
        }
        Ok(())
    }
}

/// JSON lines with NULLs written out, so every object has every column.
fn ndjson_writer<W: Write>(out: W) -> arrow::json::Writer<W, LineDelimited> {
    JsonWriterBuilder::new()
        .with_explicit_nulls(true)
        .build::<_, LineDelimited>(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int64Array, StringArray};
    use arrow::datatypes::{DataType, Field, Schema};
    use std::sync::Arc;

    fn batch(ids: &[i64], names: &[Option<&str>]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("name", DataType::Utf8, true),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from(ids.to_vec())),
                Arc::new(StringArray::from(names.to_vec())),
            ],
        )
        .unwrap()
    }

    fn render(format: OutputFormat, max_rows: usize, batches: &[RecordBatch]) -> String {
        let mut out = Vec::new();
        let mut p = ResultPrinter::new(format, max_rows, batches[0].schema(), &mut out);
        for b in batches {
            p.push(b).unwrap();
        }
        p.finish().unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn machine_formats_write_every_row() {
        let b1 = batch(&[1, 2], &[Some("a"), None]);
        let b2 = batch(&[3], &[Some("x,y")]);
        let both = [b1, b2];
        assert_eq!(
            render(OutputFormat::Csv, 1, &both),
            "id,name\n1,a\n2,\n3,\"x,y\"\n"
        );
        assert_eq!(
            render(OutputFormat::Tsv, 1, &both),
            "id\tname\n1\ta\n2\t\n3\tx,y\n"
        );
        assert_eq!(
            render(OutputFormat::Ndjson, 1, &both),
            "{\"id\":1,\"name\":\"a\"}\n{\"id\":2,\"name\":null}\n{\"id\":3,\"name\":\"x,y\"}\n"
        );
        let json = render(OutputFormat::Json, 1, &both);
        let parsed: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(parsed.as_array().unwrap().len(), 3, "{json}");
        assert_eq!(parsed[2]["name"], "x,y");
    }

    #[test]
    fn empty_results_keep_their_shape() {
        let empty = batch(&[], &[]);
        assert_eq!(
            render(OutputFormat::Csv, 0, std::slice::from_ref(&empty)),
            "id,name\n"
        );
        assert_eq!(
            render(OutputFormat::Json, 0, std::slice::from_ref(&empty)),
            "[]\n"
        );
        let table = render(OutputFormat::Table, 0, &[empty]);
        assert!(table.contains("id") && table.contains("name"), "{table}");
    }

    #[test]
    fn table_cuts_long_results_and_says_so() {
        let b = batch(&[1, 2, 3], &[Some("a"), None, Some("c")]);
        let text = render(OutputFormat::Table, 2, &[b.clone(), b.clone()]);
        assert!(text.contains("NULL"), "{text}");
        assert!(!text.contains(" c "), "row 3 is cut: {text}");
        assert!(text.contains("(4 more rows not shown"), "{text}");
        let all = render(OutputFormat::Table, 0, &[b]);
        assert!(all.contains(" c ") && !all.contains("more row"), "{all}");
    }

    #[test]
    fn markdown_escapes_pipes() {
        let text = render(OutputFormat::Markdown, 0, &[batch(&[1], &[Some("a|b")])]);
        assert!(text.lines().next().unwrap().starts_with("| id"), "{text}");
        assert!(text.contains("a\\|b"), "{text}");
    }
}
