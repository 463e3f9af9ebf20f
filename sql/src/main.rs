//! `fulmen`: the interactive SQL shell and script runner, and `fulmen run`, which runs
//! streaming pipelines as a service.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use fulmen_connectors::streams::Streams;
use fulmen_engine::{FulmenConfig, FulmenContext};
use fulmen_sql::{Control, Failure, OutputFormat, Shell, ShellOptions};

/// Fulmen: SQL analytics on GPUs, built on Apache DataFusion.
///
/// With no -c or -f, reads SQL from standard input when it is not a terminal, and opens
/// the interactive shell when it is.
#[derive(Parser, Debug)]
#[command(name = "fulmen", version, about, long_about = None)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,

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
    #[arg(long, default_value = "table", global = true)]
    format: OutputFormat,

    /// Rows the table format shows before cutting (0: all).
    #[arg(long, default_value_t = 40)]
    maxrows: usize,

    /// Do not print the row count and elapsed time after each statement.
    #[arg(short, long, global = true)]
    quiet: bool,

    /// Devices to use: auto, none, cuda:0,1 or emulated:N (default: $FULMEN_DEVICES, else auto).
    #[arg(long, value_name = "DEVICES", global = true)]
    devices: Option<String>,

    /// Run queries on the Ballista cluster whose scheduler listens at HOST:PORT (see
    /// docs/cluster.md): tables must be files or object stores every executor can read.
    #[arg(long, value_name = "HOST:PORT")]
    cluster: Option<String>,

    /// Logs on stderr at this level and above: error, warn, info, debug, trace or off
    /// (default: $RUST_LOG, which also takes per-module filters, else warn; info for
    /// `fulmen run`). librdkafka's messages are among them.
    #[arg(long, value_name = "LEVEL", global = true)]
    log_level: Option<log::LevelFilter>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run pipeline scripts as a service: run their statements, then keep the live tables
    /// and sinks running until SIGINT or SIGTERM, which stop each sink after its current
    /// tick (written, flushed, committed) and exit 0. A sink that keeps failing ends the
    /// process with status 2 and its error, for a supervisor to restart it.
    Run(RunArgs),
    /// Run a cluster's scheduler (Apache DataFusion Ballista's), which plans each query's
    /// stages and hands their tasks to executors. It has no authentication and no TLS:
    /// bind it where only trusted machines reach it (see docs/cluster.md).
    Scheduler(SchedulerArgs),
    /// Run a cluster executor, which runs stages on this machine's devices (--devices)
    /// and serves their output to the other executors and to clients.
    Executor(ExecutorArgs),
}

#[derive(clap::Args, Debug)]
struct SchedulerArgs {
    /// Where to listen for clients and executors (default loopback only; give a
    /// non-loopback address to serve other machines).
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:50050")]
    bind: SocketAddr,
}

#[derive(clap::Args, Debug)]
struct ExecutorArgs {
    /// The scheduler's HOST:PORT.
    #[arg(long, value_name = "HOST:PORT")]
    scheduler: String,

    /// Where to serve stage output (Arrow Flight); clients and other executors fetch it
    /// here (default loopback only).
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:50051")]
    bind: SocketAddr,

    /// The port of the task service, on the same host (default: --bind's port + 1).
    #[arg(long, value_name = "PORT")]
    grpc_port: Option<u16>,

    /// Tasks run at once (default: the machine's cores).
    #[arg(long, value_name = "N")]
    slots: Option<usize>,

    /// Where to write shuffle files (default: a new temporary directory).
    #[arg(long, value_name = "DIR")]
    work_dir: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// The scripts, run in order (the first failing statement ends the process: status 1).
    #[arg(required = true, value_name = "FILE")]
    files: Vec<PathBuf>,

    /// Serve Prometheus metrics on http://ADDR/metrics and a health check on /health
    /// (e.g. 127.0.0.1:9464; port 0 picks a free port, logged at info level).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,

    /// A sink whose ticks have failed for this long, with no success, ends the process.
    #[arg(long, value_name = "SECONDS", default_value_t = 60.0)]
    sink_failure_timeout: f64,
}

