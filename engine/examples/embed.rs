//! Embedding Fulmen in a program: a session, sample data, a query, a setting.
//!
//! Run with `cargo run -p fulmen-engine --example embed`.

use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::error::Result;
use fulmen_engine::FulmenContext;

#[tokio::main]
async fn main() -> Result<()> {
    let ctx = FulmenContext::new()?;

    // Built-in sample data: the eight TPC-H tables, generated in memory.
    ctx.register_tpch(0.01)?;

    // Settings are ordinary SQL.
    ctx.sql("SET fulmen.gpu.mode = 'auto'").await?;

    let revenue = ctx
        .sql(
            "SELECT n_name, count(*) AS orders, round(sum(o_totalprice), 2) AS revenue \
             FROM orders JOIN customer ON o_custkey = c_custkey \
             JOIN nation ON c_nationkey = n_nationkey \
             GROUP BY n_name ORDER BY revenue DESC LIMIT 5",
        )
        .await?
        .collect()
        .await?;
    println!("{}", pretty_format_batches(&revenue)?);

    // Results are Arrow record batches; DataFrames work as in DataFusion.
    let rows: usize = revenue.iter().map(|b| b.num_rows()).sum();
    assert_eq!(rows, 5, "five nations");
    Ok(())
}
