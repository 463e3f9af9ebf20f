//! Fulmen's SQL front door: the `fulmen` shell and what it is made of.
//!
//! - [`split`] cuts text into statements and meta-commands;
//! - [`command`] parses the meta-commands (`\d`, `\format`, …);
//! - [`format`] prints results as a table, CSV, TSV, JSON, NDJSON or Markdown;
//! - [`helper`] completes names and continues multi-line input at the prompt;
//! - [`shell`] runs scripts and the interactive prompt over a `FulmenContext`.

pub mod command;
pub mod format;
pub mod helper;
pub mod shell;
pub mod split;

pub use format::OutputFormat;
pub use shell::{Control, Failure, Shell, ShellOptions};
