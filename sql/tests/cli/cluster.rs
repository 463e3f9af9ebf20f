//! Fulmen on a Ballista cluster: a scheduler and two executors started here as child
//! processes of the `fulmen` binary, on loopback ports chosen at run time, each executor
//! with emulated devices of its own. TPC-H's 22 queries give the single-process answers
//! with GPU operators in the executors' stages (checked by their metrics and their logs);
//! settings SET on the client reach the executors; an executor killed while it runs a
//! task of a query costs a retry, not a wrong answer or a hang; a scheduler that does not
//! answer, and what a cluster cannot run, are clear errors.

use std::collections::BTreeMap;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use fulmen_engine::tpch::{QUERIES, TABLES};

use super::*;

/// The cluster tests run one at a time: each starts processes of its own, and on two
/// cores they would otherwise slow each other towards the executors' heartbeat timeout.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

/// `n` distinct ports nothing listens on now (the OS's picks, all held until each is
/// known, so that no two are the same).
fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    held.iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

/// Runs `cmd` with its output in files under `dir`, failing the test when it takes longer
/// than `limit` (the process is killed): a hang is a failure, not a stuck CI run.
fn output_within(mut cmd: Command, dir: &Path, limit: Duration) -> Output {
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (out, err) = (
        dir.join(format!("run{n}.out")),
        dir.join(format!("run{n}.err")),
    );
    let mut child = cmd
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .expect("the fulmen binary runs");
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "no answer within {limit:?}: {cmd:?}\nstderr: {}",
                std::fs::read_to_string(&err).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Output {
        status,
        stdout: std::fs::read(&out).unwrap(),
        stderr: std::fs::read(&err).unwrap(),
    }
}

/// How often `text` is in `log` so far.
fn occurrences(log: &Path, text: &str) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .matches(text)
        .count()
}

