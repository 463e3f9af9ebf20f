//! Card transactions for the fraud-detection example, with fraud planted at known points,
//! and the alerts the example's three rules must raise on them.
//!
//! The rules (the same as `examples/fraud/pipeline.sql`):
//! - **velocity**: more than [`VELOCITY_LIMIT`] transactions of one card in a 1-minute
//!   tumbling window;
//! - **spend**: a card's spend in a 10-minute window sliding every minute above
//!   [`SPEND_FACTOR`] × its customer's average spend (from the profile table);
//! - **countries**: more than 2 countries for one card in a 1-hour tumbling window.
//!
//! [`expected_alerts`] applies the rules to the generated transactions directly (not through
//! SQL), so it is an independent oracle for the pipeline; [`Generated::planted`] lists the
//! alerts the planted patterns were built to raise, and the generator checks that ordinary
//! traffic raises none.

use std::collections::{BTreeMap, BTreeSet};

/// Transactions of one card in one minute above which the velocity rule fires.
pub const VELOCITY_LIMIT: usize = 5;
/// Spend in ten minutes above this many times the average fires the spend rule.
pub const SPEND_FACTOR: f64 = 10.0;
/// Countries of one card in one hour above which the countries rule fires.
pub const COUNTRY_LIMIT: usize = 2;

const MINUTE: i64 = 60_000;
const HOUR: i64 = 60 * MINUTE;
/// The generated stream starts here: 2026-01-01T00:00:00Z, in milliseconds.
pub const START_MS: i64 = 1_767_225_600_000;

/// The pipeline's watermark delay ('watermark' '5 seconds' in pipeline.sql): a window
/// closes once an event this far past its end has arrived.
pub const WATERMARK_MS: i64 = 5_000;

const COUNTRIES: &[&str] = &["US", "GB", "DE", "FR", "ES", "IT", "NL", "SE", "BR", "JP"];

/// One card transaction.
#[derive(Debug, Clone, PartialEq)]
pub struct Transaction {
    /// Card number (as text).
    pub card: String,
    /// The card holder.
    pub customer: String,
    /// Amount spent.
    pub amount: f64,
    /// Two-letter country code.
    pub country: String,
    /// Event time, milliseconds since the epoch.
    pub ts_ms: i64,
}

impl Transaction {
    /// The message value: one JSON object.
    pub fn to_json(&self) -> String {
        serde_json::json!({
            "card": self.card,
            "customer": self.customer,
            "amount": self.amount,
            "country": self.country,
            "ts": rfc3339(self.ts_ms),
        })
        .to_string()
    }
}

/// A customer's profile.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// The customer.
    pub customer: String,
    /// Average spend per transaction.
    pub avg_spend: f64,
    /// Home country.
    pub country: String,
}

/// An alert: rule, card and window start (milliseconds since the epoch).
pub type Alert = (String, String, i64);

/// A generated stream.
#[derive(Debug, Clone)]
pub struct Generated {
    /// Every transaction, in event-time order (up to a few seconds out of order).
    pub transactions: Vec<Transaction>,
    /// Customer profiles (one card per customer).
    pub profiles: Vec<Profile>,
    /// The alerts the planted fraud raises.
    pub planted: BTreeSet<Alert>,
}

/// Options of the generator.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Seed of the pseudo-random choices.
    pub seed: u64,
    /// Number of cards (and customers).
    pub cards: usize,
    /// Minutes of event time to generate.
    pub minutes: i64,
    /// Planted cases of each rule.
    pub frauds: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            seed: 42,
            cards: 200,
            minutes: 120,
            frauds: 3,
        }
    }
}

/// A small deterministic generator (a linear congruential one), seeded by its value.
pub struct Rng(pub u64);

impl Rng {
    /// The next number below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n.max(1)
    }
}

