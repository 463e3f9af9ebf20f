//! GPU operators against DataFusion on emulated devices: each test's answers equal
//! DataFusion's, and each proves the device did the work from the executed plan's own
//! metrics (batches on the device, none redone on the CPU), on a device set no other test
//! uses (`emulated:N/NAME`), with device errors failing the query
//! (`fulmen.gpu.on_error = fail`) instead of hiding behind a CPU answer.
//!
//! ```text
//! mod.rs               sessions, running a query, metrics of the executed plan, faults
//! filter_projection.rs random expressions (filters, projections), faults, four devices
//! aggregate.rs         random GROUP BY queries, count(DISTINCT), faults, memory pressure
//! one_stage.rs         one device: an aggregation over every partition in one stage
//! join.rs              random joins of every type, the probe side's dynamic filter
//! tpch.rs              the 22 TPC-H queries on one and four devices, memory, faults
//! residency.rs         device-resident chains: only inputs go up, only groups come down
//! cache.rs             cached tables: TPC-H resident, placement, faults, consistency
//! dictionary.rs        cached strings held dictionary-encoded
//! ```

use std::sync::Arc;

use datafusion::arrow::util::pretty::{pretty_format_batches, pretty_format_batches_with_schema};
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::physical_plan::{ExecutionPlan, displayable};
use datafusion::prelude::SessionConfig;

use crate::config::{GpuMode, OnError};
use crate::{FulmenConfig, FulmenContext};

mod aggregate;
mod build_sides;
mod cache;
mod cache_lifecycle;
mod dictionary;
mod filter_projection;
mod fused;
mod fused_join;
mod join;
mod one_stage;
mod residency;
mod semi_marks;
mod tpch;

/// Whether this run puts the tests on CUDA devices (`FULMEN_TEST_DEVICE=cuda`: a real GPU,
/// or the stand-in driver that `scripts/test.sh` builds).
fn on_cuda() -> bool {
    std::env::var("FULMEN_TEST_DEVICE").as_deref() == Ok("cuda")
}

/// `selection` (an emulated set of a test's own, such as `emulated:4/tpch`) as this run's
/// devices: itself, or on CUDA as many devices as it names and the machine has (`cuda:0`,
/// `cuda:0,1`): a machine's GPUs are shared by every test, so there the plans' own metrics
/// are what proves the work, and a test that counts its device work has the GPUs to itself
/// ([`alone_on_cuda`]).
fn test_devices(selection: &str) -> String {
    if !on_cuda() {
        return selection.to_string();
    }
    share_cuda();
    let wanted: usize = selection
        .trim_start_matches("emulated:")
        .split('/')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1);
    let present = fulmen_kernels::cuda::list_devices()
        .map(|d| d.len())
        .unwrap_or(0);
    let n = wanted.min(present).max(1);
    let ordinals: Vec<String> = (0..n).map(|i| i.to_string()).collect();
    format!("cuda:{}", ordinals.join(","))
}

