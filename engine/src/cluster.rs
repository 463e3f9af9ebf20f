//! The client's side of a Ballista cluster ([`FulmenContext::remote`]): the scheduler's
//! address, a check that it answers, a check that a query reads only tables every
//! executor can read itself, and EXPLAIN's GPU placement of each stage.
//!
//! [`FulmenContext::remote`]: crate::FulmenContext::remote

use std::time::Duration;

use ballista_core::JobId;
use ballista_core::extension::SessionConfigExt;
use ballista_scheduler::planner::{DefaultDistributedPlanner, DistributedPlanner};
use datafusion::catalog::TableProvider;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::datasource::listing::ListingTable;
use datafusion::datasource::{MemTable, ViewTable, source_as_provider};
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::SessionStateBuilder;
use datafusion::execution::session_state::SessionState;
use datafusion::logical_expr::LogicalPlan;

use crate::config::{FulmenConfig, GpuMode};

/// Ballista's scheduler port when a URL gives none.
pub const DEFAULT_SCHEDULER_PORT: u16 = 50050;

/// How long [`probe`] waits for the scheduler to accept a connection.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// `host:port` of the scheduler named by `url`: `df://host:port`, `df://host` (port
/// 50050) or `host:port`.
pub fn scheduler_address(url: &str) -> Result<String> {
    let bad = |why: &str| {
        DataFusionError::Configuration(format!(
            "'{url}' is not a scheduler address ({why}); write df://host:port"
        ))
    };
    let rest = match url.split_once("://") {
        Some(("df", rest)) => rest,
        Some((scheme, _)) => return Err(bad(&format!("scheme '{scheme}' is not df"))),
        None => url,
    };
    let rest = rest.trim_end_matches('/');
    if rest.is_empty() || rest.contains('/') {
        return Err(bad("a host and a port, nothing else"));
    }
    // `[::1]` (IPv6, no port) has colons but no port; `[::1]:9` and `h:9` have one.
    let bracketed = rest.starts_with('[') && rest.ends_with(']');
    let (host, port) = match rest.rsplit_once(':') {
        Some((host, port)) if !bracketed => {
            let port: u16 = port.parse().map_err(|_| bad("the port is not a number"))?;
            (host, port)
        }
        _ => (rest, DEFAULT_SCHEDULER_PORT),
    };
    if host.is_empty() {
        return Err(bad("no host"));
    }
    Ok(format!("{host}:{port}"))
}

/// Fails with a clear error, within [`PROBE_TIMEOUT`], when nothing accepts connections at
/// `address` (`host:port`).
pub async fn probe(address: &str) -> Result<()> {
    let unreachable = |why: String| {
        DataFusionError::Execution(format!(
            "no Ballista scheduler answers at {address}: {why} (start one with `fulmen \
             scheduler --bind {address}`)"
        ))
    };
    match tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(address)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(unreachable(e.to_string())),
        Err(_) => Err(unreachable(format!(
            "no answer within {} s",
            PROBE_TIMEOUT.as_secs()
        ))),
    }
}

/// Fails when `plan` reads a table that lives only in this process (an in-memory table,
/// a Kafka live table, a table function's rows): executors read each table themselves, so
/// only tables of files and object stores can be read on a cluster.
pub fn check_tables_travel(plan: &LogicalPlan) -> Result<()> {
    let mut found = Ok(());
    plan.apply_with_subqueries(|node| {
        let LogicalPlan::TableScan(scan) = node else {
            return Ok(TreeNodeRecursion::Continue);
        };
        if scan.table_name.schema() == Some("information_schema") {
            return Ok(TreeNodeRecursion::Continue);
        }
        let provider = source_as_provider(&scan.source)?;
        if let Some(view) = provider.downcast_ref::<ViewTable>() {
            check_tables_travel(view.logical_plan())?;
            return Ok(TreeNodeRecursion::Continue);
        }
        if !provider.is::<ListingTable>() {
            found = Err(DataFusionError::Plan(format!(
                "table '{}' is {} held by this process, which the cluster's executors cannot \
                 read: on a cluster, queries read tables of files or object stores (CREATE \
                 EXTERNAL TABLE … LOCATION '…' that every executor can reach); see \
                 docs/cluster.md",
                scan.table_name,
                kind(provider.as_ref())
            )));
            return Ok(TreeNodeRecursion::Stop);
        }
        Ok(TreeNodeRecursion::Continue)
    })?;
    found
}

