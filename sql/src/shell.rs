//! The shell: runs scripts and the interactive prompt over a [`FulmenContext`].
//!
//! ```text
//!  text ──split──▶ pieces ──▶ SQL ──▶ FulmenContext::sql ──▶ batches ──▶ ResultPrinter
//!                        └──▶ meta-command (\d, \format, \i, …)
//! ```
//!
//! A statement runs on the tokio runtime while the calling thread waits; Ctrl-C cancels
//! it (dropping the stream stops DataFusion's work), and a statement that runs longer than
//! a second shows a spinner with the elapsed time and the rows so far when stderr is a
//! terminal. Errors become one line of text; in scripts the first error stops the script.

use std::io::{IsTerminal, Write};
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use datafusion::error::DataFusionError;
use datafusion::sql::sqlparser::parser::ParserError;
use fulmen_engine::FulmenContext;
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use rustyline::error::ReadlineError;
use rustyline::history::DefaultHistory;
use rustyline::{Config, Editor};
use tokio::runtime::Runtime;

use crate::command::{MetaCommand, help_text};
use crate::format::{OutputFormat, ResultPrinter};
use crate::helper::ShellHelper;
use crate::split::{Piece, split};

/// How the shell prints.
#[derive(Debug, Clone)]
pub struct ShellOptions {
    /// The output format.
    pub format: OutputFormat,
    /// Print the row count and elapsed time after each statement (on stderr).
    pub timing: bool,
    /// Rows the table format shows before cutting (0: all).
    pub max_rows: usize,
}

impl Default for ShellOptions {
    fn default() -> Self {
        Self {
            format: OutputFormat::Table,
            timing: true,
            max_rows: 40,
        }
    }
}

/// Why a statement did not complete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The statement failed; the text is one line.
    Error(String),
    /// The user pressed Ctrl-C.
    Cancelled,
    /// Standard output went away (e.g. `fulmen … | head`): stop quietly.
    OutputClosed,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Error(e) => write!(f, "Error: {e}"),
            Self::Cancelled => f.write_str("Cancelled."),
            Self::OutputClosed => f.write_str("Output closed."),
        }
    }
}

/// What to do after a piece ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Go on with the next piece.
    Continue,
    /// Leave (`\q`).
    Quit,
}

/// Makes one clear line out of a DataFusion error.
pub fn describe_error(e: &DataFusionError) -> String {
    let text = match e.find_root() {
        DataFusionError::SQL(parser, _) => match parser.as_ref() {
            ParserError::ParserError(m) | ParserError::TokenizerError(m) => {
                format!("syntax error: {m}")
            }
            ParserError::RecursionLimitExceeded => {
                "syntax error: statement nested too deeply".into()
            }
        },
        DataFusionError::External(inner) => inner.to_string(),
        _ => e.strip_backtrace(),
    };
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn io_failure(e: std::io::Error) -> Failure {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        Failure::OutputClosed
    } else {
        Failure::Error(format!("cannot write the result: {e}"))
    }
}

fn arrow_failure(e: arrow::error::ArrowError) -> Failure {
    match e {
        arrow::error::ArrowError::IoError(_, io) => io_failure(io),
        other => Failure::Error(other.to_string()),
    }
}

/// The shell's state: the session, the runtime it runs on and how it prints.
pub struct Shell {
    ctx: FulmenContext,
    runtime: Arc<Runtime>,
    /// Printing options, changed by `\format`, `\timing` and `\maxrows`.
    pub options: ShellOptions,
    /// Show the spinner for long statements (only when stderr is a terminal).
    progress: bool,
}

impl Shell {
    /// A shell over `ctx`, running statements on `runtime`.
    pub fn new(ctx: FulmenContext, runtime: Arc<Runtime>, options: ShellOptions) -> Self {
        Self {
            ctx,
            runtime,
            options,
            progress: std::io::stderr().is_terminal(),
        }
    }

    /// The session.
    pub fn context(&self) -> &FulmenContext {
        &self.ctx
    }

    /// Runs every statement and meta-command of `text` in order, stopping at the first
    /// failure. Text after the last `;` runs as a final statement.
    pub fn run_script(&mut self, text: &str) -> Result<Control, Failure> {
        let mut parts = split(text);
        if !parts.rest.is_empty() {
            parts
                .pieces
                .push(Piece::Sql(std::mem::take(&mut parts.rest)));
        }
        for piece in &parts.pieces {
            if self.run_piece(piece)? == Control::Quit {
                return Ok(Control::Quit);
            }
        }
        Ok(Control::Continue)
    }

