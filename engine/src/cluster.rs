//! The client's side of a Ballista cluster ([`FulmenContext::remote`]): the scheduler's
//! address, a check that it answers, and a check that a query reads only tables every
//! executor can read itself.
//!
//! [`FulmenContext::remote`]: crate::FulmenContext::remote

use std::time::Duration;

use datafusion::catalog::TableProvider;
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::datasource::listing::ListingTable;
use datafusion::datasource::{MemTable, ViewTable, source_as_provider};
use datafusion::error::{DataFusionError, Result};
use datafusion::logical_expr::LogicalPlan;

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
