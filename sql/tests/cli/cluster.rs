//! Fulmen on a Ballista cluster: a scheduler and two executors started here as child
//! processes of the `fulmen` binary, on loopback ports chosen at run time, each executor
//! with emulated devices of its own. TPC-H's 22 queries give the single-process answers
//! with GPU operators in the executors' stages (checked by their metrics); a setting SET
//! on the client reaches the executors; an executor killed mid-query costs a retry, not a
//! wrong answer or a hang; a scheduler that does not answer is a clear error in seconds.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use fulmen_engine::tpch::{QUERIES, TABLES};

use super::*;

/// A port nothing listens on now (the OS's pick; free again once returned).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits for `log` to contain `text`, failing after `within` with the log shown.
fn wait_for_log(log: &Path, text: &str, within: Duration) {
    let start = Instant::now();
    loop {
        let seen = std::fs::read_to_string(log).unwrap_or_default();
        if seen.contains(text) {
            return;
        }
        assert!(
            start.elapsed() < within,
            "'{text}' not in {} after {within:?}:\n{seen}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A scheduler and its executors; every process is killed when it is dropped.
struct Cluster {
    dir: tempfile::TempDir,
    scheduler: String,
    children: Vec<(String, Child)>,
}

impl Cluster {
    fn start(executors: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let mut cluster = Cluster {
            scheduler: format!("127.0.0.1:{port}"),
            dir,
            children: Vec::new(),
        };
        let scheduler = cluster.scheduler.clone();
        cluster.spawn("scheduler", &["scheduler", "--bind", &scheduler]);
        let log = cluster.log("scheduler");
        wait_for_log(&log, "listening on", Duration::from_secs(30));
        for n in 0..executors {
            cluster.add_executor(&format!("executor{n}"));
        }
        cluster
    }

    fn log(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.log"))
    }

    fn spawn(&mut self, name: &str, args: &[&str]) {
        let log = std::fs::File::create(self.log(name)).unwrap();
        let child = fulmen()
            .args(args)
            .arg("--log-level=info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("the fulmen binary runs");
        self.children.push((name.to_string(), child));
    }

    /// Starts an executor on two emulated devices named after it, and waits until the
    /// scheduler has it.
    fn add_executor(&mut self, name: &str) {
        let (flight, grpc) = (free_port(), free_port());
        let work = self.dir.path().join(name);
        std::fs::create_dir_all(&work).unwrap();
        let scheduler = self.scheduler.clone();
        self.spawn(
            name,
            &[
                "executor",
                "--scheduler",
                &scheduler,
                "--bind",
                &format!("127.0.0.1:{flight}"),
                "--grpc-port",
                &grpc.to_string(),
                "--devices",
                &format!("emulated:2/{name}"),
                "--slots",
                "2",
                "--work-dir",
                work.to_str().unwrap(),
            ],
        );
        wait_for_log(
            &self.log(name),
            "Executor registration succeed",
            Duration::from_secs(30),
        );
    }

    fn kill(&mut self, name: &str) {
        let (_, child) = self.children.iter_mut().find(|(n, _)| n == name).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// `fulmen --cluster` running `sql` (CSV, quiet).
    fn client(&self, sql: &str) -> Command {
        let mut cmd = fulmen();
        cmd.args([
            "--cluster",
            &self.scheduler,
            "-q",
            "--format",
            "csv",
            "-c",
            sql,
        ]);
        cmd
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for (_, child) in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// TPC-H at SF 0.01 as Parquet folders under `dir`, and the statements that declare them.
fn tpch_parquet(dir: &Path) -> String {
    let mut copy = String::new();
    let mut create = String::new();
    for table in TABLES {
        let location = dir.join(table);
        let location = location.to_str().unwrap();
        copy.push_str(&format!(
            "COPY {table} TO '{location}/' STORED AS PARQUET;\n"
        ));
        create.push_str(&format!(
            "CREATE EXTERNAL TABLE {table} STORED AS PARQUET LOCATION '{location}/';\n"
        ));
    }
    let o = run(&["--demo", "0.01", "-q", "--format", "csv", "-c", &copy]);
    assert!(o.status.success(), "{}", stderr(&o));
    create
}

/// The operators' `name=value` counts in EXPLAIN ANALYZE's text, summed.
fn metric(text: &str, name: &str) -> u64 {
    let key = format!("{name}=");
    text.split([' ', '[', ','])
        .filter_map(|w| w.strip_prefix(&key))
        .map(|v| v.trim_end_matches(']').parse::<u64>().unwrap_or(0))
        .sum()
}

#[test]
fn tpch_on_a_cluster_gives_the_single_process_answers_with_gpu_stages() {
    let mut cluster = Cluster::start(2);
    let data = cluster.dir.path().join("tpch");
    let tables = tpch_parquet(&data);
    let queries = QUERIES.join("\n");

    // One process, the CPU only: the oracle.
    let local = run(&[
        "--devices",
        "none",
        "-q",
        "--format",
        "csv",
        "-c",
        &tables,
        "-c",
        &queries,
    ]);
    assert!(local.status.success(), "{}", stderr(&local));
    let want = stdout(&local);
    assert!(want.lines().count() > 100, "{want}");

    // The cluster, every GPU-capable operator forced onto the executors' devices.
    let forced = cluster
        .client(&format!(
            "{tables}\nSET fulmen.gpu.mode = 'force';\nSET fulmen.gpu.on_error = 'fail';\n{queries}"
        ))
        .output()
        .unwrap();
    assert!(forced.status.success(), "{}", stderr(&forced));
    let got = stdout(&forced);
    for (n, (w, g)) in want.lines().zip(got.lines()).enumerate() {
        assert_eq!(w, g, "line {n} differs");
    }
    assert_eq!(want.lines().count(), got.lines().count());

    // Q1 and Q5's stages ran their operators on the executors' devices, by the metrics
    // the executors sent back; with the GPU turned off by SET on the client, none did.
    for (q, needs) in [(0, "AggregateExec"), (4, "HashJoinExec")] {
        let analyze = |mode: &str| {
            let o = cluster
                .client(&format!(
                    "{tables}\nSET fulmen.gpu.mode = '{mode}';\nEXPLAIN ANALYZE {}",
                    QUERIES[q]
                ))
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", stderr(&o));
            stdout(&o)
        };
        let on = analyze("force");
        assert!(
            on.contains("Plan with Metrics") && on.contains(needs),
            "{on}"
        );
        assert!(
            metric(&on, "gpu_batches") > 0,
            "Q{}: no device work:\n{on}",
            q + 1
        );
        assert!(metric(&on, "launches") > 0, "{on}");
        assert_eq!(metric(&on, "cpu_batches"), 0, "Q{}: {on}", q + 1);
        let off = analyze("off");
        assert!(off.contains("Plan with Metrics"), "{off}");
        assert_eq!(metric(&off, "gpu_batches"), 0, "{off}");
        assert!(!off.contains("launches="), "{off}");
    }

    // Both executors placed operators on their own devices.
    for name in ["executor0", "executor1"] {
        let log = std::fs::read_to_string(cluster.log(name)).unwrap();
        assert!(log.contains(&format!("emulated:2/{name}")), "{log}");
    }

    // An executor killed mid-query: its tasks run again on the other, once the scheduler
    // has missed its heartbeats; the answer is the single-process one.
    let slow = "SELECT count(*) FROM lineitem, part WHERE l_partkey < p_partkey \
                AND l_quantity > p_size";
    let want = run(&[
        "--devices",
        "none",
        "-q",
        "--format",
        "csv",
        "-c",
        &tables,
        "-c",
        slow,
    ]);
    assert!(want.status.success(), "{}", stderr(&want));
    let start = Instant::now();
    let query = cluster
        .client(&format!("{tables}\n{slow}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    cluster.kill("executor1");
    let o = query.wait_with_output().unwrap();
    let took = start.elapsed();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), stdout(&want));
    assert!(took < Duration::from_secs(120), "{took:?}");
    // And the scheduler noticed that it died.
    wait_for_log(
        &cluster.log("scheduler"),
        "heartbeat timed out",
        Duration::from_secs(60),
    );
}

#[test]
fn a_cluster_refuses_what_it_cannot_run_with_clear_errors() {
    // Nothing listens: an error within seconds, naming the address.
    let port = free_port();
    let start = Instant::now();
    let o = run(&["--cluster", &format!("127.0.0.1:{port}"), "-c", "SELECT 1"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains(&format!(
            "no Ballista scheduler answers at 127.0.0.1:{port}"
        )),
        "{}",
        stderr(&o)
    );
    assert!(start.elapsed() < Duration::from_secs(10));
    let o = run(&["--cluster", "http://h:1", "-c", "SELECT 1"]);
    assert!(
        stderr(&o).contains("is not a scheduler address"),
        "{}",
        stderr(&o)
    );
    let o = run(&["executor", "--scheduler", &format!("127.0.0.1:{port}")]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("no Ballista scheduler answers"),
        "{}",
        stderr(&o)
    );
    let o = run(&[
        "--cluster",
        "127.0.0.1:1",
        "--demo",
        "0.01",
        "-c",
        "SELECT 1",
    ]);
    assert!(
        stderr(&o).contains("--demo loads tables into this process"),
        "{}",
        stderr(&o)
    );

    let cluster = Cluster::start(1);
    let refused = |sql: &str, says: &str| {
        let o = cluster.client(sql).output().unwrap();
        assert_eq!(o.status.code(), Some(1), "{sql}: {}", stdout(&o));
        assert!(stderr(&o).contains(says), "{sql}: {}", stderr(&o));
    };
    refused(
        "CREATE TABLE t AS VALUES (1), (2); SELECT sum(column1) FROM t",
        "table 't' is an in-memory table held by this process",
    );
    refused(
        "SHOW DEVICES",
        "SHOW DEVICES is not available on a cluster yet",
    );
    refused(
        "CACHE TABLE t",
        "CACHE TABLE is not available on a cluster yet",
    );

    // What it can run: a query of files, and EXPLAIN with the stages and a word on
    // where operators are placed.
    let dir = cluster.dir.path().join("n.csv");
    std::fs::write(&dir, "a,b\n1,x\n2,y\n3,x\n").unwrap();
    let table = format!(
        "CREATE EXTERNAL TABLE n STORED AS CSV LOCATION '{}' OPTIONS ('format.has_header' 'true');",
        dir.display()
    );
    let o = cluster
        .client(&format!(
            "{table} SELECT b, sum(a) FROM n GROUP BY b ORDER BY b"
        ))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), "b,sum(n.a)\nx,4\ny,2\n");
    let o = cluster
        .client(&format!(
            "{table} EXPLAIN SELECT b, sum(a) FROM n GROUP BY b"
        ))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.contains("distributed_plan") && text.contains("gpu_placement"),
        "{text}"
    );
}
