//! The options of `CREATE EXTERNAL TABLE … STORED AS KAFKA … OPTIONS (…)`.
//!
//! DataFusion hands a table factory its options with keys lower-cased and a `format.`
//! prefix added to every key without a dot; both are undone here. Keys starting with
//! `kafka.` go to librdkafka unchanged (without the prefix); every other key must be one of
//! [`KNOWN`], and a misspelled one is named together with its nearest match.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use datafusion::arrow::compute::kernels::cast_utils::parse_interval_month_day_nano;
use datafusion::error::{DataFusionError, Result};
use fulmen_engine::error::did_you_mean;
use rdkafka::config::RDKafkaLogLevel;

use crate::avro::{AvroSpec, Framing};

/// Every option a Kafka table takes, besides `kafka.*`.
pub const KNOWN: &[&str] = &[
    "bootstrap.servers",
    "format",
    "start",
    "group.id",
    "event_time",
    "watermark",
    "idle_timeout",
    "retention",
    "dead_letter",
    "delivery",
    "csv.delimiter",
    "avro.schema",
    "avro.framing",
    "avro.schema_id",
];

/// How a message's value is read into (and written from) a row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Format {
    /// One JSON object per message; fields matched to columns by name.
    Json,
    /// One CSV record per message, columns in declared order, no header.
    Csv {
        /// The field separator.
        delimiter: u8,
    },
    /// The whole value as the table's one column (text or bytes).
    Raw,
    /// One Avro record per message; fields matched to columns by name.
    Avro(Arc<AvroSpec>),
}

/// Where ingestion starts when a table is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// The oldest message the topic still holds.
    Earliest,
    /// Only messages produced after the table was created.
    Latest,
    /// The offsets last committed by `group.id` (the oldest message where none were).
    Committed,
}

/// What a sink promises about its output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// Every result is written at least once; a restart may write some again.
    AtLeastOnce,
    /// Results and source offsets are committed in one Kafka transaction.
    ExactlyOnce,
}

/// How much of a live table is kept for queries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Retention {
    /// Keep at most this many rows (the newest).
    pub rows: Option<usize>,
    /// Drop rows that arrived longer ago than this.
    pub time: Option<Duration>,
}

/// A Kafka table's options, checked.
#[derive(Debug, Clone)]
pub struct KafkaOptions {
    /// The topic (the table's LOCATION).
    pub topic: String,
    /// `bootstrap.servers`.
    pub bootstrap_servers: String,
    /// `format` (default `json`).
    pub format: Format,
    /// `start` (default `latest`).
    pub start: Start,
    /// `group.id`: the consumer group whose offsets a sink reading this table commits.
    pub group_id: Option<String>,
    /// `event_time`: the timestamp column windows and watermarks use.
    pub event_time: Option<String>,
    /// `watermark`: how late (in event time) a row may arrive and still count.
    pub lateness: Duration,
    /// `idle_timeout`: a partition without messages for this long does not hold the
    /// watermark back (default 30 seconds; `none` to wait for every partition).
    pub idle_timeout: Option<Duration>,
    /// `retention`: e.g. `'1 hour'` or `'1000000 rows'` (default: keep everything).
    pub retention: Retention,
    /// `dead_letter`: a topic that receives undecodable and late messages.
    pub dead_letter: Option<String>,
    /// `delivery` of a sink writing to this table (default `at_least_once`).
    pub delivery: Delivery,
    /// `kafka.*` options, passed to librdkafka without the prefix.
    pub client: Vec<(String, String)>,
}

