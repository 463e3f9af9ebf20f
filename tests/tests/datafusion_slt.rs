//! DataFusion's published sqllogictest suite (the `test_files/` shipped in the
//! `datafusion-sqllogictest` crate), run through DataFusion's own test context and driver
//! with Fulmen's `GpuOverrides` rule added and `fulmen.gpu.mode = force` on `emulated:1`
//! (`cuda:0` with `FULMEN_TEST_DEVICE=cuda`).
//!
//! The rule: every file that passes with the GPU off passes with it forced, and in a file
//! that does not, every record that passes with the GPU off passes with it forced. There
//! are no second chances for the GPU: each file runs forced once, with device errors
//! failing the statement (`fulmen.gpu.on_error = fail`); a file that fails then runs again
//! with the GPU off, and passing there is a GPU regression (this test fails) unless more
//! runs with the GPU off show that DataFusion's own answer varies from session to session
//! (a GPU answer that varies is a bug, not an excuse). Failing with the GPU off too means
//! the file cannot run whole here (it needs data or features this build lacks): it then
//! runs record by record both ways, going on past failures, and a record that passes with
//! the GPU off (in three runs) and fails forced (in one) is a GPU regression (EXPLAIN
//! ANALYZE records, which print each operator's own metrics, are left out). A forced run
//! that redid a batch on the CPU after a device failure is a regression too. Files in
//! [`EXCLUDED`] are left out, each with its reason (tests/README.md lists them too).
//!
//! Plans print `GpuFilterExec: device=emulated:0, …` where DataFusion expects
//! `FilterExec: …`, and tree-format boxes are titled `GpuFilterExec`; the validator reads
//! the two as the same before comparing (re-centring a box title as DataFusion centres
//! it). A fused stage (`GpuHashJoinExec: …, fused_filter=P` over the filter's input) is
//! read as the operator over its `FilterExec: P` as the last child, where the plans
//! differ only by that (indent format; see [`unfused`]), and nothing else is normalised.
//! Queries run as a user's do, with `fulmen.gpu.single_stage_aggregation` on: on one device
//! an aggregation runs in one stage, so the suite's answers check it. `EXPLAIN` statements
//! are planned with it off ([`TwoStageExplains`]), because the files expect DataFusion's two
//! aggregation stages in their plans; one-stage plans are checked by the engine's GPU
//! tests and Fulmen's own `.slt` files.
//!
//! `cargo test -p fulmen-tests --test datafusion_slt -- NAME` runs the files whose path
//! contains NAME. `FULMEN_DF_SLT_LIMIT=N` runs only the first N files (a smoke run);
//! `FULMEN_DF_SLT_VERBOSE=1` prints why files that fail with the GPU off fail.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use datafusion::execution::SessionStateBuilder;
use datafusion_sqllogictest::{DataFusion, TestContext, df_value_validator, value_normalizer};
use fulmen_engine::gpu::GpuOverrides;
use fulmen_engine::physical_plan::gpu_stream::run_counts;
use indicatif::ProgressBar;
use sqllogictest::{Normalizer, strict_column_validator};

/// Files left out of the forced run, with the reason.
const EXCLUDED: &[(&str, &str)] = &[
    (
        "aggregate_memory_spill.slt",
        "it checks that DataFusion's CPU AggregateExec spills to disk under a memory limit \
         (spill_count=7 in EXPLAIN ANALYZE); a GpuAggregateExec keeps its groups in device \
         memory and never spills (its spill_count is 0)",
    ),
    (
        "ordered_aggregate_spill.slt",
        "it checks that DataFusion's CPU AggregateExec spills sorted groups to disk \
         (spilled_bytes in EXPLAIN ANALYZE); a GpuAggregateExec keeps its groups in device \
         memory and never spills",
    ),
    (
        "range_partitioning.slt",
        "its EXPLAIN ANALYZE prints the dynamic filter DataFusion's HashJoinExec fills in \
         from its build side (per-partition key ranges and IN lists, routed by hash) for the \
         probe side's scan; a GpuHashJoinExec fills it with the key ranges of all partitions \
         together (answers are the same: the filter only prunes)",
    ),
    (
        "spark/datetime/date_trunc.slt",
        "DataFusion's own answer changes from run to run with the GPU off (which of two \
     registered `date_trunc` functions a session resolves varies per process: DataFusion's \
     rejects the Spark granularity 'yyyy')",
    ),
    (
        "spark/array/array_contains.slt",
        "DataFusion's own answer changes from run to run with the GPU off (which of two \
     registered `array_contains` functions a session resolves varies per process)",
    ),
];