/// EXPLAIN's `gpu_placement` lines for `plan` on a cluster: the query's stages as
/// Ballista's planner cuts them (planned here, in `local`, a session planning in this
/// process with the cluster session's tables and settings), each with the placement the
/// GPU rule makes of its operators on an executor. Executors run the rule over the CPU
/// stage plans the scheduler sends them, so the stages are planned with the GPU off and
/// placed one by one, as an executor does. Ballista's adaptive planner, when on, plans the
/// stages that run as earlier ones finish: the first line then says so.
pub async fn stage_placement(local: &SessionState, plan: &LogicalPlan) -> Result<Vec<String>> {
    let mut config = local.config().clone();
    let fulmen = config
        .options_mut()
        .extensions
        .get_mut::<FulmenConfig>()
        .ok_or_else(|| DataFusionError::Internal("the session has no fulmen settings".into()))?;
    let mode = fulmen.gpu_mode;
    if mode == GpuMode::Off {
        return Ok(vec![
            "fulmen.gpu.mode is off: every stage runs on the CPU".to_string(),
        ]);
    }
    fulmen.gpu_mode = GpuMode::Off;
    let cpu = SessionStateBuilder::new_from_existing(local.clone())
        .with_config(config)
        .build();
    let physical = cpu.create_physical_plan(plan).await?;
    let stages = DefaultDistributedPlanner::new()
        .plan_query_stages(&JobId::new("explain"), physical, cpu.config().options())
        .map_err(|e| DataFusionError::External(Box::new(e)))?;
    let mut lines = Vec::new();
    if local.config().ballista_adaptive_query_planner_enabled() {
        lines.push(
            "the stages below are Ballista's static plan; with ballista.planner.adaptive.enabled \
             (Ballista's default) the scheduler plans the stages that run as earlier ones \
             finish, from their measured outputs: they are numbered from 0, and their joins \
             and partitions may differ (SET ballista.planner.adaptive.enabled = false runs \
             these)"
                .to_string(),
        );
    }
    for stage in stages {
        let children = stage.children();
        let [input] = children.as_slice() else {
            return Err(DataFusionError::Internal(format!(
                "stage {} is a shuffle writer over {} inputs",
                stage.stage_id(),
                children.len()
            )));
        };
        lines.extend(crate::gpu::stage_placement_report(
            stage.stage_id(),
            input,
            local.config().options(),
        )?);
    }
    Ok(lines)
}

fn kind(provider: &dyn TableProvider) -> &'static str {
    if provider.is::<MemTable>() {
        "an in-memory table"
    } else {
        "a table (a Kafka live table, a cached table or another kind)"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stages a query's EXPLAIN places on a cluster are Ballista's, each placed as an
    /// executor's GPU rule places it: a grouped sum is a partial aggregate in the stage
    /// that scans and a final one in the stage after the shuffle, whose input's rows are
    /// known only when it runs.
    #[tokio::test]
    async fn explain_places_each_stage_as_an_executor_does() {
        let ctx = crate::FulmenContext::with_config(FulmenConfig {
            devices: "none".parse().unwrap(),
            ..FulmenConfig::default()
        });
        ctx.sql("CREATE TABLE t (a BIGINT, b VARCHAR) AS VALUES (1, 'x'), (2, 'y'), (3, 'x')")
            .await
            .unwrap();
        let query = "SELECT b, sum(a) FROM t WHERE a > 1 GROUP BY b";
        let plan = |set: &'static str| {
            let ctx = &ctx;
            async move {
                ctx.sql(set).await.unwrap();
                let state = ctx.session_context().state();
                let plan = state.create_logical_plan(query).await.unwrap();
                stage_placement(&state, &plan).await.unwrap()
            }
        };
        let forced = plan("SET fulmen.gpu.mode = 'force'").await;
        let stage = |n: usize, text: &str| {
            forced
                .iter()
                .any(|l| l.starts_with(&format!("stage {n}: ")) && l.contains(text))
        };
        assert!(
            stage(1, "GpuFilterExec runs on each executor's devices"),
            "{forced:#?}"
        );
        assert!(
            stage(1, "GpuAggregateExec (Partial) runs on"),
            "{forced:#?}"
        );
        assert!(
            stage(2, "GpuAggregateExec (FinalPartitioned) runs on"),
            "{forced:#?}"
        );
        assert!(
            !forced.iter().any(|l| l.contains("known only when")),
            "{forced:#?}"
        );
        let auto = plan("SET fulmen.gpu.mode = 'auto'").await;
        assert!(
            auto.iter()
                .any(|l| l.starts_with("stage 1: ") && l.contains("below fulmen.gpu.min_rows")),
            "{auto:#?}"
        );
        assert!(
            auto.iter().any(
                |l| l.starts_with("stage 2: GpuAggregateExec") && l.contains("known only when")
            ),
            "{auto:#?}"
        );
        let off = plan("SET fulmen.gpu.mode = 'off'").await;
        assert_eq!(off, ["fulmen.gpu.mode is off: every stage runs on the CPU"]);
    }

    #[test]
    fn scheduler_addresses_are_read_or_refused_clearly() {
        assert_eq!(
            scheduler_address("df://localhost:50050").unwrap(),
            "localhost:50050"
        );
        assert_eq!(
            scheduler_address("df://10.0.0.1").unwrap(),
            "10.0.0.1:50050"
        );
        assert_eq!(scheduler_address("127.0.0.1:7").unwrap(), "127.0.0.1:7");
        assert_eq!(scheduler_address("df://[::1]:9/").unwrap(), "[::1]:9");
        assert_eq!(scheduler_address("df://[::1]").unwrap(), "[::1]:50050");
        for bad in [
            "http://h:1",
            "df://h:port",
            "df://",
            "df://h:1/x",
            "df://:1",
        ] {
            let e = scheduler_address(bad).unwrap_err().to_string();
            assert!(e.contains("is not a scheduler address"), "{bad}: {e}");
        }
    }

    #[tokio::test]
    async fn a_scheduler_that_does_not_answer_is_an_error_within_seconds() {
        // A port just closed: nothing listens there.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let start = std::time::Instant::now();
        let e = probe(&format!("127.0.0.1:{port}"))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("no Ballista scheduler answers"), "{e}");
        assert!(start.elapsed() <= PROBE_TIMEOUT + Duration::from_secs(1));
    }
}