impl KafkaOptions {
    /// Checks a table's options; `topic` is its LOCATION.
    pub fn parse(topic: &str, options: &HashMap<String, String>) -> Result<Self> {
        if topic.is_empty() {
            return Err(config(
                "a Kafka table's LOCATION is its topic, and it is empty",
            ));
        }
        let mut parsed = Self {
            topic: topic.to_owned(),
            bootstrap_servers: String::new(),
            format: Format::Json,
            start: Start::Latest,
            group_id: None,
            event_time: None,
            lateness: Duration::ZERO,
            idle_timeout: Some(Duration::from_secs(30)),
            retention: Retention::default(),
            dead_letter: None,
            delivery: Delivery::AtLeastOnce,
            client: Vec::new(),
        };
        let mut delimiter = b',';
        let (mut avro_schema, mut framing, mut schema_id) = (None, None, None);
        let mut entries: Vec<(&String, &String)> = options.iter().collect();
        entries.sort();
        for (raw_key, value) in entries {
            let key = raw_key.strip_prefix("format.").unwrap_or(raw_key);
            if let Some(client_key) = key.strip_prefix("kafka.") {
                parsed.client.push((client_key.to_owned(), value.clone()));
                continue;
            }
            match key {
                "bootstrap.servers" => parsed.bootstrap_servers = value.clone(),
                "format" => {
                    parsed.format = match value.to_ascii_lowercase().as_str() {
                        "json" => Format::Json,
                        "csv" => Format::Csv { delimiter: b',' },
                        "raw" => Format::Raw,
                        "avro" => Format::Avro(Arc::new(AvroSpec {
                            schema: None,
                            framing: Framing::Bare,
                        })),
                        other => {
                            return Err(config(format!(
                                "unknown format '{other}' (one of 'json', 'csv', 'avro', 'raw')"
                            )));
                        }
                    }
                }
                "start" => {
                    parsed.start = match value.to_ascii_lowercase().as_str() {
                        "earliest" => Start::Earliest,
                        "latest" => Start::Latest,
                        "committed" => Start::Committed,
                        other => {
                            return Err(config(format!(
                                "unknown start '{other}' (one of 'earliest', 'latest', 'committed')"
                            )));
                        }
                    }
                }
                "group.id" => parsed.group_id = Some(value.clone()),
                "event_time" => parsed.event_time = Some(value.clone()),
                "watermark" => parsed.lateness = parse_duration(key, value)?,
                "idle_timeout" => {
                    parsed.idle_timeout = if value.eq_ignore_ascii_case("none") {
                        None
                    } else {
                        Some(parse_duration(key, value)?)
                    }
                }
                "retention" => parsed.retention = parse_retention(value)?,
                "dead_letter" => parsed.dead_letter = Some(value.clone()),
                "delivery" => {
                    parsed.delivery = match value.to_ascii_lowercase().as_str() {
                        "at_least_once" => Delivery::AtLeastOnce,
                        "exactly_once" => Delivery::ExactlyOnce,
                        other => {
                            return Err(config(format!(
                                "unknown delivery '{other}' (one of 'at_least_once', \
                                 'exactly_once')"
                            )));
                        }
                    }
                }
                "csv.delimiter" => match value.as_bytes() {
                    [b] => delimiter = *b,
                    _ => return Err(config("option 'csv.delimiter' takes one character")),
                },
                "avro.schema" => avro_schema = Some(value.clone()),
                "avro.framing" => framing = Some(value.trim().to_ascii_lowercase()),
                "avro.schema_id" => {
                    schema_id = Some(value.trim().parse::<u32>().map_err(|_| {
                        config(format!(
                            "option 'avro.schema_id': '{value}' is not a schema registry id \
                             (a number from 0 to 4294967295)"
                        ))
                    })?)
                }
                _ => return Err(unknown_option(key)),
            }
        }
        if parsed.bootstrap_servers.is_empty() {
            return Err(config(
                "a Kafka table needs the option 'bootstrap.servers' (e.g. 'localhost:9092')",
            ));
        }
        if let Format::Csv { .. } = parsed.format {
            parsed.format = Format::Csv { delimiter };
        }
        if let Format::Avro(_) = parsed.format {
            let framing = match (framing.as_deref(), schema_id) {
                (None | Some("confluent"), Some(id)) => Framing::Confluent(id),
                (None | Some("confluent"), None) => {
                    return Err(config(
                        "format 'avro' reads Confluent-framed messages (a zero byte and a \
                         schema id before each record) by default: give the writer schema's \
                         registry id with 'avro.schema_id', or choose 'avro.framing' \
                         'single_object' or 'bare'",
                    ));
                }
                (Some("single_object" | "bare"), Some(_)) => {
                    return Err(config(
                        "option 'avro.schema_id' goes with 'avro.framing' 'confluent' only",
                    ));
                }
                (Some("single_object"), None) => Framing::SingleObject,
                (Some("bare"), None) => Framing::Bare,
                (Some(other), _) => {
                    return Err(config(format!(
                        "unknown avro.framing '{other}' (one of 'confluent', 'single_object', \
                         'bare')"
                    )));
                }
            };
            parsed.format = Format::Avro(Arc::new(AvroSpec {
                schema: avro_schema,
                framing,
            }));
        } else if let Some(key) = [
            avro_schema.as_ref().map(|_| "avro.schema"),
            framing.as_ref().map(|_| "avro.framing"),
            schema_id.as_ref().map(|_| "avro.schema_id"),
        ]
        .into_iter()
        .flatten()
        .next()
        {
            return Err(config(format!(
                "option '{key}' applies to format 'avro' only"
            )));
        }
        if parsed.start == Start::Committed && parsed.group_id.is_none() {
            return Err(config("start 'committed' needs the option 'group.id'"));
        }
        Ok(parsed)
    }

