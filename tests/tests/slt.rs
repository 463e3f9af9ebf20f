//! Runs every `tests/slt/**/*.slt` file through a fresh `VolleyContext`.
//!
//! Files under `tests/slt/tpch/` start with the TPC-H tables at scale factor 0.01.
//! `cargo test -p volley-tests --test slt -- NAME` runs only the files whose path contains
//! NAME. The run ends with a line `N passed, M failed`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use sqllogictest::{Runner, strict_column_validator};
use volley_engine::{VolleyConfig, VolleyContext};
use volley_tests::VolleyDb;

fn slt_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            slt_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "slt") {
            out.push(path);
        }
    }
}

async fn run_file(path: &Path) -> Result<(), String> {
    let tpch = path.components().any(|c| c.as_os_str() == "tpch");
    let mut runner = Runner::new(move || async move {
        let ctx = VolleyContext::with_config(VolleyConfig::default());
        if tpch {
            ctx.register_tpch(0.01)?;
        }
        Ok::<_, volley_tests::SltError>(VolleyDb::new(ctx))
    });
    runner.with_column_validator(strict_column_validator);
    runner
        .run_file_async(path)
        .await
        .map_err(|e| e.display(false).to_string())
}

fn main() -> ExitCode {
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("slt");
    let mut files = Vec::new();
    slt_files(&root, &mut files);
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
        match runtime.block_on(run_file(file)) {
            Ok(()) => {
                passed += 1;
                println!("slt {name} ... ok");
            }
            Err(e) => {
                failed += 1;
                println!("slt {name} ... FAILED\n{e}");
            }
        }
    }
    println!("{passed} passed, {failed} failed");
    if (files.is_empty() && filter.is_none()) || failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