/// Waits until `log` holds more than `seen` of `texts` together, failing after `within`
/// with the log shown.
fn wait_for_log(log: &Path, texts: &[&str], seen: usize, within: Duration) {
    let start = Instant::now();
    while texts.iter().map(|t| occurrences(log, t)).sum::<usize>() <= seen {
        assert!(
            start.elapsed() < within,
            "none of {texts:?} in {} after {within:?}:\n{}",
            log.display(),
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until something accepts connections on `port`.
fn wait_for_port(port: u16, within: Duration) {
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < within,
            "nothing listens on {port} after {within:?}"
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
        let port = free_ports(1)[0];
        let mut cluster = Cluster {
            scheduler: format!("127.0.0.1:{port}"),
            dir,
            children: Vec::new(),
        };
        let scheduler = cluster.scheduler.clone();
        cluster.spawn("scheduler", &["scheduler", "--bind", &scheduler]);
        wait_for_port(port, Duration::from_secs(30));
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
        let ports = free_ports(2);
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
                &format!("127.0.0.1:{}", ports[0]),
                "--grpc-port",
                &ports[1].to_string(),
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
            &["Executor registration succeed"],
            0,
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

    /// The client's output for `sql`, within two minutes.
    fn query(&self, sql: &str) -> Output {
        output_within(self.client(sql), self.dir.path(), Duration::from_secs(120))
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

/// One process, the CPU only, running `sql`: the oracle.
fn single_process(dir: &Path, sql: &[&str]) -> String {
    let mut cmd = fulmen();
    cmd.args(["--devices", "none", "-q", "--format", "csv"]);
    for s in sql {
        cmd.args(["-c", s]);
    }
    let o = output_within(cmd, dir, Duration::from_secs(120));
    assert!(o.status.success(), "{}", stderr(&o));
    stdout(&o)
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

/// EXPLAIN's placement on a cluster, stage by stage: the GPU operators each stage's
/// `stage N: …` lines name, sorted.
fn explained_stages(text: &str) -> BTreeMap<usize, Vec<String>> {
    let mut stages = BTreeMap::new();
    for line in text.lines() {
        let Some((stage, placement)) = line
            .strip_prefix("stage ")
            .and_then(|rest| rest.split_once(": "))
        else {
            continue;
        };
        let ops: &mut Vec<String> = stages.entry(stage.parse().unwrap()).or_default();
        if placement.starts_with("Gpu") {
            ops.push(placement.split(' ').next().unwrap().to_string());
            ops.sort();
        }
    }
    stages
}

/// The GPU operators the executors' log lines (`job J stage N task T: K operators on
/// devices D (GpuA, GpuB)`) say each stage's tasks placed, sorted, into `stages`; every
/// task of a stage must have placed the same.
fn placed_stages(log: &str, stages: &mut BTreeMap<usize, Vec<String>>) {
    for line in log.lines().filter(|l| l.contains("operators on devices")) {
        let stage = line.split(" stage ").nth(1).unwrap();
        let stage: usize = stage.split(' ').next().unwrap().parse().unwrap();
        let names = line.rsplit_once(" (").unwrap().1.trim_end_matches(')');
        let mut ops: Vec<String> = names
            .split(", ")
            .filter(|n| n.starts_with("Gpu"))
            .map(str::to_string)
            .collect();
        ops.sort();
        let first = stages.entry(stage).or_insert_with(|| ops.clone());
        assert_eq!(
            *first, ops,
            "stage {stage}'s tasks placed differently: {line}"
        );
    }
}

/// The operators' `name=value` counts in EXPLAIN ANALYZE's text, summed (DataFusion
/// writes 1 234 as `1.23 K`).
fn metric(text: &str, name: &str) -> f64 {
    let key = format!("{name}=");
    let mut total = 0.0;
    for (at, _) in text.match_indices(&key) {
        if !matches!(text[..at].chars().next_back(), Some(' ' | '[' | ',')) {
            continue;
        }
        let value = &text[at + key.len()..];
        let value = value[..value.find([',', ']']).unwrap_or(value.len())].trim();
        let (number, scale) = match value.split_once(' ') {
            Some((n, "K")) => (n, 1e3),
            Some((n, "M")) => (n, 1e6),
            Some((n, "B")) => (n, 1e9),
            Some(_) => panic!("{name}: '{value}' is not a count"),
            None => (value, 1.0),
        };
        let n: f64 = number
            .parse()
            .unwrap_or_else(|_| panic!("{name}: '{value}' is not a count"));
        total += n * scale;
    }
    total
}

#[test]
fn metrics_are_read_as_datafusion_writes_them() {
    let text = "X: metrics=[gpu_batches=2, cpu_batches=0]\n Y: metrics=[gpu_batches=1.50 K]";
    assert_eq!(metric(text, "gpu_batches"), 1502.0);
    assert_eq!(metric(text, "cpu_batches"), 0.0);
    assert_eq!(metric("[split_gpu_batches=3]", "gpu_batches"), 0.0);
}

#[test]
fn tpch_on_a_cluster_gives_the_single_process_answers_with_gpu_stages() {
    let _serial = one_at_a_time();
    let mut cluster = Cluster::start(2);
    let data = cluster.dir.path().join("tpch");
    let tables = tpch_parquet(&data);
    let queries = QUERIES.join("\n");
    let want = single_process(cluster.dir.path(), &[&tables, &queries]);
    assert!(want.lines().count() > 100, "{want}");

    // The cluster, every GPU-capable operator forced onto the executors' devices, and a
    // device error failing the query rather than being redone on the CPU.
    let placed = |name: &str| occurrences(&cluster.log(name), "operators on devices emulated");
    let before = (placed("executor0"), placed("executor1"));
    let forced = cluster.query(&format!(
        "{tables}\nSET fulmen.gpu.mode = 'force';\nSET fulmen.gpu.on_error = 'fail';\n{queries}"
    ));
    assert!(forced.status.success(), "{}", stderr(&forced));
    let got = stdout(&forced);
    for (n, (w, g)) in want.lines().zip(got.lines()).enumerate() {
        assert_eq!(w, g, "line {n} differs");
    }
    assert_eq!(want.lines().count(), got.lines().count());
    // Both executors ran tasks, each placing operators on its own two devices.
    for (name, before) in [("executor0", before.0), ("executor1", before.1)] {
        let log = std::fs::read_to_string(cluster.log(name)).unwrap();
        assert!(placed(name) > before, "{name} ran no task:\n{log}");
        let on_its_devices = format!("operators on devices emulated:2/{name} (Gpu");
        assert!(log.contains(&on_its_devices), "{name}:\n{log}");
    }

    // EXPLAIN on the cluster gives each stage's placement: the GPU operators it names per
    // stage are the ones each executor placed when it ran a task of that stage (so its
    // stages are the scheduler's, numbered alike), with Ballista's adaptive planner off so
    // that the stages that run are the ones planned ahead. At the default (auto), SF
    // 0.01's scans are too small, and it says so.
    let forced_set =
        "SET fulmen.gpu.mode = 'force';\nSET ballista.planner.adaptive.enabled = false;";
    for q in [0, 4, 8] {
        let explain = cluster.query(&format!("{tables}\n{forced_set}\nEXPLAIN {}", QUERIES[q]));
        assert!(explain.status.success(), "{}", stderr(&explain));
        let text = stdout(&explain);
        let planned = explained_stages(&text);
        assert!(
            planned.values().any(|ops| !ops.is_empty()),
            "Q{}: no stage placed on devices:\n{text}",
            q + 1
        );
        let logs = ["executor0", "executor1"].map(|n| cluster.log(n));
        let lengths = logs.clone().map(|log| std::fs::read(log).unwrap().len());
        let run = cluster.query(&format!("{tables}\n{forced_set}\n{}", QUERIES[q]));
        assert!(run.status.success(), "{}", stderr(&run));
        let mut ran = BTreeMap::new();
        for (log, from) in logs.iter().zip(lengths) {
            let text = std::fs::read(log).unwrap();
            placed_stages(&String::from_utf8_lossy(&text[from..]), &mut ran);
        }
        assert_eq!(planned, ran, "Q{}: EXPLAIN said\n{text}", q + 1);
    }
    let auto = cluster.query(&format!("{tables}\nEXPLAIN {}", QUERIES[0]));
    let text = stdout(&auto);
    assert!(
        text.contains("stage 1: ") && text.contains("below fulmen.gpu.min_rows"),
        "{text}"
    );
    assert!(
        text.contains("the stages that run as earlier ones finish"),
        "{text}"
    );
    let off = cluster.query(&format!(
        "{tables}\nSET fulmen.gpu.mode = 'off';\nEXPLAIN {}",
        QUERIES[0]
    ));
    let text = stdout(&off);
    assert!(text.contains("every stage runs on the CPU"), "{text}");
    assert!(explained_stages(&text).is_empty(), "{text}");

    // Q1 and Q5 by the metrics the executors sent back: with the GPU forced by SET on the
    // client, their operators ran on devices; left at the default (auto, which keeps SF
    // 0.01's small inputs on the CPU) or SET off, none did. So the client's SET is what
    // the executors ran with.
    for (q, needs) in [(0, "AggregateExec"), (4, "HashJoinExec")] {
        let analyze = |set: &str| {
            let o = cluster.query(&format!("{tables}\n{set}\nEXPLAIN ANALYZE {}", QUERIES[q]));
            assert!(o.status.success(), "{}", stderr(&o));
            let text = stdout(&o);
            assert!(
                text.contains("Plan with Metrics") && text.contains(needs),
                "{text}"
            );
            text
        };
        let on = analyze("SET fulmen.gpu.mode = 'force';");
        assert!(
            metric(&on, "gpu_batches") > 0.0,
            "Q{}: no device work:\n{on}",
            q + 1
        );
        assert!(metric(&on, "launches") > 0.0, "{on}");
        assert_eq!(metric(&on, "cpu_batches"), 0.0, "Q{}: {on}", q + 1);
        for unset in ["", "SET fulmen.gpu.mode = 'off';"] {
            let off = analyze(unset);
            assert_eq!(metric(&off, "gpu_batches"), 0.0, "'{unset}': {off}");
            assert!(!off.contains("launches="), "'{unset}': {off}");
        }
    }

    // An executor killed while it runs a task of a query (whichever executor is running
    // one first): the scheduler misses its heartbeats (or fails to reach it), runs its
    // tasks again on the other, and the answer is the single-process one.
    let slow = "SELECT count(*) FROM lineitem, part WHERE l_partkey < p_partkey \
                AND l_quantity > p_size";
    let want = single_process(cluster.dir.path(), &[&tables, slow]);
    let lost = ["heartbeat timed out", "Removing executor"];
    let lost_before: usize = lost
        .iter()
        .map(|t| occurrences(&cluster.log("scheduler"), t))
        .sum();
    let running = |name: &str| {
        let log = cluster.log(name);
        occurrences(&log, "Execute task") > occurrences(&log, "Finished task")
    };
    assert!(!running("executor0") && !running("executor1"));
    let (out, err) = (
        cluster.dir.path().join("slow.out"),
        cluster.dir.path().join("slow.err"),
    );
    let mut query = cluster
        .client(&format!("{tables}\n{slow}"))
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let victim = loop {
        if let Some(name) = ["executor0", "executor1"].into_iter().find(|n| running(n)) {
            break name;
        }
        assert!(
            query.try_wait().unwrap().is_none(),
            "the query ended before a task was seen running"
        );
        assert!(start.elapsed() < Duration::from_secs(60), "no task ran");
        std::thread::sleep(Duration::from_millis(20));
    };
    cluster.kill(victim);
    let start = Instant::now();
    let status = loop {
        if let Some(status) = query.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > Duration::from_secs(120) {
            let _ = query.kill();
            panic!("no answer 120 s after {victim} died: a hang");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let err = std::fs::read_to_string(&err).unwrap();
    assert!(status.success(), "{victim} killed: {err}");
    assert_eq!(std::fs::read_to_string(&out).unwrap(), want);
    wait_for_log(
        &cluster.log("scheduler"),
        &lost,
        lost_before,
        Duration::from_secs(60),
    );
}

#[test]
fn a_cluster_refuses_what_it_cannot_run_with_clear_errors() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let within = |cmd: Command| output_within(cmd, dir.path(), Duration::from_secs(30));
    let args = |a: &[&str]| {
        let mut cmd = fulmen();
        cmd.args(a);
        cmd
    };
    // Nothing listens: an error within seconds, naming the address.
    let port = free_ports(1)[0];
    let start = Instant::now();
    let o = within(args(&[
        "--cluster",
        &format!("127.0.0.1:{port}"),
        "-c",
        "SELECT 1",
    ]));
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains(&format!(
            "no Ballista scheduler answers at 127.0.0.1:{port}"
        )),
        "{}",
        stderr(&o)
    );
    assert!(start.elapsed() < Duration::from_secs(10));
    let o = within(args(&["--cluster", "http://h:1", "-c", "SELECT 1"]));
    assert!(
        stderr(&o).contains("is not a scheduler address"),
        "{}",
        stderr(&o)
    );
    let o = within(args(&[
        "executor",
        "--scheduler",
        &format!("127.0.0.1:{port}"),
    ]));
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("no Ballista scheduler answers"),
        "{}",
        stderr(&o)
    );
    let o = within(args(&[
        "--cluster",
        "127.0.0.1:1",
        "--demo",
        "0.01",
        "-c",
        "SELECT 1",
    ]));
    assert!(
        stderr(&o).contains("--demo loads tables into this process"),
        "{}",
        stderr(&o)
    );

    let cluster = Cluster::start(1);
    let refused = |sql: &str, says: &str| {
        let o = cluster.query(sql);
        assert_eq!(o.status.code(), Some(1), "{sql}: {}", stdout(&o));
        assert!(stderr(&o).contains(says), "{sql}: {}", stderr(&o));
    };
    let in_memory = "table 't' is an in-memory table held by this process";
    refused(
        "CREATE TABLE t AS VALUES (1), (2); SELECT sum(column1) FROM t",
        in_memory,
    );
    refused(
        "CREATE TABLE t AS VALUES (1), (2); CREATE TABLE u AS SELECT * FROM t",
        in_memory,
    );
    refused(
        "SHOW DEVICES",
        "SHOW DEVICES is not available on a cluster yet",
    );
    refused(
        "CACHE TABLE t",
        "CACHE TABLE is not available on a cluster yet",
    );
    refused(
        "CREATE EXTERNAL TABLE s STORED AS PARQUET LOCATION 's3://b/t/' \
         OPTIONS ('aws.region' 'x')",
        "configures an object store in this process only",
    );

    // What it can run: a query of files, and EXPLAIN with the stages and a word on where
    // operators are placed.
    let csv = cluster.dir.path().join("n.csv");
    std::fs::write(&csv, "a,b\n1,x\n2,y\n3,x\n").unwrap();
    let table = format!(
        "CREATE EXTERNAL TABLE n STORED AS CSV LOCATION '{}' \
         OPTIONS ('format.has_header' 'true');",
        csv.display()
    );
    let o = cluster.query(&format!(
        "{table} SELECT b, sum(a) FROM n GROUP BY b ORDER BY b"
    ));
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), "b,sum(n.a)\nx,4\ny,2\n");
    let o = cluster.query(&format!(
        "{table} EXPLAIN SELECT b, sum(a) FROM n GROUP BY b"
    ));
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.contains("distributed_plan") && text.contains("gpu_placement"),
        "{text}"
    );
}