/// Generates transactions and profiles with `options.frauds` planted cases of each rule.
pub fn generate(options: Options) -> Generated {
    let mut rng = Rng(options.seed);
    let profiles: Vec<Profile> = (0..options.cards)
        .map(|i| Profile {
            customer: format!("cust-{i:05}"),
            avg_spend: 20.0 + rng.below(180) as f64,
            country: COUNTRIES[rng.below(COUNTRIES.len() as u64) as usize].to_owned(),
        })
        .collect();
    let card = |i: usize| format!("4000-{i:06}");
    let end = START_MS + options.minutes * MINUTE;
    let mut transactions = Vec::new();
    // Ordinary traffic: a transaction every 4–15 minutes per card, at most twice the average.
    for (i, profile) in profiles.iter().enumerate() {
        let mut t = START_MS + rng.below(15 * MINUTE as u64) as i64;
        while t < end {
            let amount = (profile.avg_spend * (0.2 + rng.below(180) as f64 / 100.0)).round();
            transactions.push(Transaction {
                card: card(i),
                customer: profile.customer.clone(),
                amount,
                country: profile.country.clone(),
                ts_ms: t,
            });
            t += 4 * MINUTE + rng.below(11 * MINUTE as u64) as i64;
        }
    }
    // Planted fraud, each on its own card, away from the stream's edges.
    let mut planted_cards = Vec::new();
    for f in 0..options.frauds * 3 {
        let i = (f * 7 + 3) % options.cards;
        let profile = &profiles[i];
        let at = START_MS + (10 + (f as i64 * 13) % (options.minutes - 30).max(1)) * MINUTE;
        let minute = at - at.rem_euclid(MINUTE);
        let base = Transaction {
            card: card(i),
            customer: profile.customer.clone(),
            amount: 1.0,
            country: profile.country.clone(),
            ts_ms: minute,
        };
        match f % 3 {
            // Velocity: 8 small purchases within one minute.
            0 => transactions.extend((0..8).map(|k| Transaction {
                ts_ms: minute + 5_000 + k * 6_000,
                amount: 2.0 + k as f64,
                ..base.clone()
            })),
            // Spend: three purchases of 5 × the average within two minutes.
            1 => transactions.extend((0..3).map(|k| Transaction {
                ts_ms: minute + 10_000 + k * 50_000,
                amount: (profile.avg_spend * 5.0).round(),
                ..base.clone()
            })),
            // Countries: three foreign countries within twenty minutes of one hour.
            _ => {
                let hour = at - at.rem_euclid(HOUR);
                let foreign: Vec<&str> = COUNTRIES
                    .iter()
                    .copied()
                    .filter(|c| *c != profile.country)
                    .collect();
                transactions.extend((0..3).map(|k| Transaction {
                    ts_ms: hour + 5 * MINUTE + k * 7 * MINUTE,
                    country: foreign[k as usize].to_owned(),
                    amount: 10.0,
                    ..base.clone()
                }))
            }
        }
        planted_cards.push(card(i));
    }
    transactions.sort_by_key(|t| t.ts_ms);
    let mut generated = Generated {
        transactions,
        profiles,
        planted: BTreeSet::new(),
    };
    let alerts = expected_alerts(&generated);
    // Ordinary traffic must raise nothing, so that every alert is one that was planted.
    let stray: Vec<&Alert> = alerts
        .iter()
        .filter(|(_, card, _)| !planted_cards.contains(card))
        .collect();
    assert!(
        stray.is_empty(),
        "ordinary traffic raised alerts: {stray:?}"
    );
    generated.planted = alerts;
    generated
}