    /// The options librdkafka gets: the servers, then every `kafka.*` option.
    pub fn client_config(&self) -> rdkafka::ClientConfig {
        let mut config = rdkafka::ClientConfig::new();
        // librdkafka's own messages reach the `log` crate (rdkafka's default client context
        // forwards them); asking for no more than the process logs saves formatting them.
        config.set_log_level(match log::max_level() {
            log::LevelFilter::Off | log::LevelFilter::Error => RDKafkaLogLevel::Error,
            log::LevelFilter::Warn => RDKafkaLogLevel::Warning,
            log::LevelFilter::Info => RDKafkaLogLevel::Info,
            log::LevelFilter::Debug | log::LevelFilter::Trace => RDKafkaLogLevel::Debug,
        });
        config.set("bootstrap.servers", &self.bootstrap_servers);
        for (key, value) in &self.client {
            config.set(key, value);
        }
        config
    }
}

fn config(message: impl Into<String>) -> DataFusionError {
    DataFusionError::Configuration(message.into())
}

fn unknown_option(key: &str) -> DataFusionError {
    let hint = did_you_mean(key, KNOWN.iter().copied(), "");
    config(format!(
        "unknown Kafka option '{key}'{hint}; librdkafka options take the prefix 'kafka.'"
    ))
}

/// `'5 seconds'`, `'1 minute'`, `'250 milliseconds'`, `'0'`.
pub fn parse_duration(key: &str, value: &str) -> Result<Duration> {
    if value.trim() == "0" {
        return Ok(Duration::ZERO);
    }
    let interval = parse_interval_month_day_nano(value).map_err(|_| {
        config(format!(
            "option '{key}': '{value}' is not a duration such as '5 seconds' or '1 minute'"
        ))
    })?;
    let nanos = i128::from(interval.days) * 86_400_000_000_000 + i128::from(interval.nanoseconds);
    if interval.months != 0 || nanos < 0 {
        return Err(config(format!(
            "option '{key}': '{value}' must be a fixed, non-negative duration"
        )));
    }
    Ok(Duration::from_nanos(nanos as u64))
}

