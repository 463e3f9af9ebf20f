//! The engines a benchmark compares, each running the same queries over the same Parquet
//! files. Setup (registering tables) is not timed; each query's time covers planning,
//! execution and collecting every row.

use std::fmt;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::str::FromStr;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use datafusion::prelude::{ParquetReadOptions, SessionContext};
use fulmen_engine::display::rows_as_text;
use fulmen_engine::{FulmenConfig, FulmenContext, GpuMode};

/// An engine under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// Fulmen with the GPU off: DataFusion plus Fulmen's session (the overhead check).
    Fulmen,
    /// Fulmen with `fulmen.gpu.mode = auto` (or `force`, with `--gpu-mode force`, where a device
    /// error fails the query) on whatever
    /// devices `FULMEN_DEVICES` gives.
    FulmenGpu,
    /// Fulmen on a local Ballista cluster (`--cluster N`): `fulmen-gpu`'s settings, each
    /// executor on the devices `FULMEN_DEVICES` names.
    FulmenCluster,
    /// Plain DataFusion, the reference for answers and ratios.
    DataFusion,
    /// DuckDB through its Python package.
    DuckDb,
}

impl FromStr for Engine {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.trim() {
            "fulmen" => Self::Fulmen,
            "fulmen-gpu" => Self::FulmenGpu,
            "fulmen-cluster" => Self::FulmenCluster,
            "datafusion" => Self::DataFusion,
            "duckdb" => Self::DuckDb,
            other => bail!(
                "unknown engine '{other}' (fulmen, fulmen-gpu, fulmen-cluster, datafusion, duckdb)"
            ),
        })
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Fulmen => "fulmen",
            Self::FulmenGpu => "fulmen-gpu",
            Self::FulmenCluster => "fulmen-cluster",
            Self::DataFusion => "datafusion",
            Self::DuckDb => "duckdb",
        })
    }
}

/// One query on one engine.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// It ran: the time of each iteration and the answer of the first.
    Ran {
        /// Milliseconds per iteration.
        times_ms: Vec<f64>,
        /// The answer, cells as text (NULL for nulls).
        rows: Vec<Vec<String>>,
        /// The device work of the first (untimed) run, summed over the devices: counted
        /// for `fulmen-gpu`, `None` for engines without devices.
        device: Option<fulmen_kernels::DeviceCounts>,
    },
    /// It failed with this error.
    Failed(String),
}

/// All queries on one engine.
#[derive(Debug, Clone)]
pub struct EngineRun {
    /// Which engine.
    pub engine: Engine,
    /// Why the engine did not run, or a caveat about its numbers.
    pub note: Option<String>,
    /// One outcome per query, in query order (empty when the engine was skipped).
    pub outcomes: Vec<Outcome>,
}

/// The session of a DataFusion-based engine, with its Fulmen context where it has one;
/// `fulmen-cluster`'s runs on the scheduler at `cluster`.
async fn datafusion_session(
    engine: Engine,
    gpu: GpuMode,
    cluster: Option<&str>,
) -> Result<(SessionContext, Option<FulmenContext>)> {
    let gpu_mode = match engine {
        Engine::DataFusion => return Ok((SessionContext::new(), None)),
        Engine::Fulmen => GpuMode::Off,
        Engine::FulmenGpu | Engine::FulmenCluster => gpu,
        Engine::DuckDb => bail!("DuckDB is not a DataFusion session"),
    };
    let mut config = FulmenConfig {
        gpu_mode,
        ..FulmenConfig::from_env()?
    };
    if gpu_mode == GpuMode::Force {
        // An answer check of the device path: a device error fails the query rather than
        // being redone on the CPU.
        config.gpu_on_error = fulmen_engine::OnError::Fail;
    }
    let fulmen = match (engine, cluster) {
        (Engine::FulmenCluster, Some(scheduler)) => {
            FulmenContext::remote_with_config(scheduler, config).await?
        }
        (Engine::FulmenCluster, None) => bail!("fulmen-cluster runs with --cluster N"),
        _ => FulmenContext::with_config(config),
    };
    Ok((fulmen.session_context().clone(), Some(fulmen)))
}

/// Where fulmen-gpu's tables and fulmen-cluster's queries go.
#[derive(Debug, Clone, Copy, Default)]
pub struct Placement<'a> {
    /// `--resident`: every table cached on fulmen-gpu's devices, these sharded by their key.
    pub resident: Option<&'a [(String, String)]>,
    /// `--cluster N`: the local cluster fulmen-cluster runs on.
    pub cluster: Option<&'a crate::cluster::LocalCluster>,
    /// `--set KEY=VALUE`: settings of the Fulmen engines' sessions (`SET KEY = 'VALUE'`).
    pub settings: &'a [(String, String)],
}