/// Where the suite lives: `FULMEN_DF_SLT_DIR`, else the crate in Cargo's registry.
fn suite_root() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("FULMEN_DF_SLT_DIR") {
        return Some(PathBuf::from(dir));
    }
    let cargo_home = std::env::var("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|_| std::env::var("HOME").map(|h| Path::new(&h).join(".cargo")))
        .ok()?;
    let registry = std::fs::read_dir(cargo_home.join("registry/src")).ok()?;
    registry
        .flatten()
        .map(|index| index.path().join("datafusion-sqllogictest-55.2.0"))
        .find(|p| p.join("test_files").is_dir())
}

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

/// DataFusion's validator, reading `GpuXExec: device=D, ` as `XExec: `, and a fused stage
/// as the operator over the filter it took in (see [`unfused`]).
fn validator(normalizer: Normalizer, actual: &[Vec<String>], expected: &[String]) -> bool {
    let actual: Vec<Vec<String>> = actual
        .iter()
        .map(|row| row.iter().map(|cell| without_gpu_names(cell)).collect())
        .collect();
    df_value_validator(normalizer, &actual, expected) || {
        let (actual, expected) = unfused(actual, expected);
        df_value_validator(normalizer, &actual, &expected)
    }
}

/// An indent-format plan line `NN)--…content`: its depth (the dashes) and content.
fn plan_line(line: &str) -> Option<(usize, &str)> {
    let (number, rest) = line.trim().split_once(')')?;
    if number.is_empty() || !number.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let content = rest.trim_start_matches('-');
    Some((rest.len() - content.len(), content))
}

/// A plan with fused stages read as DataFusion's plan: a GPU join or aggregation that took
/// in the filter under it prints `…, fused_filter=P` over the filter's input, where
/// DataFusion's plan has the operator over `FilterExec: P[, projection=…]` as its last (the
/// probe side's, or only) child. For each fused line of the actual plan, in order, the
/// expected line at the same place must be that line without the mark, and its last child
/// that `FilterExec`; the mark is dropped, the filter removed, its input moved up a level
/// and the lines renumbered. Where any of that does not hold, both plans are returned as
/// they were, so the comparison fails as it would have.
fn unfused(actual: Vec<Vec<String>>, expected: &[String]) -> (Vec<Vec<String>>, Vec<String>) {
    const MARK: &str = ", fused_filter=";
    let unchanged = |actual| (actual, expected.to_vec());
    let text: Vec<String> = actual.iter().map(|row| row.join(" ")).collect();
    // (depth, content) of the expected lines; `None` for a line outside a plan.
    let mut lines: Vec<(Option<(usize, String)>, String)> = (expected.iter())
        .map(|l| (plan_line(l).map(|(d, c)| (d, c.to_string())), l.clone()))
        .collect();
    let mut marked = Vec::new();
    for (i, line) in text.iter().enumerate() {
        let (Some((depth, content)), Some(at)) = (plan_line(line), line.find(MARK)) else {
            continue;
        };
        let predicate = line[at + MARK.len()..].trim_end();
        let stage = content
            .split_once(MARK)
            .map_or(content, |(c, _)| c)
            .trim_end();
        // Lines before `i` are aligned: each filter removed so far was below an earlier one.
        match lines.get(i) {
            Some((Some((d, c)), _)) if *d == depth && c.trim_end() == stage => {}
            _ => return unchanged(actual),
        }
        // The stage's last child: the last line below it one level deeper.
        let mut last = None;
        for (j, (line, _)) in lines.iter().enumerate().skip(i + 1) {
            match line {
                Some((d, _)) if *d > depth => {
                    if *d == depth + 2 {
                        last = Some(j);
                    }
                }
                _ => break,
            }
        }
        let Some(j) = last else {
            return unchanged(actual);
        };
        let is_filter = lines[j].0.as_ref().is_some_and(|(_, c)| {
            (c.strip_prefix("FilterExec: ")
                .and_then(|f| f.strip_prefix(predicate)))
            .is_some_and(|rest| rest.trim_end().is_empty() || rest.starts_with(", projection="))
        });
        if !is_filter {
            return unchanged(actual);
        }
        lines.remove(j);
        for (line, _) in lines[j..].iter_mut() {
            match line {
                Some((d, _)) if *d > depth + 2 => *d -= 2,
                _ => break,
            }
        }
        marked.push(i);
    }
    if marked.is_empty() {
        return unchanged(actual);
    }
    let actual = (actual.into_iter().enumerate())
        .map(|(i, row)| match marked.contains(&i) {
            true => row
                .into_iter()
                .map(|cell| {
                    cell.split_once(MARK)
                        .map_or(cell.clone(), |(c, _)| c.to_string())
                })
                .collect(),
            false => row,
        })
        .collect();
    // Renumbered from 01 in each run of plan lines.
    let mut number = 0;
    let expected = (lines.into_iter())
        .map(|(line, text)| match line {
            Some((depth, content)) => {
                number += 1;
                format!("{number:02}){}{content}", "-".repeat(depth))
            }
            None => {
                number = 0;
                text
            }
        })
        .collect();
    (actual, expected)
}

