//! Runs every `tests/slt/**/*.slt` file through a fresh `FulmenContext`, twice: with
//! Fulmen's defaults, and with `fulmen.gpu.mode = force` on `emulated:1` (or on `cuda:0`
//! when `FULMEN_TEST_DEVICE=cuda`), so that every filter and projection the GPU supports
//! runs there, with device errors failing the statement (`fulmen.gpu.on_error = fail`). A
//! forced run also fails when the file executed GPU operators that did no batch on the
//! device, or redid a batch on the CPU after a device failure (files run one at a time, so
//! the process-wide counts before and after a file are the file's own). A file whose first
//! lines hold `# gpu-forced: skip (reason)` runs only with the defaults (tests/README.md
//! lists them).
//!
//! Files under `tests/slt/tpch/` start with the TPC-H tables at scale factor 0.01.
//! `cargo test -p fulmen-tests --test slt -- --complete NAME` rewrites the expected results
//! of the matching files (review the diff).
//! `cargo test -p fulmen-tests --test slt -- NAME` runs only the files whose path contains
//! NAME. The run ends with a line `N passed, M failed`.

use std::path::Path;
use std::process::ExitCode;

use fulmen_engine::physical_plan::gpu_stream::{RunCounts, run_counts};
use fulmen_engine::{FulmenConfig, FulmenContext, GpuMode};
use fulmen_tests::FulmenDb;
use sqllogictest::{Runner, strict_column_validator};

fn skips_forced_gpu(path: &Path) -> bool {
    std::fs::read_to_string(path).is_ok_and(|text| {
        text.lines()
            .take_while(|l| l.starts_with('#'))
            .any(|l| l.starts_with("# gpu-forced: skip"))
    })
}

async fn run_file(path: &Path, config: FulmenConfig, complete: bool) -> Result<(), String> {
    let tpch = path.components().any(|c| c.as_os_str() == "tpch");
    let mut runner = Runner::new(move || {
        let config = config.clone();
        async move {
            let ctx = FulmenContext::with_config(config);
            if tpch {
                ctx.register_tpch(0.01)?;
            }
            Ok::<_, fulmen_tests::SltError>(FulmenDb::new(ctx))
        }
    });
    runner.with_column_validator(strict_column_validator);
    if complete {
        return runner
            .update_test_file(
                path,
                " ",
                sqllogictest::default_validator,
                sqllogictest::default_normalizer,
                strict_column_validator,
            )
            .await
            .map_err(|e| e.to_string());
    }
    runner
        .run_file_async(path)
        .await
        .map_err(|e| e.display(false).to_string())
}

/// Why a forced run's device work does not count as the device's, if it does not: GPU
/// operators executed but did no batch on the device, or batches were redone on the CPU
/// after a device failure (batches handed to the CPU by rule are allowed).
fn device_work_problem(before: &RunCounts, after: &RunCounts) -> Option<String> {
    let operators = (after.filters + after.projections + after.aggregates + after.joins)
        - (before.filters + before.projections + before.aggregates + before.joins);
    // Batches a program hands to the CPU by rule were on the device first.
    let on_device = (after.gpu_batches + after.cpu_rule_batches)
        - (before.gpu_batches + before.cpu_rule_batches);
    let redone = after.cpu_batches - before.cpu_batches;
    if redone > 0 {
        Some(format!(
            "{redone} batches were redone on the CPU after a device failure"
        ))
    } else if operators > 0 && on_device == 0 {
        Some(format!(
            "{operators} GPU operators executed but no batch ran on the device"
        ))
    } else {
        None
    }
}

fn main() -> ExitCode {
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    // `-- --complete NAME` rewrites the expected results of the matching files from a run
    // with the defaults: review the diff before committing it.
    let complete = std::env::args().any(|a| a == "--complete");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("slt");
    let mut files = Vec::new();
    fulmen_tests::slt_files(&root, &mut files);
    files.sort();
    files.retain(|f| {
        filter
            .as_ref()
            .is_none_or(|needle| f.to_string_lossy().contains(needle.as_str()))
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime for the test");
    let (mut passed, mut failed) = (0, 0);
    for file in &files {
        let name = file
            .strip_prefix(&root)
            .unwrap_or(file)
            .display()
            .to_string();
        let mut modes = vec![("defaults", FulmenConfig::default())];
        if !complete && !skips_forced_gpu(file) {
            modes.push(("gpu forced", fulmen_tests::forced_gpu_config("slt")));
        }
        for (mode, config) in modes {
            let forced = config.gpu_mode == GpuMode::Force;
            let before = run_counts();
            let outcome = runtime
                .block_on(run_file(file, config, complete))
                .and_then(|()| match device_work_problem(&before, &run_counts()) {
                    Some(problem) if forced => Err(problem),
                    _ => Ok(()),
                });
            match outcome {
                Ok(()) => {
                    passed += 1;
                    println!("slt {name} [{mode}] ... ok");
                }
                Err(e) => {
                    failed += 1;
                    println!("slt {name} [{mode}] ... FAILED\n{e}");
                }
            }
        }
    }
    let counts = run_counts();
    println!("GPU operators: {counts}");
    println!("{passed} passed, {failed} failed");
    if (files.is_empty() && filter.is_none()) || failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
