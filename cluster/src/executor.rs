//! `fulmen executor`: Ballista's executor, running each stage with Fulmen's GPU rule on
//! this process's devices.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ballista_executor::executor_process::{ExecutorProcessConfig, start_executor_process};
use datafusion::error::Result;
use fulmen_engine::DeviceSelection;

use crate::scheduler::ballista_error;
use crate::{GpuExecutionEngine, HEARTBEAT_SECONDS, session_config};

/// What `fulmen executor` was asked for.
#[derive(Debug, Clone)]
pub struct ExecutorOptions {
    /// The scheduler's host and port.
    pub scheduler: (String, u16),
    /// Where this executor serves its shuffle data (Arrow Flight); the scheduler reaches
    /// it at this address too.
    pub bind: SocketAddr,
    /// The port of its task service (gRPC), on the same host.
    pub grpc_port: u16,
    /// The devices its stages run on.
    pub devices: DeviceSelection,
    /// Tasks it runs at once (default: the machine's cores).
    pub slots: Option<usize>,
    /// Where it writes shuffle files (default: a fresh temporary directory).
    pub work_dir: Option<PathBuf>,
}

/// Runs an executor until the process is stopped.
pub async fn run_executor(options: ExecutorOptions) -> Result<()> {
    log::info!(
        "this executor runs its stages on devices {} (its own; a client's fulmen.devices does \
         not apply here)",
        options.devices
    );
    let defaults = ExecutorProcessConfig::default();
    let config = ExecutorProcessConfig {
        bind_host: options.bind.ip().to_string(),
        // Bound to every interface: the scheduler records the address it sees the
        // executor connect from, which the others can reach.
        external_host: (!options.bind.ip().is_unspecified()).then(|| options.bind.ip().to_string()),
        port: options.bind.port(),
        grpc_port: options.grpc_port,
        scheduler_host: options.scheduler.0,
        scheduler_port: options.scheduler.1,
        vcores: options.slots.unwrap_or(defaults.vcores),
        work_dir: options.work_dir.map(|d| d.display().to_string()),
        executor_heartbeat_interval_seconds: HEARTBEAT_SECONDS,
        print_thread_info: false,
        override_config_producer: Some(Arc::new(session_config)),
        override_runtime_producer: Some(Arc::new(|_| Ok(fulmen_engine::context::runtime_env()))),
        override_execution_engine: Some(Arc::new(GpuExecutionEngine::new(
            options.devices,
            Duration::from_secs(defaults.client_ttl),
        ))),
        ..defaults
    };
    start_executor_process(Arc::new(config))
        .await
        .map_err(ballista_error)
}