    /// Runs statements from `input` as they arrive (a pipe: `cat pipeline.sql - | fulmen`):
    /// each complete statement runs as soon as the line that ends it is read, as psql does;
    /// text left when the input ends runs as a final statement. Stops at the first failure.
    pub fn run_stream(&mut self, mut input: impl std::io::BufRead) -> Result<Control, Failure> {
        let mut pending = String::new();
        let mut line = String::new();
        loop {
            line.clear();
            let n = input
                .read_line(&mut line)
                .map_err(|e| Failure::Error(format!("cannot read the input: {e}")))?;
            if n == 0 {
                break;
            }
            pending.push_str(&line);
            let parts = split(&pending);
            for piece in &parts.pieces {
                if self.run_piece(piece)? == Control::Quit {
                    return Ok(Control::Quit);
                }
            }
            pending.drain(..parts.consumed);
        }
        self.run_script(&pending)
    }

    /// Runs one statement or meta-command.
    pub fn run_piece(&mut self, piece: &Piece) -> Result<Control, Failure> {
        match piece {
            Piece::Sql(sql) => self.run_sql(sql).map(|_| Control::Continue),
            Piece::Meta(text) => {
                let command = MetaCommand::parse(text).map_err(Failure::Error)?;
                self.run_meta(command)
            }
        }
    }