fn without_gpu_names(text: &str) -> String {
    if let Some(line) = recentred_tree_title(text) {
        return line;
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("Gpu") {
        out.push_str(&rest[..at]);
        let after = &rest[at + 3..];
        let name_len = after
            .find(|c: char| !c.is_ascii_alphanumeric())
            .unwrap_or(after.len());
        let name = &after[..name_len];
        if name.ends_with("Exec") {
            out.push_str(name);
            rest = &after[name_len..];
            if let Some(tail) = rest.strip_prefix(": device=") {
                let end = tail.find(", ").map_or(tail.len(), |i| i + 2);
                out.push_str(": ");
                rest = &tail[end..];
            }
        } else {
            out.push_str("Gpu");
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// Tree-format box titles `│    GpuFilterExec    │` as DataFusion centres `FilterExec` in
/// the same width (a line may hold several boxes side by side).
fn recentred_tree_title(line: &str) -> Option<String> {
    let pieces: Vec<&str> = line.split('│').collect();
    let mut changed = false;
    let out: Vec<String> = pieces
        .iter()
        .enumerate()
        .map(|(i, piece)| {
            let inside = i > 0 && i + 1 < pieces.len();
            let name = piece
                .trim()
                .strip_prefix("Gpu")
                .filter(|n| n.ends_with("Exec") && n.chars().all(|c| c.is_ascii_alphanumeric()));
            match name {
                Some(name) if inside => {
                    changed = true;
                    let width = piece.chars().count();
                    let left = (width - name.len()).div_ceil(2);
                    let right = width - name.len() - left;
                    format!("{}{name}{}", " ".repeat(left), " ".repeat(right))
                }
                _ => piece.to_string(),
            }
        })
        .collect();
    changed.then(|| out.join("│"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Off,
    Forced,
}

/// How a file is run: to its first failure, or every record (going on past failures).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    File,
    Records,
}

/// A failed record: its index in the file's records, and the error.
type Failure = (usize, String);

/// Runs a file in `mode`: `Ok(failures)` (none when it passes; with [`Scope::File`] at
/// most the first), or `Err` when the file cannot be read.
async fn run_file(
    path: &Path,
    relative: &Path,
    mode: Mode,
    scope: Scope,
) -> Result<Vec<Failure>, String> {
    let Some(test_ctx) = TestContext::try_new_for_test_file(relative).await else {
        return Ok(Vec::new());
    };
    let ctx = test_ctx.session_ctx().clone();
    {
        let state_ref = ctx.state_ref();
        let mut state = state_ref.write();
        let mut builder = SessionStateBuilder::new_from_existing(state.clone());
        if mode == Mode::Forced {
            let fulmen = fulmen_tests::forced_gpu_config("df-slt");
            assert!(fulmen.gpu_single_stage_aggregation);
            builder = builder.with_physical_optimizer_rule(Arc::new(GpuOverrides::new()));
            if let Some(config) = builder.config() {
                config.options_mut().extensions.insert(fulmen);
            }
        }
        *state = builder.build();
    }
    datafusion_sqllogictest::setup_scratch_dir(relative).map_err(|e| e.to_string())?;
    let relative = relative.to_path_buf();
    let mut runner = sqllogictest::Runner::new(|| {
        let ctx = ctx.clone();
        let relative = relative.clone();
        async move {
            let explains = TwoStageExplains {
                ctx: ctx.clone(),
                inner: DataFusion::new(ctx, relative, ProgressBar::hidden()),
            };
            Ok(explains)
        }
    });
    runner.add_label("Datafusion");
    runner.with_column_validator(strict_column_validator);
    runner.with_normalizer(value_normalizer);
    runner.with_validator(validator);
    let records = sqllogictest::parse_file(path).map_err(|e| e.to_string())?;
    let mut failures = Vec::new();
    for (i, record) in records.into_iter().enumerate() {
        if let sqllogictest::Record::Halt { .. } = record {
            break;
        }
        if let Err(e) = runner.run_async(record).await {
            failures.push((i, e.display(false).to_string()));
            if scope == Scope::File {
                break;
            }
        }
    }
    runner.shutdown_async().await;
    Ok(failures)
}

/// DataFusion's driver, planning `EXPLAIN` statements with
/// `fulmen.gpu.single_stage_aggregation` off: the files' expected plans print DataFusion's
/// two aggregation stages. Every other statement runs with the session's settings, so
/// queries run as a user's do (in one stage on one device, when the GPU is forced).
struct TwoStageExplains {
    ctx: datafusion::prelude::SessionContext,
    inner: DataFusion,
}

impl TwoStageExplains {
    /// Sets `fulmen.gpu.single_stage_aggregation` where the session has Fulmen's settings
    /// (the forced runs); returns what it was.
    fn single_stage(&self, on: bool) -> Option<bool> {
        let state_ref = self.ctx.state_ref();
        let mut state = state_ref.write();
        let fulmen = (state.config_mut().options_mut().extensions)
            .get_mut::<fulmen_engine::FulmenConfig>()?;
        Some(std::mem::replace(
            &mut fulmen.gpu_single_stage_aggregation,
            on,
        ))
    }
}

#[async_trait::async_trait]
impl sqllogictest::AsyncDB for TwoStageExplains {
    type Error = <DataFusion as sqllogictest::AsyncDB>::Error;
    type ColumnType = <DataFusion as sqllogictest::AsyncDB>::ColumnType;

    async fn run(
        &mut self,
        sql: &str,
    ) -> Result<sqllogictest::DBOutput<Self::ColumnType>, Self::Error> {
        let explain =
            (sql.trim_start().get(..7)).is_some_and(|word| word.eq_ignore_ascii_case("EXPLAIN"));
        let was = explain.then(|| self.single_stage(false)).flatten();
        let output = self.inner.run(sql).await;
        if let Some(was) = was {
            self.single_stage(was);
        }
        output
    }

    async fn shutdown(&mut self) {
        self.inner.shutdown().await
    }

    fn engine_name(&self) -> &str {
        self.inner.engine_name()
    }

    async fn sleep(dur: std::time::Duration) {
        tokio::time::sleep(dur).await
    }
}

/// The records of a file that fails with the GPU off that fail forced while passing with
/// the GPU off in each of three runs (a record whose answer varies with the GPU off is not
/// comparable; EXPLAIN ANALYZE records are left out). The forced run is one: a record
/// that fails there once is the GPU's failure.
fn record_regressions(
    runtime: &tokio::runtime::Runtime,
    file: &Path,
    relative: &Path,
) -> Result<(usize, usize, Vec<Failure>), String> {
    let run = |mode| runtime.block_on(run_file(file, relative, mode, Scope::Records));
    let parsed = sqllogictest::parse_file::<sqllogictest::DefaultColumnType>(file)
        .map_err(|e| e.to_string())?;
    // EXPLAIN ANALYZE prints each operator's metrics: a GPU operator's are its own
    // (device, transfers, kernel time), so those records differ by design.
    let analyze: Vec<usize> = parsed
        .iter()
        .enumerate()
        .filter(|(_, r)| {
            matches!(r, sqllogictest::Record::Query { sql, .. }
                if sql.trim_start().to_ascii_uppercase().starts_with("EXPLAIN ANALYZE"))
        })
        .map(|(i, _)| i)
        .collect();
    let records = parsed.len();
    let off = run(Mode::Off)?;
    let mut suspects: Vec<Failure> = run(Mode::Forced)?
        .into_iter()
        .filter(|(i, _)| !off.iter().any(|(j, _)| j == i) && !analyze.contains(i))
        .collect();
    for _ in 0..2 {
        if suspects.is_empty() {
            break;
        }
        let off = run(Mode::Off)?;
        suspects.retain(|(i, _)| !off.iter().any(|(j, _)| j == i));
    }
    Ok((records, off.len(), suspects))
}

/// [`unfused`] reads a fused stage as the operator over the filter it took in, and nothing
/// else: not a filter on the build side, nor one of another predicate. Checked before the
/// suite runs (this test has no harness for `#[test]` functions).
fn check_unfused() {
    let lines = |text: &str| -> Vec<String> { text.lines().map(str::to_string).collect() };
    let actual: Vec<Vec<String>> = [
        "physical_plan",
        "01)SortExec: x",
        "02)--HashJoinExec: mode=CollectLeft, on=[(a@0, b@0)], fused_filter=p@1 = 1",
        "03)----DataSourceExec: l",
        "04)----DataSourceExec: r",
    ]
    .iter()
    .map(|l| vec![l.to_string()])
    .collect();
    let probe_side = lines(
        "physical_plan\n01)SortExec: x\n02)--HashJoinExec: mode=CollectLeft, on=[(a@0, b@0)]\n\
         03)----DataSourceExec: l\n04)----FilterExec: p@1 = 1, projection=[b@0]\n\
         05)------DataSourceExec: r",
    );
    let build_side = lines(
        "physical_plan\n01)SortExec: x\n02)--HashJoinExec: mode=CollectLeft, on=[(a@0, b@0)]\n\
         03)----FilterExec: p@1 = 1\n04)------DataSourceExec: l\n05)----DataSourceExec: r",
    );
    let other = probe_side
        .iter()
        .map(|l| l.replace("p@1 = 1", "p@1 = 2"))
        .collect::<Vec<_>>();
    assert!(validator(value_normalizer, &actual, &probe_side));
    assert!(!validator(value_normalizer, &actual, &build_side));
    assert!(!validator(value_normalizer, &actual, &other));
}

fn main() -> ExitCode {
    check_unfused();
    let Some(root) = suite_root() else {
        eprintln!(
            "DataFusion's sqllogictest suite was not found: build the workspace once (it \
             downloads datafusion-sqllogictest 55.2.0) or set FULMEN_DF_SLT_DIR"
        );
        return ExitCode::FAILURE;
    };
    // DataFusion's files use paths relative to their crate and write a scratch folder
    // there, so they run from a private copy.
    // One folder per process: two runs at once must not delete each other's.
    // `FULMEN_DF_SLT_WORK` names another parent (where the build's folder does not exist,
    // as on a machine the binary was carried to).
    let parent = std::env::var_os("FULMEN_DF_SLT_WORK")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    let work = parent.join(format!("datafusion-sqllogictest-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    for dir in ["test_files", "data"] {
        if root.join(dir).is_dir()
            && let Err(e) = copy_dir(&root.join(dir), &work.join(dir))
        {
            eprintln!("copying {dir}: {e}");
            return ExitCode::FAILURE;
        }
    }
    if let Err(e) = std::env::set_current_dir(&work) {
        eprintln!("entering {}: {e}", work.display());
        return ExitCode::FAILURE;
    }
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let limit: usize = std::env::var("FULMEN_DF_SLT_LIMIT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(usize::MAX);
    let mut files = Vec::new();
    fulmen_tests::slt_files(Path::new("test_files"), &mut files);
    files.sort();
    files.retain(|f| {
        let name = f.to_string_lossy();
        filter.as_ref().is_none_or(|n| name.contains(n.as_str()))
            && !EXCLUDED.iter().any(|(x, _)| name.ends_with(x))
    });
    files.truncate(limit);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime for the test");
    let started = Instant::now();
    let (mut passed, mut not_here, mut regressions) = (0, Vec::new(), Vec::new());
    let mut varies = Vec::new();
    for file in &files {
        let relative = file
            .strip_prefix("test_files")
            .unwrap_or(file)
            .to_path_buf();
        let before = run_counts();
        let started = Instant::now();
        let run = |mode| runtime.block_on(run_file(file, &relative, mode, Scope::File));
        let forced = run(Mode::Forced);
        let redone = run_counts().cpu_batches - before.cpu_batches;
        if redone > 0 {
            println!(
                "df-slt {} ... FAILED: {redone} batches redone on the CPU after a device \
                 failure",
                relative.display()
            );
            regressions.push(relative);
            continue;
        }
        match forced {
            Ok(failures) if failures.is_empty() => {
                passed += 1;
                let after = run_counts();
                println!(
                    "df-slt {} ... ok ({} GPU filters, {} projections, {} aggregates, {} \
                     hash joins; {:.1} s)",
                    relative.display(),
                    after.filters - before.filters,
                    after.projections - before.projections,
                    after.aggregates - before.aggregates,
                    after.joins - before.joins,
                    started.elapsed().as_secs_f64()
                );
            }
            forced => match run(Mode::Off) {
                // Passing with the GPU off. Some of DataFusion's files answer differently
                // from one session to the next (two registered functions of one name,
                // resolved in hash order); five more runs with the GPU off tell those apart
                // (a file whose own answer is a coin toss passes all five once in 2^5, and
                // is then reported as a regression: a false alarm, never a hidden one). The
                // GPU gets no second run: its answer must not vary.
                Ok(off) if off.is_empty() => {
                    let passes = |r: Result<Vec<Failure>, String>| r.is_ok_and(|f| f.is_empty());
                    let off_varies = (0..5).any(|_| !passes(run(Mode::Off)));
                    if off_varies {
                        varies.push(relative.clone());
                        println!(
                            "df-slt {} ... DataFusion's own answers vary from run to run with \
                             the GPU off (not counted)",
                            relative.display()
                        );
                    } else {
                        let forced = match forced {
                            Ok(f) => f.into_iter().map(|(_, e)| e).collect(),
                            Err(e) => e,
                        };
                        println!(
                            "df-slt {} ... FAILED with the GPU forced\n{forced}",
                            relative.display()
                        );
                        regressions.push(relative);
                    }
                }
                off => {
                    let off = match off {
                        Ok(f) => f.into_iter().map(|(_, e)| e).collect(),
                        Err(e) => e,
                    };
                    let first = if std::env::var_os("FULMEN_DF_SLT_VERBOSE").is_some() {
                        off.as_str()
                    } else {
                        off.lines().find(|l| !l.trim().is_empty()).unwrap_or("")
                    };
                    // The file fails with the GPU off: its records are compared one by one.
                    match record_regressions(&runtime, file, &relative) {
                        Ok((records, failing, suspects)) if suspects.is_empty() => {
                            println!(
                                "df-slt {} ... fails with the GPU off too; record by record: \
                                 {} of {records} pass with the GPU off, and all of those with \
                                 it forced ({first})",
                                relative.display(),
                                records - failing,
                            );
                            not_here.push(relative);
                        }
                        Ok((records, _, suspects)) => {
                            println!(
                                "df-slt {} ... {} of {records} records FAILED with the GPU \
                                 forced that pass with it off",
                                relative.display(),
                                suspects.len()
                            );
                            for (_, e) in &suspects {
                                println!("{e}");
                            }
                            regressions.push(relative);
                        }
                        Err(e) => {
                            println!(
                                "df-slt {} ... cannot be read ({e}); with the GPU off: {first}",
                                relative.display()
                            );
                            not_here.push(relative);
                        }
                    }
                }
            },
        }
    }
    if std::env::set_current_dir(env!("CARGO_TARGET_TMPDIR")).is_ok() {
        let _ = std::fs::remove_dir_all(&work);
    }
    let counts = run_counts();
    println!("GPU operators: {counts}");
    println!(
        "{passed} passed with the GPU forced, {} GPU regressions, {} fail with the GPU off too, \
         {} vary with the GPU off, {} excluded; {:.0} s",
        regressions.len(),
        not_here.len(),
        varies.len(),
        EXCLUDED.len(),
        started.elapsed().as_secs_f64()
    );
    for file in &regressions {
        println!("GPU regression: {}", file.display());
    }
    if regressions.is_empty() && !files.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
