//! Fulmen on a cluster: the scheduler and executor processes of Apache DataFusion
//! Ballista, set up for Fulmen (`fulmen scheduler`, `fulmen executor`; see
//! docs/cluster.md).
//!
//! The client ([`fulmen_engine::FulmenContext::remote`]) plans each query and sends the
//! logical plan to the scheduler, which splits it into stages of CPU operators and hands
//! their tasks to executors. Each executor runs Fulmen's GPU rule over the stage plan it
//! receives, on its own devices ([`GpuExecutionEngine`]): where an operator runs depends
//! on the devices of the process that runs it, and GPU operators hold process-local
//! device state, so they are never serialized and no process assumes another's devices.
//! `fulmen.*` settings travel with the session: every process registers Fulmen's settings
//! extension, so the client's `SET fulmen.…` reaches the executors (all but
//! `fulmen.devices`, which each executor sets for itself).

mod engine;
mod executor;
mod metrics;
mod pool;
mod scheduler;

pub use engine::GpuExecutionEngine;
pub use executor::{ExecutorOptions, run_executor};
pub use scheduler::{SchedulerOptions, run_scheduler};

use datafusion::prelude::SessionConfig;
use fulmen_engine::FulmenConfig;

use ballista_core::extension::SessionConfigExt;

/// How often an executor tells the scheduler it is alive.
pub const HEARTBEAT_SECONDS: u64 = 2;

/// An executor silent for this long is taken as dead: its tasks run again elsewhere.
pub const EXECUTOR_TIMEOUT_SECONDS: u64 = 20;

/// The session settings every cluster process starts from: Ballista's, with Fulmen's
/// extension registered so that `fulmen.*` keys are kept (Ballista drops keys no
/// registered extension knows).
pub fn session_config() -> SessionConfig {
    SessionConfig::new_with_ballista()
        .with_information_schema(true)
        .with_option_extension(FulmenConfig::default())
}