    /// Runs one SQL statement and prints its result. A panic inside becomes an error.
    pub fn run_sql(&mut self, sql: &str) -> Result<usize, Failure> {
        let start = Instant::now();
        let rows = Arc::new(AtomicUsize::new(0));
        let done = Arc::new(AtomicBool::new(false));
        let spinner = (self.progress
            && matches!(
                self.options.format,
                OutputFormat::Table | OutputFormat::Markdown
            ))
        .then(|| {
            self.runtime
                .spawn(spin(Arc::clone(&rows), Arc::clone(&done)))
        });
        let work = execute(&self.ctx, sql, self.options.clone(), Arc::clone(&rows));
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
            self.runtime.block_on(async {
                tokio::select! {
                    result = work => result,
                    _ = tokio::signal::ctrl_c() => Err(Failure::Cancelled),
                }
            })
        }))
        .unwrap_or_else(|panic| {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(Failure::Error(format!("internal error: {message}")))
        });
        done.store(true, Ordering::Relaxed);
        if let Some(handle) = spinner {
            let _ = self.runtime.block_on(handle);
        }
        let printed = outcome?;
        if self.options.timing {
            let elapsed = start.elapsed().as_secs_f64();
            match printed {
                Some(n) => eprintln!("{n} row{} ({elapsed:.3} s)", if n == 1 { "" } else { "s" }),
                None => eprintln!("OK ({elapsed:.3} s)"),
            }
        }
        Ok(printed.unwrap_or(0))
    }

    fn run_meta(&mut self, command: MetaCommand) -> Result<Control, Failure> {
        match command {
            MetaCommand::Quit => return Ok(Control::Quit),
            MetaCommand::Help => print!("{}", help_text()),
            MetaCommand::ListTables => {
                let sql = "SELECT table_name, table_type FROM information_schema.tables \
                           WHERE table_schema <> 'information_schema' ORDER BY table_name";
                self.run_quiet(sql)?;
            }
            MetaCommand::Devices => {
                self.run_quiet("SHOW DEVICES")?;
            }
            MetaCommand::Describe(name) => {
                // As in SQL: a quoted name is exact, an unquoted one is folded to lower case.
                let bare = if name.starts_with('"') && name.ends_with('"') && name.len() > 1 {
                    name[1..name.len() - 1].to_string()
                } else {
                    name.to_lowercase()
                };
                let bare = bare.as_str();
                if !self.ctx.table_names().iter().any(|t| t == bare) {
                    return Err(Failure::Error(format!(
                        "no table named '{bare}'; \\dt lists them"
                    )));
                }
                let sql = format!(
                    "SELECT column_name, data_type, is_nullable FROM information_schema.columns \
                     WHERE table_name = '{}' AND table_schema <> 'information_schema' \
                     ORDER BY ordinal_position",
                    bare.replace('\'', "''")
                );
                self.run_quiet(&sql)?;
            }
            MetaCommand::Format(None) => println!("format is {}", self.options.format),
            MetaCommand::Format(Some(f)) => self.options.format = f,
            MetaCommand::Timing(None) => {
                println!(
                    "timing is {}",
                    if self.options.timing { "on" } else { "off" }
                )
            }
            MetaCommand::Timing(Some(on)) => self.options.timing = on,
            MetaCommand::MaxRows(None) => println!("maxrows is {}", self.options.max_rows),
            MetaCommand::MaxRows(Some(n)) => self.options.max_rows = n,
            MetaCommand::Include(file) => {
                let text = std::fs::read_to_string(&file)
                    .map_err(|e| Failure::Error(format!("cannot read '{file}': {e}")))?;
                return self.run_script(&text);
            }
        }
        Ok(Control::Continue)
    }

    /// Runs SQL of the shell's own (for `\d`) without the timing line and with every row.
    fn run_quiet(&mut self, sql: &str) -> Result<(), Failure> {
        let saved = self.options.clone();
        self.options.timing = false;
        self.options.max_rows = 0;
        let result = self.run_sql(sql);
        self.options = saved;
        result.map(|_| ())
    }

    /// Names for tab completion: tables, their columns and functions.
    pub fn completion_names(&self) -> Vec<String> {
        let mut names = self.ctx.table_names();
        for table in names.clone() {
            let provider = self
                .runtime
                .block_on(self.ctx.session_context().table_provider(table.as_str()));
            if let Ok(provider) = provider {
                names.extend(provider.schema().fields().iter().map(|f| f.name().clone()));
            }
        }
        let state = self.ctx.session_context().state();
        names.extend(state.scalar_functions().keys().cloned());
        names.extend(state.aggregate_functions().keys().cloned());
        names
    }

    /// The interactive prompt. Returns when the user leaves with `\q` or Ctrl-D.
    pub fn repl(&mut self, history: Option<PathBuf>) -> anyhow::Result<()> {
        let config = Config::builder()
            .auto_add_history(true)
            .max_history_size(10_000)?
            .build();
        let mut editor: Editor<ShellHelper, DefaultHistory> = Editor::with_config(config)?;
        let mut helper = ShellHelper::new();
        helper.set_names(self.completion_names());
        editor.set_helper(Some(helper));
        if let Some(path) = &history {
            let _ = editor.load_history(path); // a first run has none
        }
        loop {
            match editor.readline("fulmen> ") {
                Ok(input) => {
                    let outcome = self.run_script(&input);
                    if let Some(path) = &history
                        && let Err(e) = editor.save_history(path)
                    {
                        eprintln!("warning: cannot save history to {}: {e}", path.display());
                    }
                    match outcome {
                        Ok(Control::Quit) => break,
                        Ok(Control::Continue) => {}
                        Err(failure) => eprintln!("{failure}"),
                    }
                    let names = self.completion_names();
                    if let Some(h) = editor.helper_mut() {
                        h.set_names(names);
                    }
                }
                Err(ReadlineError::Interrupted) => continue,
                Err(ReadlineError::Eof) => break,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}

/// Plans and runs one statement, printing its rows. Returns the number of rows printed, or
/// `None` for statements without a result (DDL, SET, …).
async fn execute(
    ctx: &FulmenContext,
    sql: &str,
    options: ShellOptions,
    rows: Arc<AtomicUsize>,
) -> Result<Option<usize>, Failure> {
    let fail = |e: DataFusionError| Failure::Error(describe_error(&e));
    let frame = ctx.sql(sql).await.map_err(fail)?;
    let schema = Arc::new(frame.schema().as_arrow().clone());
    let mut stream = frame.execute_stream().await.map_err(fail)?;
    if schema.fields().is_empty() {
        while let Some(batch) = stream.next().await {
            batch.map_err(fail)?;
        }
        return Ok(None);
    }
    let stdout = std::io::stdout();
    let mut printer = ResultPrinter::new(options.format, options.max_rows, schema, stdout.lock());
    while let Some(batch) = stream.next().await {
        let batch = batch.map_err(fail)?;
        printer.push(&batch).map_err(arrow_failure)?;
        rows.store(printer.rows(), Ordering::Relaxed);
    }
    let n = printer.finish().map_err(arrow_failure)?;
    Ok(Some(n))
}

/// Shows a spinner with the elapsed time and the rows so far, from one second after the
/// statement started until `done`.
async fn spin(rows: Arc<AtomicUsize>, done: Arc<AtomicBool>) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(1) {
        if done.load(Ordering::Relaxed) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let bar = ProgressBar::new_spinner().with_elapsed(start.elapsed());
    if let Ok(style) =
        ProgressStyle::with_template("{spinner} running {elapsed} · {msg} (Ctrl-C cancels)")
    {
        bar.set_style(style);
    }
    while !done.load(Ordering::Relaxed) {
        let n = rows.load(Ordering::Relaxed);
        bar.set_message(format!("{n} row{} so far", if n == 1 { "" } else { "s" }));
        bar.tick();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bar.finish_and_clear();
    let _ = std::io::stderr().flush();
}