/// Leveled logs on stderr: `--log-level`, else `RUST_LOG`, else `default`.
fn init_logging(level: Option<log::LevelFilter>, default: log::LevelFilter) {
    let mut builder = env_logger::Builder::new();
    builder.filter_level(default);
    match (level, std::env::var("RUST_LOG")) {
        (Some(level), _) => {
            builder.filter_level(level);
        }
        (None, Ok(filters)) => {
            builder.parse_filters(&filters);
        }
        (None, Err(_)) => {}
    }
    builder
        .target(env_logger::Target::Stderr)
        .format_timestamp_millis()
        .init();
}

fn main() -> ExitCode {
    // A panic is a bug: report it on one line instead of a backtrace, and let the
    // statement that hit it fail (the shell catches it and carries on).
    std::panic::set_hook(Box::new(|info| {
        eprintln!("fulmen: internal error: {info}");
    }));
    let args = Args::parse();
    let default_level = if args.command.is_some() {
        log::LevelFilter::Info
    } else {
        log::LevelFilter::Warn
    };
    init_logging(args.log_level, default_level);
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
    match args.command {
        Some(Command::Scheduler(scheduler)) => return cluster_scheduler(&runtime, scheduler),
        Some(Command::Executor(executor)) => return cluster_executor(&runtime, executor, config),
        _ => {}
    }
    let ctx = match &args.cluster {
        Some(url) => {
            if args.demo.is_some() {
                anyhow::bail!(
                    "--demo loads tables into this process, which a cluster's executors \
                     cannot read; on a cluster, create tables of files every executor can \
                     read (see docs/cluster.md)"
                );
            }
            runtime.block_on(FulmenContext::remote_with_config(url, config))?
        }
        None => FulmenContext::with_config(config),
    };
    // Kafka live tables and sinks: `STORED AS KAFKA`, `SHOW STREAMS`, `CREATE SINK` …
    let streams = fulmen_connectors::install(&ctx);
    let interactive = args.command.is_none()
        && args.commands.is_empty()
        && args.files.is_empty()
        && std::io::stdin().is_terminal();
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
    let mut shell = Shell::new(ctx.clone(), Arc::clone(&runtime), options);
    if let Some(Command::Run(run_args)) = args.command {
        return service(&mut shell, &streams, &ctx, &runtime, run_args);
    }

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
        // Piped input runs statement by statement as it arrives.
        return Ok(match shell.run_stream(std::io::stdin().lock()) {
            Ok(_) | Err(Failure::OutputClosed) => ExitCode::SUCCESS,
            Err(failure) => {
                eprintln!("{failure}");
                ExitCode::FAILURE
            }
        });
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

/// `fulmen scheduler`: runs until the process is stopped.
fn cluster_scheduler(
    runtime: &tokio::runtime::Runtime,
    args: SchedulerArgs,
) -> anyhow::Result<ExitCode> {
    warn_if_exposed("scheduler", args.bind);
    runtime.block_on(fulmen_cluster::run_scheduler(
        fulmen_cluster::SchedulerOptions { bind: args.bind },
    ))?;
    Ok(ExitCode::SUCCESS)
}

/// `fulmen executor`: runs until the process is stopped.
fn cluster_executor(
    runtime: &tokio::runtime::Runtime,
    args: ExecutorArgs,
    config: FulmenConfig,
) -> anyhow::Result<ExitCode> {
    let address = fulmen_engine::cluster::scheduler_address(&args.scheduler)?;
    let (host, port) = address
        .rsplit_once(':')
        .and_then(|(h, p)| Some((h, p.parse().ok()?)))
        .ok_or_else(|| anyhow::anyhow!("--scheduler '{}' is not HOST:PORT", args.scheduler))?;
    let grpc_port =
        match args.grpc_port {
            Some(port) => port,
            None => args.bind.port().checked_add(1).ok_or_else(|| {
                anyhow::anyhow!("--bind's port is the last one; give --grpc-port")
            })?,
        };
    if args.bind.port() == 0 || grpc_port == 0 {
        anyhow::bail!("an executor's ports are given, not 0: the scheduler reaches it there");
    }
    if args.slots == Some(0) {
        anyhow::bail!("--slots must be at least 1");
    }
    warn_if_exposed("executor", args.bind);
    runtime.block_on(fulmen_engine::cluster::probe(&address))?;
    runtime.block_on(fulmen_cluster::run_executor(
        fulmen_cluster::ExecutorOptions {
            scheduler: (host.to_string(), port),
            bind: args.bind,
            grpc_port,
            devices: config.devices,
            slots: args.slots,
            work_dir: args.work_dir,
        },
    ))?;
    Ok(ExitCode::SUCCESS)
}

/// Says so when a cluster process listens beyond this machine: nothing authenticates its
/// callers or encrypts its traffic.
fn warn_if_exposed(process: &str, bind: SocketAddr) {
    if !bind.ip().is_loopback() {
        log::warn!(
            "the {process} listens on {bind}, beyond this machine: anyone who reaches it can \
             run queries and read what the cluster reads (no authentication, no TLS)"
        );
    }
}

/// `fulmen run`: the scripts, then the sinks until a signal or a sink failing for good.
fn service(
    shell: &mut Shell,
    streams: &Arc<Streams>,
    ctx: &FulmenContext,
    runtime: &tokio::runtime::Runtime,
    args: RunArgs,
) -> anyhow::Result<ExitCode> {
    if !(args.sink_failure_timeout.is_finite() && args.sink_failure_timeout > 0.0) {
        anyhow::bail!("--sink-failure-timeout must be a positive number of seconds");
    }
    let timeout = Duration::from_secs_f64(args.sink_failure_timeout);
    for file in &args.files {
        let text = std::fs::read_to_string(file)
            .map_err(|e| anyhow::anyhow!("cannot read '{}': {e}", file.display()))?;
        match shell.run_script(&text) {
            Ok(Control::Continue) => {}
            Ok(Control::Quit) | Err(Failure::OutputClosed) => break,
            Err(failure) => {
                eprintln!("{}: {failure}", file.display());
                streams.shutdown();
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    let server = match args.metrics {
        Some(addr) => {
            let (local, task) = runtime
                .block_on(fulmen_connectors::metrics::serve(
                    addr,
                    Arc::clone(streams),
                    ctx.clone(),
                ))
                .map_err(|e| anyhow::anyhow!("--metrics {addr}: {e}"))?;
            log::info!("metrics on http://{local}/metrics, health on http://{local}/health");
            Some(task)
        }
        None => None,
    };
    let sinks = streams.sinks().list().len();
    if sinks == 0 {
        log::warn!("no sink runs: the pipeline only ingests until it is stopped");
    }
    log::info!(
        "{} live tables and {sinks} sinks running; SIGINT or SIGTERM stops them",
        streams.tables().len()
    );
    let outcome: anyhow::Result<Option<String>> = runtime.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let mut check = tokio::time::interval(Duration::from_millis(500));
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {
                    log::info!("SIGINT: stopping");
                    return Ok(None);
                }
                _ = term.recv() => {
                    log::info!("SIGTERM: stopping");
                    return Ok(None);
                }
                _ = check.tick() => {
                    let failing = streams.sinks().failing().into_iter().find(|f| f.1 >= timeout);
                    if let Some((name, failing, error)) = failing {
                        return Ok(Some(format!(
                            "sink '{name}' failed every tick for {:.0} s: {error}",
                            failing.as_secs_f64()
                        )));
                    }
                }
            }
        }
    });
    // Each sink stops after its current tick, whose output is flushed and whose offsets
    // are committed before it ends; then ingestion stops.
    streams.shutdown();
    if let Some(task) = server {
        task.abort();
    }
    match outcome? {
        None => {
            log::info!("stopped");
            Ok(ExitCode::SUCCESS)
        }
        Some(failure) => {
            eprintln!("Error: {failure}");
            Ok(ExitCode::from(2))
        }
    }
}