/// Runs `queries` (name, SQL) on the DataFusion-based `engines`, interleaved so that no
/// engine gains from running after another (warm caches, a quieter machine): for each query,
/// every engine first runs it once untimed (its answer is kept), then the timed iterations
/// go round the engines, starting with a different one each time. `fulmen-gpu` runs with
/// `fulmen.gpu.mode = gpu` (auto, or force to put every supported operator on the device).
pub async fn run_datafusion(
    engines: &[Engine],
    gpu: GpuMode,
    data: &Path,
    tables: &[&str],
    queries: &[(String, String)],
    iterations: usize,
    placement: Placement<'_>,
) -> Result<Vec<EngineRun>> {
    let Placement {
        resident,
        cluster,
        settings,
    } = placement;
    let mut sessions = Vec::with_capacity(engines.len());
    let mut cached = None;
    for &engine in engines {
        let scheduler = cluster.map(|c| c.scheduler.as_str());
        let (ctx, fulmen) = datafusion_session(engine, gpu, scheduler).await?;
        for (key, value) in settings.iter().filter(|_| fulmen.is_some()) {
            let value = value.replace('\'', "''");
            ctx.sql(&format!("SET {key} = '{value}'"))
                .await
                .with_context(|| format!("--set {key}={value}"))?;
        }
        for table in tables {
            let path = data.join(format!("{table}.parquet"));
            ctx.register_parquet(
                *table,
                path.to_string_lossy().as_ref(),
                ParquetReadOptions::default(),
            )
            .await
            .with_context(|| format!("registering {}", path.display()))?;
        }
        if let (Engine::FulmenGpu, Some(shards), Some(fulmen)) = (engine, resident, &fulmen) {
            cached = Some(cache_tables(fulmen, tables, shards).await?);
        }
        sessions.push(ctx);
    }
    // The devices fulmen-gpu runs on, whose counts are read around each query's first run.
    let devices = FulmenConfig::from_env()
        .ok()
        .and_then(|c| fulmen_engine::gpu::devices::devices(&c.devices).ok())
        .map(|d| d.to_vec())
        .unwrap_or_default();
    let total = |devices: &[fulmen_kernels::Device]| {
        let mut all = fulmen_kernels::DeviceCounts::default();
        for d in devices {
            all += &d.counts();
        }
        all
    };
    let mut outcomes: Vec<Vec<Outcome>> = vec![Vec::with_capacity(queries.len()); engines.len()];
    for (_, sql) in queries {
        let mut times: Vec<Vec<f64>> = vec![Vec::with_capacity(iterations); engines.len()];
        let mut answers: Vec<Result<Vec<Vec<String>>, String>> = Vec::with_capacity(engines.len());
        let mut device_work = vec![None; engines.len()];
        for (e, ctx) in sessions.iter().enumerate() {
            let before = total(&devices);
            let answer = async { ctx.sql(sql).await?.collect().await }.await;
            if engines[e] == Engine::FulmenGpu && !devices.is_empty() {
                device_work[e] = Some(total(&devices).since(&before));
            }
            answers.push(match answer {
                Ok(batches) => rows_as_text(&batches).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            });
        }
        for iteration in 0..iterations {
            for k in 0..engines.len() {
                let e = (iteration + k) % engines.len();
                if answers[e].is_err() {
                    continue;
                }
                let start = Instant::now();
                let result = async { sessions[e].sql(sql).await?.collect().await }.await;
                let elapsed = start.elapsed().as_secs_f64() * 1e3;
                match result {
                    Ok(_) => times[e].push(elapsed),
                    Err(err) => answers[e] = Err(err.to_string()),
                }
            }
        }
        for (e, answer) in answers.into_iter().enumerate() {
            outcomes[e].push(match answer {
                Ok(rows) => Outcome::Ran {
                    times_ms: std::mem::take(&mut times[e]),
                    rows,
                    device: device_work[e],
                },
                Err(error) => Outcome::Failed(error),
            });
        }
    }
    Ok(engines
        .iter()
        .zip(outcomes)
        .map(|(&engine, outcomes)| EngineRun {
            engine,
            note: match (engine, cluster) {
                (Engine::FulmenCluster, Some(cluster)) => Some(format!(
                    "{} local executors and a scheduler (Ballista), child processes on this \
                     machine, each executor on FULMEN_DEVICES = {} (fulmen.gpu.mode = {}); \
                     times include Ballista's scheduling and its shuffles through files",
                    cluster.executors,
                    std::env::var("FULMEN_DEVICES").unwrap_or_else(|_| "auto".into()),
                    format!("{gpu:?}").to_lowercase()
                )),
                _ => None,
            }
            .or((engine == Engine::FulmenGpu).then(|| {
                let note = fulmen_gpu_note(gpu);
                match &cached {
                    Some(cached) => format!("{note}; {cached}"),
                    None => note,
                }
            })),
            outcomes,
        })
        .collect())
}

