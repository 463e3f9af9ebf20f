//! `fulmen scheduler`: Ballista's scheduler, which plans stages on the CPU (executors
//! place them on their devices) and knows Fulmen's settings.

use std::net::SocketAddr;
use std::sync::Arc;

use ballista_core::extension::{
    ballista_aggregate_functions, ballista_scalar_functions, ballista_window_functions,
};
use ballista_scheduler::cluster::BallistaCluster;
use ballista_scheduler::config::SchedulerConfig;
use ballista_scheduler::scheduler_process::start_server;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::{SessionState, SessionStateBuilder};
use datafusion::prelude::SessionConfig;

use crate::{EXECUTOR_TIMEOUT_SECONDS, session_config};

/// What `fulmen scheduler` was asked for.
#[derive(Debug, Clone)]
pub struct SchedulerOptions {
    /// Where the scheduler listens for clients and executors.
    pub bind: SocketAddr,
}

/// Runs a scheduler until the process is stopped.
pub async fn run_scheduler(options: SchedulerOptions) -> Result<()> {
    let config = SchedulerConfig {
        bind_host: options.bind.ip().to_string(),
        bind_port: options.bind.port(),
        override_config_producer: Some(Arc::new(session_config)),
        override_session_builder: Some(Arc::new(session_state)),
        // A killed executor is noticed in seconds, not Ballista's default three minutes:
        // its tasks then run again on the others.
        executor_timeout_seconds: EXECUTOR_TIMEOUT_SECONDS,
        no_executors_grace_period_seconds: EXECUTOR_TIMEOUT_SECONDS,
        expire_dead_executor_interval_seconds: 2,
        ..SchedulerConfig::default()
    };
    let cluster = BallistaCluster::new_from_config(&config)
        .await
        .map_err(ballista_error)?;
    start_server(cluster, options.bind, Arc::new(config))
        .await
        .map_err(ballista_error)
}

/// The scheduler's session for a client's session: DataFusion's defaults with Fulmen's
/// runtime (object stores) and Ballista's functions and rules, without the GPU rule: the
/// stage plans it sends are CPU plans, which every executor can decode.
fn session_state(config: SessionConfig) -> Result<SessionState> {
    Ok(SessionStateBuilder::new()
        .with_default_features()
        .with_config(config)
        .with_runtime_env(fulmen_engine::context::runtime_env())
        .with_optimizer_rules(ballista_core::optimizer::ballista_default_optimizer_rules())
        .with_scalar_functions(ballista_scalar_functions())
        .with_aggregate_functions(ballista_aggregate_functions())
        .with_window_functions(ballista_window_functions())
        .build())
}

pub(crate) fn ballista_error(e: ballista_core::error::BallistaError) -> DataFusionError {
    match e {
        ballista_core::error::BallistaError::DataFusionError(e) => *e,
        other => DataFusionError::External(Box::new(other)),
    }
}
