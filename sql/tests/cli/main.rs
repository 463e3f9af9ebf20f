//! End-to-end tests of the real `fulmen` binary: `-c`, `-f`, stdin, output formats, exit
//! status, `--demo`, and the interactive shell driven through a pseudo-terminal.

use std::io::Write;
use std::process::{Command, Output, Stdio};

mod cluster;
mod service;

fn fulmen() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fulmen"));
    cmd.env_remove("FULMEN_DEVICES")
        .env("FULMEN_HISTORY", "/dev/null");
    cmd
}

fn run(args: &[&str]) -> Output {
    fulmen()
        .args(args)
        .output()
        .expect("the fulmen binary runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn command_prints_a_table_and_timing() {
    let o = run(&["-c", "SELECT 1 + 1 AS two, 'hi' AS greeting"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("two") && out.contains("greeting"), "{out}");
    assert!(out.contains(" 2 ") && out.contains(" hi "), "{out}");
    assert!(
        stderr(&o).contains("1 row ("),
        "timing line: {}",
        stderr(&o)
    );
    let quiet = run(&["-q", "-c", "SELECT 1"]);
    assert_eq!(stderr(&quiet), "", "--quiet prints no timing");
}

#[test]
fn a_syntax_error_is_one_line_and_exit_status_1() {
    let o = run(&["-c", "SELEC 1"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(stdout(&o), "");
    let err = stderr(&o);
    assert_eq!(err.lines().count(), 1, "one line: {err:?}");
    assert!(
        err.starts_with("Error: syntax error: Expected: an SQL statement, found: SELEC"),
        "{err}"
    );
}

#[test]
fn scripts_stop_at_the_first_failure() {
    let o = run(&[
        "-q",
        "--format",
        "csv",
        "-c",
        "SELECT 1 AS a; SELECT * FROM nowhere; SELECT 3 AS c",
        "-c",
        "SELECT 4",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        stdout(&o),
        "a\n1\n",
        "the statements after the failure do not run"
    );
    assert!(stderr(&o).contains("nowhere"), "{}", stderr(&o));
}

#[test]
fn file_with_several_statements_prints_each_result() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("script.sql");
    std::fs::write(
        &file,
        "-- a comment\nCREATE TABLE t AS VALUES (1), (2), (3);\n\
         SELECT count(*) AS n FROM t;\n\\format csv\nSELECT sum(column1) AS total\n  FROM t;\nSELECT 'last' AS word",
    )
    .unwrap();
    let o = run(&["-f", file.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains(" n ") && out.contains(" 3 "),
        "table result: {out}"
    );
    assert!(out.contains("total\n6\n"), "csv after \\format: {out}");
    assert!(
        out.ends_with("word\nlast\n"),
        "the last statement needs no ';': {out}"
    );
    let timing = stderr(&o);
    assert!(timing.contains("OK ("), "DDL reports OK: {timing}");

    let missing = run(&["-f", "/no/such/file.sql"]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(
        stderr(&missing).contains("cannot read '/no/such/file.sql'"),
        "{}",
        stderr(&missing)
    );
}

#[test]
fn sql_from_stdin_when_it_is_not_a_terminal() {
    let mut child = fulmen()
        .args(["-q", "--format", "csv"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"SELECT 40 + 2 AS answer;\nSELECT 'x;y' AS s;\n")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), "answer\n42\ns\nx;y\n");
}

#[test]
fn every_output_format() {
    let sql = "SELECT * FROM (VALUES (1, 'a'), (2, NULL)) AS t(id, name) ORDER BY id";
    let fmt = |f: &str| {
        let o = run(&["-q", "--format", f, "-c", sql]);
        assert!(o.status.success(), "{f}: {}", stderr(&o));
        stdout(&o)
    };
    assert_eq!(fmt("csv"), "id,name\n1,a\n2,\n");
    assert_eq!(fmt("tsv"), "id\tname\n1\ta\n2\t\n");
    assert_eq!(
        fmt("ndjson"),
        "{\"id\":1,\"name\":\"a\"}\n{\"id\":2,\"name\":null}\n"
    );
    let json: serde_json::Value = serde_json::from_str(&fmt("json")).unwrap();
    assert_eq!(
        json,
        serde_json::json!([{"id": 1, "name": "a"}, {"id": 2, "name": null}])
    );
    let md = fmt("markdown");
    assert_eq!(
        md.lines().next().unwrap().split('|').nth(1).unwrap().trim(),
        "id",
        "{md}"
    );
    assert!(md.lines().nth(1).unwrap().contains("---"), "{md}");
    let table = fmt("table");
    assert!(table.contains("NULL"), "{table}");
    let bad = run(&["--format", "xml", "-c", "SELECT 1"]);
    assert_eq!(bad.status.code(), Some(2), "clap rejects unknown formats");
    assert!(
        stderr(&bad).contains("unknown format 'xml'"),
        "{}",
        stderr(&bad)
    );
}

#[test]
fn long_results_are_cut_in_the_table_format_only() {
    let o = run(&["-q", "--maxrows", "5", "-c", "SELECT value FROM range(100)"]);
    let out = stdout(&o);
    assert!(out.contains("(95 more rows not shown"), "{out}");
    let o = run(&[
        "-q",
        "--maxrows",
        "5",
        "--format",
        "csv",
        "-c",
        "SELECT value FROM range(100)",
    ]);
    assert_eq!(stdout(&o).lines().count(), 101);
}

#[test]
fn demo_loads_tpch_and_meta_commands_describe_it() {
    let o = run(&[
        "--demo",
        "0.01",
        "-q",
        "--format",
        "csv",
        "-c",
        "SELECT l_returnflag, count(*) AS n FROM lineitem GROUP BY 1 ORDER BY 1",
        "-c",
        "\\d LineItem",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some("l_returnflag,n"));
    let counts: Vec<(String, u64)> = lines
        .by_ref()
        .take(3)
        .map(|l| {
            let (flag, n) = l.split_once(',').unwrap();
            (flag.to_string(), n.parse().unwrap())
        })
        .collect();
    let flags: Vec<&str> = counts.iter().map(|(f, _)| f.as_str()).collect();
    assert_eq!(flags, ["A", "N", "R"]);
    assert_eq!(
        counts.iter().map(|(_, n)| n).sum::<u64>(),
        60_175,
        "every line item counted once"
    );
    assert!(out.contains("column_name,data_type,is_nullable"), "{out}");
    assert!(out.contains("l_orderkey,Int64,NO"), "{out}");

    let o = run(&["-c", "\\d nosuch"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("no table named 'nosuch'"),
        "{}",
        stderr(&o)
    );
    let o = run(&["-c", "\\frobnicate"]);
    assert!(
        stderr(&o).contains("unknown meta-command '\\frobnicate'"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn include_runs_another_file() {
    let dir = tempfile::tempdir().unwrap();
    let inner = dir.path().join("inner.sql");
    std::fs::write(&inner, "SELECT 'from inner' AS src;").unwrap();
    let cmd = format!("\\i {}\nSELECT 'after' AS src;", inner.display());
    let o = run(&["-q", "--format", "csv", "-c", &cmd]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), "src\nfrom inner\nsrc\nafter\n");
}

/// Drives the interactive shell through a pseudo-terminal as a person would.
#[test]
fn interactive_shell_in_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let history = dir.path().join("history");
    // A terminal of a real size, as a person's would be (an unsized one reports 0 columns).
    let mut cmd = Command::new("sh");
    cmd.env_remove("FULMEN_DEVICES")
        .env("FULMEN_HISTORY", &history)
        .env("TERM", "xterm")
        .args([
            "-c",
            "stty cols 100 rows 40 && exec \"$0\" --demo 0.01",
            env!("CARGO_BIN_EXE_fulmen"),
        ]);
    let mut p = rexpect::session::spawn_command(cmd, Some(60_000)).unwrap();
    p.exp_string("Loaded TPC-H at scale factor 0.01").unwrap();
    p.exp_string("fulmen> ").unwrap();

    // A statement over two lines runs once the ';' arrives.
    p.send_line("SELECT 20 + 1").unwrap();
    p.send_line("  + 21 AS answer;").unwrap();
    p.exp_string("answer").unwrap();
    p.exp_string("42").unwrap();
    p.exp_string("1 row (").unwrap();
    p.exp_string("fulmen> ").unwrap();

    // A meta-command.
    p.send_line("\\dt").unwrap();
    p.exp_string("lineitem").unwrap();
    p.exp_string("fulmen> ").unwrap();

    // A long statement shows progress, and Ctrl-C cancels it without leaving the shell.
    p.send_line("SELECT count(*) FROM range(1000000000000);")
        .unwrap();
    p.exp_string("running").unwrap();
    p.send_control('c').unwrap();
    p.exp_string("Cancelled.").unwrap();
    p.exp_string("fulmen> ").unwrap();

    // The shell still answers; errors are one line and it carries on.
    p.send_line("SELEC 1;").unwrap();
    p.exp_string("Error: syntax error").unwrap();
    p.exp_string("fulmen> ").unwrap();
    p.send_line("SELECT 'still here' AS s;").unwrap();
    p.exp_string("still here").unwrap();
    p.exp_string("fulmen> ").unwrap();

    // Ctrl-D leaves.
    p.send_control('d').unwrap();
    p.exp_eof().unwrap();
    let saved = std::fs::read_to_string(&history).unwrap_or_default();
    assert!(saved.contains("still here"), "history is kept: {saved}");
}

/// A shell without tables tells a newcomer how to load some.
#[test]
fn an_empty_shell_says_how_to_load_data() {
    let mut cmd = Command::new("sh");
    cmd.env_remove("FULMEN_DEVICES")
        .env("FULMEN_HISTORY", "/dev/null")
        .env("TERM", "xterm")
        .args([
            "-c",
            "stty cols 100 rows 40 && exec \"$0\"",
            env!("CARGO_BIN_EXE_fulmen"),
        ]);
    let mut p = rexpect::session::spawn_command(cmd, Some(60_000)).unwrap();
    p.exp_string("No tables yet").unwrap();
    p.exp_string("CREATE EXTERNAL TABLE").unwrap();
    p.exp_string("fulmen> ").unwrap();
    p.send_line("\\q").unwrap();
    p.exp_eof().unwrap();
}