/// Caches every table on fulmen-gpu's devices (`--resident`) before anything is timed, those
/// in `shards` sharded by their key: what the note says of it. A table that cannot be cached
/// fails the run.
async fn cache_tables(
    fulmen: &FulmenContext,
    tables: &[&str],
    shards: &[(String, String)],
) -> Result<String> {
    let (mut rows, mut bytes) = (0usize, 0usize);
    let mut replicated = Vec::new();
    for table in tables {
        let shard_key = shards
            .iter()
            .find(|(t, _)| t == table)
            .map(|(_, key)| key.clone());
        let options = fulmen_engine::cache::CacheOptions { shard_key };
        let summary = fulmen
            .cache_table_with(table, &options)
            .await
            .with_context(|| format!("--resident: caching {table}"))?;
        eprintln!(
            "cached {table}: {} rows, {} chunks, {} device bytes on {}{}",
            summary.rows,
            summary.chunks,
            summary.bytes,
            summary.devices,
            match (&summary.shard_key, summary.replicated) {
                (Some(k), _) => format!(", sharded by {k}"),
                (None, true) => ", replicated".to_string(),
                (None, false) => String::new(),
            }
        );
        if summary.replicated {
            replicated.push(*table);
        }
        rows += summary.rows;
        bytes += summary.bytes;
    }
    let sharded: Vec<String> = shards.iter().map(|(t, k)| format!("{t} by {k}")).collect();
    let sharded = match sharded.is_empty() {
        true => String::new(),
        false => format!("; sharded: {}", sharded.join(", ")),
    };
    let replicated = match replicated.is_empty() {
        true => String::new(),
        false => format!("; replicated on every device: {}", replicated.join(", ")),
    };
    Ok(format!(
        "every table cached on the devices before timing (--resident: {rows} rows, \
         {}{sharded}{replicated})",
        fulmen_engine::cache::size(bytes)
    ))
}

/// Where `fulmen-gpu` ran: the devices it found, and what of the plans runs on them.
fn fulmen_gpu_note(mode: GpuMode) -> String {
    let mode = format!("{mode:?}").to_lowercase();
    let selection = FulmenConfig::from_env()
        .map(|c| c.devices)
        .unwrap_or_default();
    match fulmen_engine::gpu::devices::devices(&selection) {
        Ok(devices) if devices.is_empty() => {
            format!("no device (fulmen.devices = {selection}): fulmen-gpu ran on the CPU")
        }
        Ok(devices) => format!(
            "supported filters, projections, aggregations and joins on {} (fulmen.gpu.mode = \
             {mode}){}",
            fulmen_engine::gpu::devices::describe(&devices),
            if devices
                .iter()
                .any(|d| d.kind() == fulmen_kernels::DeviceKind::Emulated)
            {
                "; emulated devices prove it runs, their times mean nothing"
            } else {
                ""
            }
        ),
        Err(e) => format!("no device ({e}): fulmen-gpu ran on the CPU"),
    }
}

/// Runs `queries` on DuckDB through `python3` and its `duckdb` package; without them the
/// engine is skipped with a note.
pub fn run_duckdb(
    data: &Path,
    tables: &[&str],
    queries: &[(String, String)],
    iterations: usize,
) -> Result<EngineRun> {
    let request = serde_json::json!({
        "data_dir": data.to_string_lossy(),
        "tables": tables,
        "queries": queries,
        "iterations": iterations,
    });
    let spawned = Command::new("python3")
        .args(["-c", include_str!("../duckdb_runner.py")])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let skipped = |why: String| EngineRun {
        engine: Engine::DuckDb,
        note: Some(format!("skipped: {why}")),
        outcomes: Vec::new(),
    };
    let mut child = match spawned {
        Ok(child) => child,
        Err(e) => return Ok(skipped(format!("python3 cannot run ({e})"))),
    };
    child
        .stdin
        .take()
        .ok_or_else(|| anyhow!("no stdin for python3"))?
        .write_all(request.to_string().as_bytes())?;
    let output = child.wait_with_output()?;
    if output.status.code() == Some(3) {
        return Ok(skipped(
            "the Python package duckdb is not installed (pip install duckdb)".into(),
        ));
    }
    if !output.status.success() {
        bail!(
            "the DuckDB runner failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let mut lines = std::str::from_utf8(&output.stdout)?.lines();
    let version: serde_json::Value = serde_json::from_str(lines.next().unwrap_or("{}"))?;
    let mut outcomes = Vec::with_capacity(queries.len());
    for line in lines {
        let v: serde_json::Value = serde_json::from_str(line)?;
        if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
            outcomes.push(Outcome::Failed(e.to_string()));
            continue;
        }
        let times_ms = v["times_ms"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t.as_f64())
            .collect();
        let rows = v["rows"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| {
                r.as_array()
                    .into_iter()
                    .flatten()
                    .map(|c| c.as_str().unwrap_or("").to_string())
                    .collect()
            })
            .collect();
        outcomes.push(Outcome::Ran {
            times_ms,
            rows,
            device: None,
        });
    }
    if outcomes.len() != queries.len() {
        bail!(
            "the DuckDB runner answered {} of {} queries",
            outcomes.len(),
            queries.len()
        );
    }
    let note = version
        .get("version")
        .and_then(|v| v.as_str())
        .map(|v| format!("DuckDB {v}"));
    Ok(EngineRun {
        engine: Engine::DuckDb,
        note,
        outcomes,
    })
}
