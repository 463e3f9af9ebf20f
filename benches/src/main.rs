//! `volley-bench`: TPC-H on Volley, DataFusion and DuckDB side by side.
//!
//! ```text
//! volley-bench tpch --sf 1 --engines volley,volley-gpu,datafusion,duckdb --iterations 5
//! ```
//! Generates the data once per scale factor (Parquet, cached), runs every query on every
//! engine, fails loudly when an engine's answer differs from DataFusion's, and writes
//! `tpch-sf<SF>.json`, `.md` and `.svg` into the output folder.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use volley_benches::compare::first_difference;
use volley_benches::data;
use volley_benches::engines::{self, Engine, Outcome};
use volley_benches::report::Report;

#[derive(Parser, Debug)]
#[command(
    name = "volley-bench",
    about = "Benchmarks Volley against DataFusion and DuckDB"
)]
struct Args {
    #[command(subcommand)]
    benchmark: Benchmark,
}

#[derive(Subcommand, Debug)]
enum Benchmark {
    /// The 22 TPC-H queries.
    Tpch(Options),
}

#[derive(clap::Args, Debug)]
struct Options {
    /// Scale factor (1 is 6 million line items).
    #[arg(long, default_value_t = 1.0)]
    sf: f64,
    /// Engines to compare, comma-separated: volley, volley-gpu, datafusion, duckdb.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "volley,volley-gpu,datafusion,duckdb"
    )]
    engines: Vec<Engine>,
    /// Runs per query; the median is reported.
    #[arg(long, default_value_t = 5)]
    iterations: usize,
    /// Only these queries (e.g. 1,6,18); all by default.
    #[arg(long, value_delimiter = ',')]
    queries: Vec<usize>,
    /// Where generated data is cached (default: ~/.cache/volley/bench-data).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Where the report goes.
    #[arg(long, default_value = "bench-results")]
    output: PathBuf,
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .next()
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map(|kib| kib / (1024.0 * 1024.0))
        .unwrap_or(0.0);
    format!("{cpu}, {cores} cores, {mem_gib:.0} GiB")
}

fn today() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

async fn tpch(options: Options) -> Result<bool> {
    anyhow::ensure!(options.iterations > 0, "--iterations must be at least 1");
    let root = options
        .data_dir
        .clone()
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/volley/bench-data"))
        })
        .context("no --data-dir and no HOME")?;
    eprintln!(
        "generating TPC-H SF {} as Parquet in {} (once)…",
        options.sf,
        root.display()
    );
    let data = data::tpch_parquet(&root, options.sf)?;
    let selected: Vec<usize> = if options.queries.is_empty() {
        (1..=22).collect()
    } else {
        options.queries.clone()
    };
    let mut queries = Vec::new();
    for q in &selected {
        let sql = volley_engine::tpch::QUERIES
            .get(q.wrapping_sub(1))
            .with_context(|| format!("there is no TPC-H query {q}"))?;
        queries.push((format!("Q{q}"), sql.to_string()));
    }
    // DataFusion's answers are the reference, so it always runs.
    let mut order = vec![Engine::DataFusion];
    order.extend(
        options
            .engines
            .iter()
            .copied()
            .filter(|e| *e != Engine::DataFusion),
    );
    let tables = volley_engine::tpch::TABLES;
    let mut runs = Vec::new();
    for engine in order {
        eprintln!("running {engine}…");
        let run = match engine {
            Engine::DuckDb => engines::run_duckdb(&data, &tables, &queries, options.iterations)?,
            other => {
                engines::run_datafusion(other, &data, &tables, &queries, options.iterations).await?
            }
        };
        runs.push(run);
    }
    let mut ok = true;
    let reference = runs[0].outcomes.clone();
    for run in &runs {
        for ((name, _), (mine, theirs)) in queries.iter().zip(run.outcomes.iter().zip(&reference)) {
            match (mine, theirs) {
                (Outcome::Failed(e), _) => {
                    ok = false;
                    eprintln!("FAILED: {name} on {}: {e}", run.engine);
                }
                (Outcome::Ran { rows, .. }, Outcome::Ran { rows: expected, .. }) => {
                    if let Some(diff) = first_difference(expected, rows) {
                        ok = false;
                        eprintln!(
                            "MISMATCH: {name} on {} differs from DataFusion: {diff}",
                            run.engine
                        );
                    }
                }
                _ => {}
            }
        }
    }
    let report = Report {
        benchmark: "tpch".into(),
        scale_factor: options.sf,
        iterations: options.iterations,
        queries: queries.iter().map(|(n, _)| n.clone()).collect(),
        runs,
        machine: machine(),
        date: today(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
    };
    std::fs::create_dir_all(&options.output)?;
    let stem = options.output.join(format!("tpch-sf{}", options.sf));
    std::fs::write(
        stem.with_extension("json"),
        serde_json::to_string_pretty(&report.json())?,
    )?;
    let markdown = report.markdown();
    std::fs::write(stem.with_extension("md"), &markdown)?;
    report.svg(&stem.with_extension("svg"))?;
    println!("{markdown}");
    eprintln!("wrote {}.{{json,md,svg}}", stem.display());
    Ok(ok)
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async {
        match args.benchmark {
            Benchmark::Tpch(options) => tpch(options).await,
        }
    });
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("error: some answers were wrong or missing (see above)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
