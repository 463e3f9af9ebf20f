//! `fulmen-bench`: TPC-H and SSB on Fulmen, DataFusion and DuckDB side by side.
//!
//! ```text
//! fulmen-bench tpch --sf 1 --engines fulmen,fulmen-gpu,datafusion,duckdb --iterations 5
//! fulmen-bench ssb --sf 1
//! FULMEN_DEVICES=emulated:2 fulmen-bench tpch --sf 0.1 --engines fulmen-gpu --resident
//! FULMEN_DEVICES=emulated:1 fulmen-bench tpch --sf 0.1 --engines fulmen-gpu --cluster 2
//! fulmen-bench stream --events 500000
//! ```
//! Generates the data once per scale factor (Parquet, cached), runs every query on every
//! engine, fails loudly when an engine's answer differs from DataFusion's, and writes
//! `<benchmark>-sf<SF>.json`, `.md` and `.svg` into the output folder.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use fulmen_benches::compare::first_difference;
use fulmen_benches::data;
use fulmen_benches::engines::{self, Engine, Outcome};
use fulmen_benches::report::Report;

#[derive(Parser, Debug)]
#[command(
    name = "fulmen-bench",
    about = "Benchmarks Fulmen against DataFusion and DuckDB"
)]
struct Args {
    #[command(subcommand)]
    benchmark: Benchmark,
}

#[derive(Subcommand, Debug)]
enum Benchmark {
    /// The 22 TPC-H queries.
    Tpch(Options),
    /// The 13 Star Schema Benchmark queries, on tables derived from TPC-H.
    Ssb(Options),
    /// Kafka ingest rate and window-close-to-alert latency (librdkafka's mock cluster).
    Stream(StreamOptions),
}

#[derive(clap::Args, Debug)]
struct StreamOptions {
    /// JSON events (about 200 bytes each) ingested into a live table.
    #[arg(long, default_value_t = 500_000)]
    events: usize,
    /// Seconds of wall-clock-stamped events for the latency measurement.
    #[arg(long, default_value_t = 20)]
    latency_seconds: u64,
    /// Where the report goes.
    #[arg(long, default_value = "bench-results")]
    output: PathBuf,
    /// Cards of the fraud pipeline's traffic (about 1.3 transactions per card and 10
    /// minutes of event time); 0 leaves the fraud pipeline out.
    #[arg(long, default_value_t = 20_000)]
    fraud_cards: usize,
    /// Minutes of event time of the fraud pipeline's traffic.
    #[arg(long, default_value_t = 120)]
    fraud_minutes: i64,
    /// Also run the fraud pipeline with its events produced as their event time comes, this
    /// many times faster than real time (0: only the backlog runs).
    #[arg(long, default_value_t = 0.0)]
    fraud_pace: f64,
}

async fn run_stream(options: StreamOptions) -> Result<bool> {
    eprintln!("machine: {}", machine());
    let report = fulmen_benches::stream::run(options.events, options.latency_seconds).await?;
    std::fs::create_dir_all(&options.output)?;
    let stem = options.output.join("stream");
    std::fs::write(
        stem.with_extension("json"),
        serde_json::to_string_pretty(&report.json())?,
    )?;
    let mut markdown = report.markdown();
    let mut ok = report.windows > 0;
    if options.fraud_cards > 0 {
        // With incremental windows (the default), then re-reading open windows.
        let mut runs = Vec::new();
        let mut paces = vec![None];
        if options.fraud_pace > 0.0 {
            paces.push(Some(options.fraud_pace));
        }
        for (pace, incremental) in paces.into_iter().flat_map(|p| [(p, true), (p, false)]) {
            let fraud = fulmen_benches::stream::fraud(
                options.fraud_cards,
                options.fraud_minutes,
                incremental,
                pace,
            )
            .await?;
            markdown.push('\n');
            markdown.push_str(&fraud.markdown());
            ok &= fraud.alerts == fraud.planted;
            runs.push(fraud.json());
        }
        std::fs::write(
            options.output.join("stream-fraud.json"),
            serde_json::to_string_pretty(&runs)?,
        )?;
    }
    std::fs::write(stem.with_extension("md"), &markdown)?;
    println!("{markdown}");
    eprintln!("wrote {}.{{json,md}}", stem.display());
    Ok(ok)
}

#[derive(clap::Args, Debug)]
struct Options {
    /// Scale factor (1 is 6 million line items).
    #[arg(long, default_value_t = 1.0)]
    sf: f64,
    /// Engines to compare, comma-separated: fulmen, fulmen-gpu, datafusion, duckdb (and
    /// fulmen-cluster, which --cluster adds).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "fulmen,fulmen-gpu,datafusion,duckdb"
    )]
    engines: Vec<Engine>,
    /// Runs per query; the median is reported.
    #[arg(long, default_value_t = 5)]
    iterations: usize,
    /// `fulmen.gpu.mode` of fulmen-gpu: auto (the cost model decides), or force (every
    /// supported operator on the device, and a device error fails the query: an answer
    /// check of the device path at scale).
    #[arg(long, default_value = "auto")]
    gpu_mode: fulmen_engine::GpuMode,
    /// Only these queries (TPC-H: 1,6,18; SSB: 1.1,3.2); all by default.
    #[arg(long, value_delimiter = ',')]
    queries: Vec<String>,
    /// Where generated data is cached (default: ~/.cache/fulmen/bench-data).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Where the report goes.
    #[arg(long, default_value = "bench-results")]
    output: PathBuf,
    /// Cache every table on fulmen-gpu's devices (CACHE TABLE) before timing, so that its
    /// queries read them from device memory (`h2d_bytes` shows what is still uploaded).
    #[arg(long)]
    resident: bool,
    /// With --resident, tables cached sharded by the hash of a key, as
    /// `lineitem=l_orderkey,orders=o_orderkey` (CACHE TABLE … OPTIONS ('shard_key' …)); the
    /// others are spread over the devices.
    #[arg(long, value_delimiter = ',', requires = "resident")]
    shard: Vec<String>,
    /// Also run the queries on a Ballista cluster of N local executors (engine
    /// fulmen-cluster; the `fulmen` binary beside fulmen-bench runs them), each on the
    /// devices FULMEN_DEVICES names, beside the single-process engines.
    #[arg(long, value_name = "N")]
    cluster: Option<usize>,
    /// A setting of the Fulmen engines' sessions, as `fulmen.gpu.single_stage_aggregation=false`
    /// (`SET` before the first query; repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    settings: Vec<String>,
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