/// Who is using the machine's GPUs in a CUDA run: every test that opens its devices shares
/// them ([`share_cuda`]), except a test counting its own device work, which must have them
/// to itself ([`alone_on_cuda`]). Another test's work on a shared GPU is seen in the counts:
/// its queued work keeps the device's own stream busy, so a cross-stream wait is counted
/// where none would be, and its copies in the shared upload staging cost host waits when a
/// half is refilled.
static CUDA_USERS: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// How this thread holds [`CUDA_USERS`]: for as long as the thread lives, which is the
/// test's (each test runs on a thread of its own), and its work is done by then.
enum CudaHold {
    Shared(#[allow(dead_code)] std::sync::RwLockReadGuard<'static, ()>),
    Alone(#[allow(dead_code)] std::sync::RwLockWriteGuard<'static, ()>),
}

thread_local! {
    static CUDA_HOLD: std::cell::RefCell<Option<CudaHold>> = const { std::cell::RefCell::new(None) };
}

/// This test shares the GPUs with other tests (taken when it first names its devices).
fn share_cuda() {
    CUDA_HOLD.with(|hold| {
        let mut hold = hold.borrow_mut();
        if hold.is_none() {
            let guard = CUDA_USERS.read().unwrap_or_else(|p| p.into_inner());
            *hold = Some(CudaHold::Shared(guard));
        }
    });
}

/// On CUDA, waits until no other test uses the GPUs and keeps them for this one until it
/// ends, then waits for every stream of `selection`'s devices (so that work queued before,
/// by any test, costs this one nothing). A no-op on emulated devices, each set a test's own.
fn alone_on_cuda(selection: &str) {
    if !on_cuda() {
        return;
    }
    CUDA_HOLD.with(|hold| {
        let mut hold = hold.borrow_mut();
        if !matches!(*hold, Some(CudaHold::Alone(_))) {
            // A shared hold of this thread's own would wait for itself.
            *hold = None;
            let guard = CUDA_USERS.write().unwrap_or_else(|p| p.into_inner());
            *hold = Some(CudaHold::Alone(guard));
        }
    });
    settle_cuda(selection);
}

/// On CUDA, waits for every stream of `selection`'s devices (counted, as any sync).
fn settle_cuda(selection: &str) {
    if !on_cuda() {
        return;
    }
    for device in devices_of(selection).iter() {
        for stream in 0..device.streams() {
            device.on_stream(stream).synchronize().unwrap();
        }
    }
}

/// Says so and returns true when a test needs the emulator's own fault injection, which
/// CUDA devices do not have (the stand-in driver's faults are set by environment).
fn needs_emulator(test: &str) -> bool {
    if on_cuda() {
        println!("{test}: not on CUDA devices (it injects faults into emulated devices)");
    }
    on_cuda()
}

/// How plans name the devices of `selection` (`emulated:0,emulated:1`, `cuda:0`).
fn described(selection: &str) -> String {
    crate::gpu::devices::describe(&devices_of(selection))
}

/// The settings of a GPU test: the GPU forced on `devices` (a set of the test's own, such
/// as `emulated:1/joins`), and a device error is the query's error.
fn gpu_config(devices: &str) -> FulmenConfig {
    FulmenConfig {
        devices: test_devices(devices).parse().unwrap(),
        gpu_mode: GpuMode::Force,
        gpu_on_error: OnError::Fail,
        ..FulmenConfig::default()
    }
}

/// The settings of the CPU side of a comparison: plain DataFusion.
fn cpu_config() -> FulmenConfig {
    FulmenConfig {
        gpu_mode: GpuMode::Off,
        ..FulmenConfig::default()
    }
}

/// A session with `config` and `partitions` target partitions.
fn session(config: FulmenConfig, partitions: usize) -> FulmenContext {
    FulmenContext::with_session_config(
        SessionConfig::new().with_target_partitions(partitions),
        config,
    )
}

/// The devices a selection names (opened on first use, shared with the sessions naming it).
fn devices_of(selection: &str) -> Arc<Vec<fulmen_kernels::Device>> {
    crate::gpu::devices::devices(&test_devices(selection).parse().unwrap()).unwrap()
}

async fn setup(ctx: &FulmenContext) {
    ctx.sql(
        "CREATE TABLE t AS VALUES (1, 2.5, 'apple', DATE '2024-03-05'), \
         (2, NULL, 'banana', DATE '1969-12-31'), (NULL, -1.0, NULL, NULL)",
    )
    .await
    .unwrap()
    .collect()
    .await
    .unwrap();
}

/// A query's plan text and rows (it must succeed).
async fn run(ctx: &FulmenContext, sql: &str) -> (String, String) {
    let frame = ctx.sql(sql).await.unwrap();
    let plan = frame.clone().create_physical_plan().await.unwrap();
    let plan_text = displayable(plan.as_ref()).indent(true).to_string();
    let batches = frame.collect().await.unwrap();
    (
        plan_text,
        pretty_format_batches(&batches).unwrap().to_string(),
    )
}

/// Where the GPU operators of an executed plan did their batches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Work {
    /// Batches done on a device.
    gpu_batches: usize,
    /// Batches redone on the CPU because the device could not do them.
    cpu_batches: usize,
    /// Batches a program handed to the CPU by rule (an overflow, a division by zero).
    cpu_rule_batches: usize,
    /// Aggregations and joins that gave up the device and finished on the CPU.
    cpu_fallback: usize,
    /// Device batches split in halves because they did not fit in device memory.
    split_batches: usize,
}

impl Work {
    fn of(plan: &Arc<dyn ExecutionPlan>) -> Self {
        Self {
            gpu_batches: metric_sum(plan, "gpu_batches"),
            cpu_batches: metric_sum(plan, "cpu_batches"),
            cpu_rule_batches: metric_sum(plan, "cpu_rule_batches"),
            cpu_fallback: metric_sum(plan, "cpu_fallback"),
            split_batches: metric_sum(plan, "split_batches"),
        }
    }

