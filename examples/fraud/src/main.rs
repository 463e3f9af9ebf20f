//! `fraud-generator`: writes card transactions with planted fraud to a Kafka topic and the
//! customer profiles to a CSV file; prints the alerts the pipeline should raise.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use fulmen_fraud::{Options, START_MS, Transaction, generate, profiles_csv, rfc3339};
use rdkafka::ClientConfig;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

/// Card transactions with planted fraud, for examples/fraud/pipeline.sql.
#[derive(Parser)]
struct Args {
    /// Kafka brokers.
    #[arg(long, default_value = "localhost:9092")]
    bootstrap_servers: String,
    /// Topic to write transactions to.
    #[arg(long, default_value = "transactions")]
    topic: String,
    /// Where to write the customer profiles.
    #[arg(long, default_value = "fraud-profiles.csv")]
    profiles: String,
    /// Transactions per second (0: as fast as possible).
    #[arg(long, default_value_t = 0)]
    rate: u64,
    /// Cards (one per customer).
    #[arg(long, default_value_t = 200)]
    cards: usize,
    /// Minutes of event time.
    #[arg(long, default_value_t = 120)]
    minutes: i64,
    /// Planted cases of each rule.
    #[arg(long, default_value_t = 3)]
    frauds: usize,
    /// Seed of the random choices.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let generated = generate(Options {
        seed: args.seed,
        cards: args.cards,
        minutes: args.minutes,
        frauds: args.frauds,
    });
    std::fs::write(&args.profiles, profiles_csv(&generated.profiles))
        .with_context(|| format!("writing {}", args.profiles))?;
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", &args.bootstrap_servers)
        .set("linger.ms", "10")
        .create()?;
    let started = Instant::now();
    let all = &generated.transactions;
    for (n, t) in all.iter().enumerate() {
        if args.rate > 0 {
            let due = Duration::from_secs_f64(n as f64 / args.rate as f64);
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                std::thread::sleep(wait);
            }
        }
        let value = t.to_json();
        let mut record = BaseRecord::to(&args.topic).key(&t.card).payload(&value);
        loop {
            match producer.send(record) {
                Ok(()) => break,
                Err((_, back)) => {
                    record = back;
                    producer.poll(Duration::from_millis(10));
                }
            }
        }
    }
    // One transaction far after the rest in every partition, so that the last windows close.
    let metadata = producer
        .client()
        .fetch_metadata(Some(&args.topic), Duration::from_secs(10))?;
    let heartbeat = Transaction {
        card: "heartbeat".into(),
        customer: "none".into(),
        amount: 0.0,
        country: "--".into(),
        ts_ms: START_MS + (args.minutes + 24 * 60) * 60_000,
    }
    .to_json();
    for partition in metadata.topics().iter().flat_map(|t| t.partitions()) {
        let record = BaseRecord::<(), String>::to(&args.topic)
            .partition(partition.id())
            .payload(&heartbeat);
        producer.send(record).map_err(|(e, _)| e)?;
    }
    producer.flush(Duration::from_secs(60))?;
    eprintln!(
        "wrote {} transactions to '{}' in {:.1} s and {} profiles to {}; expected alerts:",
        all.len(),
        args.topic,
        started.elapsed().as_secs_f64(),
        generated.profiles.len(),
        args.profiles
    );
    for (rule, card, start) in &generated.planted {
        println!("{rule:9} {card} {}", rfc3339(*start));
    }
    Ok(())
}