async fn run(benchmark: &str, options: Options) -> Result<bool> {
    anyhow::ensure!(options.iterations > 0, "--iterations must be at least 1");
    let root = options
        .data_dir
        .clone()
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/fulmen/bench-data"))
        })
        .context("no --data-dir and no HOME")?;
    eprintln!(
        "generating {benchmark} SF {} as Parquet in {} (once)…",
        options.sf,
        root.display()
    );
    let (data, all, tables): (PathBuf, Vec<(String, String)>, Vec<&str>) = if benchmark == "ssb" {
        let queries = fulmen_benches::ssb::QUERIES
            .iter()
            .map(|(n, q)| (n.to_string(), q.to_string()))
            .collect();
        (
            data::ssb_parquet(&root, options.sf).await?,
            queries,
            fulmen_benches::ssb::TABLES.to_vec(),
        )
    } else {
        let queries = fulmen_engine::tpch::QUERIES
            .iter()
            .enumerate()
            .map(|(i, q)| (format!("Q{}", i + 1), q.to_string()))
            .collect();
        (
            data::tpch_parquet(&root, options.sf)?,
            queries,
            fulmen_engine::tpch::TABLES.to_vec(),
        )
    };
    let queries: Vec<(String, String)> = if options.queries.is_empty() {
        all
    } else {
        let mut chosen = Vec::new();
        for wanted in &options.queries {
            let name = format!("Q{}", wanted.trim_start_matches(['Q', 'q']));
            let found = all
                .iter()
                .find(|(n, _)| *n == name)
                .with_context(|| format!("there is no {benchmark} query {wanted}"))?;
            chosen.push(found.clone());
        }
        chosen
    };
    // DataFusion's answers are the reference, so it always runs.
    let mut order = vec![Engine::DataFusion];
    order.extend(
        options
            .engines
            .iter()
            .copied()
            .filter(|e| *e != Engine::DataFusion),
    );
    let cluster = match options.cluster {
        Some(executors) => {
            if options.resident {
                anyhow::bail!("--resident and --cluster: tables are not cached on a cluster yet");
            }
            if !order.contains(&Engine::FulmenCluster) {
                order.push(Engine::FulmenCluster);
            }
            Some(fulmen_benches::cluster::LocalCluster::start(executors)?)
        }
        None => {
            if order.contains(&Engine::FulmenCluster) {
                anyhow::bail!("the fulmen-cluster engine needs --cluster N");
            }
            None
        }
    };
    let datafusion_like: Vec<Engine> = order
        .iter()
        .copied()
        .filter(|e| *e != Engine::DuckDb)
        .collect();
    eprintln!(
        "running {} (interleaved)…",
        datafusion_like
            .iter()
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut shard_keys = Vec::new();
    for pair in &options.shard {
        let Some((table, key)) = pair.split_once('=') else {
            anyhow::bail!("--shard {pair}: expected table=key");
        };
        if !tables.contains(&table) {
            anyhow::bail!(
                "--shard {pair}: no table {table} (tables: {})",
                tables.join(", ")
            );
        }
        shard_keys.push((table.to_string(), key.to_string()));
    }
    let mut settings = Vec::new();
    for pair in &options.settings {
        let Some((key, value)) = pair.split_once('=') else {
            anyhow::bail!("--set {pair}: expected key=value");
        };
        settings.push((key.trim().to_string(), value.trim().to_string()));
    }
    let mut runs = engines::run_datafusion(
        &datafusion_like,
        options.gpu_mode,
        &data,
        &tables,
        &queries,
        options.iterations,
        engines::Placement {
            resident: options.resident.then_some(shard_keys.as_slice()),
            cluster: cluster.as_ref(),
            settings: &settings,
        },
    )
    .await?;
    drop(cluster);
    if order.contains(&Engine::DuckDb) {
        eprintln!("running duckdb…");
        runs.push(engines::run_duckdb(
            &data,
            &tables,
            &queries,
            options.iterations,
        )?);
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
        benchmark: benchmark.into(),
        scale_factor: options.sf,
        iterations: options.iterations,
        queries: queries.iter().map(|(n, _)| n.clone()).collect(),
        runs,
        machine: machine(),
        date: today(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
    };
    std::fs::create_dir_all(&options.output)?;
    // Named in full: `with_extension` would take SF 0.1's ".1" for an extension.
    let stem = options.output.join(format!("{benchmark}-sf{}", options.sf));
    let file = |extension: &str| PathBuf::from(format!("{}.{extension}", stem.display()));
    std::fs::write(file("json"), serde_json::to_string_pretty(&report.json())?)?;
    let markdown = report.markdown();
    std::fs::write(file("md"), &markdown)?;
    report.svg(&file("svg"))?;
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
            Benchmark::Tpch(options) => run("tpch", options).await,
            Benchmark::Ssb(options) => run("ssb", options).await,
            Benchmark::Stream(options) => run_stream(options).await,
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