/// The alerts the three rules raise on `generated`'s transactions.
pub fn expected_alerts(generated: &Generated) -> BTreeSet<Alert> {
    let average: BTreeMap<&str, f64> = generated
        .profiles
        .iter()
        .map(|p| (p.customer.as_str(), p.avg_spend))
        .collect();
    let mut velocity: BTreeMap<(&str, i64), usize> = BTreeMap::new();
    let mut spend: BTreeMap<(&str, i64), (f64, f64)> = BTreeMap::new();
    let mut countries: BTreeMap<(&str, i64), BTreeSet<&str>> = BTreeMap::new();
    for t in &generated.transactions {
        let minute = t.ts_ms - t.ts_ms.rem_euclid(MINUTE);
        *velocity.entry((&t.card, minute)).or_default() += 1;
        // The 10-minute windows sliding by a minute that hold t.
        for k in 0..10 {
            let start = minute - k * MINUTE;
            let entry = spend.entry((&t.card, start)).or_insert((0.0, 0.0));
            entry.0 += t.amount;
            entry.1 = average
                .get(t.customer.as_str())
                .copied()
                .unwrap_or(f64::INFINITY);
        }
        let hour = t.ts_ms - t.ts_ms.rem_euclid(HOUR);
        countries
            .entry((&t.card, hour))
            .or_default()
            .insert(&t.country);
    }
    let mut alerts = BTreeSet::new();
    for ((card, start), n) in velocity {
        if n > VELOCITY_LIMIT {
            alerts.insert(("velocity".to_owned(), card.to_owned(), start));
        }
    }
    for ((card, start), (sum, avg)) in spend {
        if sum > SPEND_FACTOR * avg {
            alerts.insert(("spend".to_owned(), card.to_owned(), start));
        }
    }
    for ((card, start), set) in countries {
        if set.len() > COUNTRY_LIMIT {
            alerts.insert(("countries".to_owned(), card.to_owned(), start));
        }
    }
    alerts
}

/// The profiles as CSV with a header (`customer,avg_spend,country`).
pub fn profiles_csv(profiles: &[Profile]) -> String {
    let mut out = String::from("customer,avg_spend,country\n");
    for p in profiles {
        out.push_str(&format!("{},{},{}\n", p.customer, p.avg_spend, p.country));
    }
    out
}

/// A transaction a day after `minutes` of generated traffic end: sent to every partition,
/// it moves the watermark past every window of the traffic, so that all of them close.
pub fn heartbeat(minutes: i64) -> Transaction {
    Transaction {
        card: "heartbeat".into(),
        customer: "none".into(),
        amount: 0.0,
        country: "--".into(),
        ts_ms: START_MS + minutes * MINUTE + 86_400_000,
    }
}

/// The statements of `pipeline.sql`, pointed at the brokers `servers` and the profiles CSV
/// at `profiles` (comment-only pieces left out).
pub fn pipeline_statements(servers: &str, profiles: &str) -> Vec<String> {
    include_str!("../pipeline.sql")
        .replace("localhost:9092", servers)
        .replace("fraud-profiles.csv", profiles)
        .split(";\n")
        .filter(|s| {
            s.lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with("--"))
        })
        .map(str::to_owned)
        .collect()
}

/// `ms` milliseconds after the epoch as RFC 3339 (UTC).
pub fn rfc3339(ms: i64) -> String {
    let days = ms.div_euclid(86_400_000);
    let in_day = ms.rem_euclid(86_400_000);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        in_day / 3_600_000,
        in_day / 60_000 % 60,
        in_day / 1000 % 60,
        in_day % 1000
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rule_is_planted_and_times_print_as_rfc3339() {
        let generated = generate(Options::default());
        for rule in ["velocity", "spend", "countries"] {
            assert!(
                generated.planted.iter().any(|(r, _, _)| r == rule),
                "{rule} not planted"
            );
        }
        assert_eq!(rfc3339(START_MS), "2026-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_000 + 1_234), "2000-02-29T00:00:01.234Z");
    }

    #[test]
    fn the_watermark_constant_is_the_pipelines() {
        let transactions = &pipeline_statements("b:1", "p.csv")[0];
        let delay = format!("'watermark' '{} seconds'", WATERMARK_MS / 1000);
        assert!(transactions.contains(&delay), "{transactions}");
    }
}
