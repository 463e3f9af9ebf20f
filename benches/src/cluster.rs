//! `fulmen-bench tpch --cluster N`: a Ballista cluster on this machine — a scheduler and N
//! executors, child processes of the `fulmen` binary built beside `fulmen-bench`, on
//! loopback ports chosen at run time — for the `fulmen-cluster` engine.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// The processes of a local cluster, killed when it is dropped.
#[derive(Debug)]
pub struct LocalCluster {
    /// The scheduler's `host:port`.
    pub scheduler: String,
    /// Executors started.
    pub executors: usize,
    children: Vec<Child>,
    _work: tempfile::TempDir,
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn wait_until_listening(what: &str, port: u16, child: &mut Child) -> Result<()> {
    let start = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Some(status) = child.try_wait()? {
            bail!("the local cluster's {what} exited ({status}) before listening");
        }
        if start.elapsed() > Duration::from_secs(60) {
            bail!("the local cluster's {what} did not listen on port {port} within 60 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

impl LocalCluster {
    /// Starts a scheduler and `executors` executors, each using the devices
    /// `FULMEN_DEVICES` names (every executor its own), and waits until all listen.
    pub fn start(executors: usize) -> Result<Self> {
        if executors == 0 {
            bail!("--cluster needs at least 1 executor");
        }
        let fulmen: PathBuf = std::env::current_exe()?.with_file_name("fulmen");
        if !fulmen.exists() {
            bail!(
                "--cluster runs the `fulmen` binary beside fulmen-bench, and {} is missing \
                 (build both: cargo build --release --bins)",
                fulmen.display()
            );
        }
        let work = tempfile::tempdir()?;
        let port = free_port()?;
        let mut cluster = LocalCluster {
            scheduler: format!("127.0.0.1:{port}"),
            executors,
            children: Vec::new(),
            _work: work,
        };
        let log = |name: &str| -> Result<std::fs::File> {
            let path = cluster_log_dir().join(format!("{name}.log"));
            std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))
        };
        std::fs::create_dir_all(cluster_log_dir())?;
        let mut scheduler = Command::new(&fulmen)
            .args(["scheduler", "--bind", &cluster.scheduler])
            .stdout(Stdio::null())
            .stderr(log("scheduler")?)
            .spawn()
            .context("starting the scheduler")?;
        wait_until_listening("scheduler", port, &mut scheduler)?;
        cluster.children.push(scheduler);
        for n in 0..executors {
            let (flight, grpc) = (free_port()?, free_port()?);
            let dir = cluster._work.path().join(format!("executor{n}"));
            std::fs::create_dir_all(&dir)?;
            let mut executor = Command::new(&fulmen)
                .args(["executor", "--scheduler", &cluster.scheduler])
                .args(["--bind", &format!("127.0.0.1:{flight}")])
                .args(["--grpc-port", &grpc.to_string()])
                .arg("--work-dir")
                .arg(&dir)
                .stdout(Stdio::null())
                .stderr(log(&format!("executor{n}"))?)
                .spawn()
                .context("starting an executor")?;
            // Its Flight service starts once the scheduler has registered it.
            wait_until_listening("executor", flight, &mut executor)?;
            cluster.children.push(executor);
        }
        eprintln!(
            "local cluster: scheduler at {}, {executors} executors (logs in {})",
            cluster.scheduler,
            cluster_log_dir().display()
        );
        Ok(cluster)
    }
}

/// Where the local cluster's processes write their logs.
fn cluster_log_dir() -> PathBuf {
    std::env::temp_dir().join("fulmen-bench-cluster")
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
