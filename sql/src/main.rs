//! `fulmen`: the interactive SQL shell and script runner.

use std::io::{IsTerminal, Read};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use fulmen_engine::{FulmenConfig, FulmenContext};
use fulmen_sql::{Control, Failure, OutputFormat, Shell, ShellOptions};

/// Fulmen: SQL analytics on GPUs, built on Apache DataFusion.
///
/// With no -c or -f, reads SQL from standard input when it is not a terminal, and opens
/// the interactive shell when it is.
#[derive(Parser, Debug)]
#[command(name = "fulmen", version, about, long_about = None)]
struct Args {
    /// Run this SQL (one or more statements) and exit; may be given several times.
    #[arg(short = 'c', long = "command", value_name = "SQL")]
    commands: Vec<String>,

    /// Run the statements in this file and exit; may be given several times.
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    files: Vec<PathBuf>,

    /// Load the TPC-H tables generated in memory at scale factor SF (default 0.1).
    #[arg(long, value_name = "SF", num_args = 0..=1, default_missing_value = "0.1")]
    demo: Option<f64>,

    /// Output format: table, csv, tsv, json, ndjson or markdown.
    #[arg(long, default_value = "table")]
    format: OutputFormat,

    /// Rows the table format shows before cutting (0: all).
    #[arg(long, default_value_t = 40)]
    maxrows: usize,

    /// Do not print the row count and elapsed time after each statement.
    #[arg(short, long)]
    quiet: bool,

    /// Devices to use: auto, none, cuda:0,1 or emulated:N (default: $FULMEN_DEVICES, else auto).
    #[arg(long, value_name = "DEVICES")]
    devices: Option<String>,
}

fn main() -> ExitCode {
    // A panic is a bug: report it on one line instead of a backtrace, and let the
    // statement that hit it fail (the shell catches it and carries on).
    std::panic::set_hook(Box::new(|info| {
        eprintln!("fulmen: internal error: {info}");
    }));
    let args = Args::parse();
    match run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("Error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> anyhow::Result<ExitCode> {
    let mut config = FulmenConfig::from_env()?;
    if let Some(devices) = &args.devices {
        config.devices = devices.parse()?;
    }
    let runtime = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?,
    );
    let ctx = FulmenContext::with_config(config);
    // Kafka live tables and sinks: `STORED AS KAFKA`, `SHOW STREAMS`, `CREATE SINK` …
    let _streams = fulmen_connectors::install(&ctx);
    let interactive =
        args.commands.is_empty() && args.files.is_empty() && std::io::stdin().is_terminal();
    if let Some(sf) = args.demo {
        let start = std::time::Instant::now();
        ctx.register_tpch(sf)?;
        if interactive {
            eprintln!(
                "Loaded TPC-H at scale factor {sf} in {:.1} s: {}.\nTry:\n  \
                 SELECT l_returnflag, count(*) FROM lineitem GROUP BY 1 ORDER BY 1;\n  \
                 SELECT n_name, round(sum(o_totalprice)) AS revenue FROM orders \
                 JOIN customer ON o_custkey = c_custkey JOIN nation ON c_nationkey = n_nationkey \
                 GROUP BY n_name ORDER BY revenue DESC LIMIT 5;",
                start.elapsed().as_secs_f64(),
                fulmen_engine::tpch::TABLES.join(", ")
            );
        }
    }
    let options = ShellOptions {
        format: args.format,
        timing: !args.quiet,
        max_rows: args.maxrows,
    };
    let mut shell = Shell::new(ctx, runtime, options);

    if interactive {
        if !args.quiet {
            eprintln!(
                "Fulmen {} — SQL on GPUs, built on Apache DataFusion. \\? for help, \\q to quit.",
                env!("CARGO_PKG_VERSION")
            );
            if shell.context().table_names().is_empty() {
                eprintln!(
                    "No tables yet. Load some with CREATE EXTERNAL TABLE t STORED AS PARQUET \
                     LOCATION 'path/to/data.parquet';\nor query a file directly: \
                     SELECT * FROM 'data.csv'; — or restart with --demo for TPC-H sample data."
                );
            }
        }
        let history = std::env::var_os("FULMEN_HISTORY")
            .map(PathBuf::from)
            .or_else(|| dirs::home_dir().map(|h| h.join(".fulmen_history")));
        shell.repl(history)?;
        return Ok(ExitCode::SUCCESS);
    }

    let mut scripts: Vec<(String, String)> = args
        .commands
        .iter()
        .map(|c| ("-c".to_string(), c.clone()))
        .collect();
    for file in &args.files {
        let text = std::fs::read_to_string(file)
            .map_err(|e| anyhow::anyhow!("cannot read '{}': {e}", file.display()))?;
        scripts.push((file.display().to_string(), text));
    }
    if args.commands.is_empty() && args.files.is_empty() {
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text)?;
        scripts.push(("stdin".to_string(), text));
    }
    for (_, text) in scripts {
        match shell.run_script(&text) {
            Ok(Control::Continue) => {}
            Ok(Control::Quit) | Err(Failure::OutputClosed) => break,
            Err(failure) => {
                eprintln!("{failure}");
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