    /// Nothing the device was given went back to the CPU for lack of a device (rows a
    /// program hands to the CPU by rule are allowed).
    fn nothing_fell_back(&self) -> bool {
        self.cpu_batches == 0 && self.cpu_fallback == 0
    }
}

/// A query's rows (or error), its plan with the GPU placement report, and where the
/// executed plan's GPU operators did their batches.
async fn answer(ctx: &FulmenContext, sql: &str) -> (Result<String, String>, String, Work) {
    let frame = match ctx.sql(sql).await {
        Ok(f) => f,
        Err(e) => return (Err(e.to_string()), String::new(), Work::default()),
    };
    let options = ctx.session_context().state().config().options().clone();
    let schema = Arc::new(frame.schema().as_arrow().clone());
    let plan = match frame.create_physical_plan().await {
        Ok(p) => p,
        Err(e) => return (Err(e.to_string()), String::new(), Work::default()),
    };
    let text = format!(
        "{}{}",
        displayable(plan.as_ref()).indent(false),
        crate::gpu::placement_report(&plan, &options).join("\n")
    );
    let task = ctx.session_context().task_ctx();
    let rows = match datafusion::physical_plan::collect(Arc::clone(&plan), task).await {
        Ok(b) => pretty_format_batches_with_schema(schema, &b)
            .map(|t| t.to_string())
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    (rows, text, Work::of(&plan))
}

/// The sum of a metric over every node of a plan.
fn metric_sum(plan: &Arc<dyn ExecutionPlan>, name: &str) -> usize {
    let mut total = 0;
    let _ = plan.apply(|node| {
        if let Some(m) = node.metrics() {
            total += m.sum_by_name(name).map_or(0, |v| v.as_usize());
        }
        Ok(TreeNodeRecursion::Continue)
    });
    total
}

fn plan_has(plan: &Arc<dyn ExecutionPlan>, name: &str) -> bool {
    let mut found = false;
    let _ = plan.apply(|node| {
        found |= node.name() == name;
        Ok(TreeNodeRecursion::Continue)
    });
    found
}

/// A GPU session on `devices` and a CPU one, with TPC-H at SF 0.01 registered in both.
fn tpch_contexts(
    devices: &str,
    partitions: usize,
    limit: Option<usize>,
) -> (FulmenContext, FulmenContext) {
    let gpu = session(
        FulmenConfig {
            gpu_memory_limit: limit,
            ..gpu_config(devices)
        },
        partitions,
    );
    let cpu = session(cpu_config(), partitions);
    gpu.register_tpch(0.01).unwrap();
    cpu.register_tpch(0.01).unwrap();
    (gpu, cpu)
}

/// The physical plan of `sql` on `ctx` (it must plan).
async fn plan_of(ctx: &FulmenContext, sql: &str) -> Arc<dyn ExecutionPlan> {
    let frame = ctx.sql(sql).await.unwrap();
    frame.create_physical_plan().await.unwrap()
}

/// Executes `plan` on `ctx` (it must succeed) and renders its rows; the plan keeps the
/// metrics of the run.
async fn rows_of(ctx: &FulmenContext, plan: &Arc<dyn ExecutionPlan>) -> String {
    let task = ctx.session_context().task_ctx();
    let batches = datafusion::physical_plan::collect(Arc::clone(plan), task)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    pretty_format_batches(&batches).unwrap().to_string()
}

/// Runs TPC-H query `q` (1-based) on `gpu`: its rows and the executed plan.
async fn tpch_run(gpu: &FulmenContext, q: usize) -> (String, Arc<dyn ExecutionPlan>) {
    let plan = plan_of(gpu, crate::tpch::QUERIES[q - 1]).await;
    (rows_of(gpu, &plan).await, plan)
}

/// Runs a property test's async body on a runtime of its own.
fn block_on<T>(body: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(body)
}

/// Fails each of `device`'s next `allocations` allocations in turn, then each of its next
/// `launches` launches, and checks that `run` still answers `want` every time.
async fn fail_each_in_turn<T: PartialEq + std::fmt::Debug>(
    device: &fulmen_kernels::Device,
    (allocations, launches): (u64, u64),
    want: &T,
    label: &str,
    mut run: impl AsyncFnMut() -> T,
) {
    use fulmen_kernels::FaultPlan;

    println!("{label}: {allocations} allocations and {launches} launches fail in turn");
    for (kind, count) in [("allocation", allocations), ("launch", launches)] {
        for k in 1..=count {
            let faults = FaultPlan {
                fail_allocation: (kind == "allocation").then_some(k),
                fail_launch: (kind == "launch").then_some(k),
                ..FaultPlan::default()
            };
            device.inject_faults(faults).unwrap();
            let got = run().await;
            device.inject_faults(FaultPlan::default()).unwrap();
            assert_eq!(&got, want, "{label} with {kind} {k} failing");
        }
    }
}