fn parse_retention(value: &str) -> Result<Retention> {
    let trimmed = value.trim().to_ascii_lowercase();
    if trimmed == "none" {
        return Ok(Retention::default());
    }
    if let Some(count) = trimmed
        .strip_suffix("rows")
        .or_else(|| trimmed.strip_suffix("row"))
    {
        let rows = count
            .trim()
            .replace('_', "")
            .parse::<usize>()
            .map_err(|_| {
                config(format!(
                    "option 'retention': '{value}' is not a row count such as '1000 rows'"
                ))
            })?;
        return Ok(Retention {
            rows: Some(rows),
            time: None,
        });
    }
    Ok(Retention {
        rows: None,
        time: Some(parse_duration("retention", value)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn options_are_checked_and_misspellings_named() {
        let parsed = KafkaOptions::parse(
            "tx",
            &options(&[
                ("bootstrap.servers", "b:9092"),
                ("format.format", "csv"),
                ("format.start", "earliest"),
                ("format.watermark", "5 seconds"),
                ("format.retention", "1000 rows"),
                ("format.idle_timeout", "none"),
                ("csv.delimiter", ";"),
                ("kafka.session.timeout.ms", "6000"),
            ]),
        )
        .unwrap();
        assert_eq!(parsed.format, Format::Csv { delimiter: b';' });
        assert_eq!(parsed.start, Start::Earliest);
        assert_eq!(parsed.lateness, Duration::from_secs(5));
        assert_eq!(parsed.retention.rows, Some(1000));
        assert_eq!(parsed.idle_timeout, None);
        assert_eq!(
            parsed.client,
            vec![("session.timeout.ms".into(), "6000".into())]
        );

        let e = KafkaOptions::parse(
            "tx",
            &options(&[("bootstrap.servers", "b"), ("grup.id", "g")]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("unknown Kafka option 'grup.id' (did you mean 'group.id'?)"),
            "{e}"
        );
        let e = KafkaOptions::parse("tx", &options(&[("format.format", "json")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("'bootstrap.servers'"), "{e}");
        let e = KafkaOptions::parse(
            "tx",
            &options(&[("bootstrap.servers", "b"), ("format.watermark", "soon")]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("'soon' is not a duration"), "{e}");
        let e = KafkaOptions::parse(
            "tx",
            &options(&[("bootstrap.servers", "b"), ("format.start", "committed")]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("needs the option 'group.id'"), "{e}");

        let avro = |pairs: &[(&str, &str)]| {
            let mut all = vec![("bootstrap.servers", "b"), ("format.format", "avro")];
            all.extend_from_slice(pairs);
            KafkaOptions::parse("tx", &options(&all))
        };
        let framing = |parsed: KafkaOptions| match parsed.format {
            Format::Avro(spec) => spec.framing,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            framing(avro(&[("avro.schema_id", "12")]).unwrap()),
            Framing::Confluent(12)
        );
        assert_eq!(
            framing(avro(&[("avro.framing", "single_object")]).unwrap()),
            Framing::SingleObject
        );
        assert_eq!(
            framing(avro(&[("avro.framing", "BARE")]).unwrap()),
            Framing::Bare
        );
        for (pairs, expected) in [
            (&[][..], "give the writer schema's registry id"),
            (
                &[("avro.schema_id", "-1")][..],
                "'-1' is not a schema registry id",
            ),
            (
                &[("avro.framing", "bare"), ("avro.schema_id", "3")][..],
                "goes with 'avro.framing' 'confluent' only",
            ),
            (&[("avro.framing", "soe")][..], "unknown avro.framing 'soe'"),
            (&[("avro.shema", "{}")][..], "(did you mean 'avro.schema'?)"),
        ] {
            let e = avro(pairs).unwrap_err().to_string();
            assert!(e.contains(expected), "{pairs:?}: {e}");
        }
        let e = KafkaOptions::parse(
            "tx",
            &options(&[("bootstrap.servers", "b"), ("avro.schema_id", "1")]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("applies to format 'avro' only"), "{e}");
    }
}
