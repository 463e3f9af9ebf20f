//! A Kafka producer that knows whether everything it sent arrived: sinks and dead-letter
//! topics commit source offsets only after [`Producer::flush`] says so.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use datafusion::error::{DataFusionError, Result};
use rdkafka::ClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::OwnedHeaders;
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer as _, ProducerContext};

/// Counts failed deliveries.
#[derive(Default)]
pub struct Deliveries {
    failed: AtomicU64,
    last_error: Mutex<Option<String>>,
}

impl ClientContext for Deliveries {}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _opaque: ()) {
        if let Err((e, _)) = result {
            self.failed.fetch_add(1, Ordering::Relaxed);
            *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
        }
    }
}

/// A producer whose `flush` fails when any message sent since the last flush was lost.
pub struct Producer {
    inner: BaseProducer<Deliveries>,
    failed_at_flush: u64,
}

impl Producer {
    /// A producer with `config` (idempotent, so retries do not duplicate); with
    /// `transactional_id`, a transactional one, initialised.
    pub fn new(mut config: rdkafka::ClientConfig, transactional_id: Option<&str>) -> Result<Self> {
        config.set("enable.idempotence", "true");
        if let Some(id) = transactional_id {
            config.set("transactional.id", id);
        }
        let inner: BaseProducer<Deliveries> = config
            .create_with_context(Deliveries::default())
            .map_err(kafka_error)?;
        if transactional_id.is_some() {
            inner
                .init_transactions(Duration::from_secs(30))
                .map_err(kafka_error)?;
        }
        Ok(Self {
            inner,
            failed_at_flush: 0,
        })
    }

    /// Queues one message, waiting while the local queue is full.
    pub fn send(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        value: &[u8],
        headers: Option<OwnedHeaders>,
    ) -> Result<()> {
        let mut record = BaseRecord::<[u8], [u8]>::to(topic).payload(value);
        if let Some(key) = key {
            record = record.key(key);
        }
        if let Some(headers) = headers {
            record = record.headers(headers);
        }
        loop {
            match self.inner.send(record) {
                Ok(()) => return Ok(()),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    self.inner.poll(Duration::from_millis(10));
                }
                Err((e, _)) => return Err(kafka_error(e)),
            }
        }
    }

    /// Waits until every queued message is delivered (or `timeout` passes); an error when
    /// any message since the last flush failed.
    pub fn flush(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        // rust-rdkafka's `flush` waits in `poll`s of 100 ms, and its `poll` returns only when
        // its timeout has run out, however soon the deliveries arrive: every flush with a
        // message in flight took at least 100 ms, and so did every sink tick that wrote. A
        // flush without waiting sends what lingers at once; short polls then serve the
        // delivery reports as they come.
        let _ = self.inner.flush(Duration::ZERO);
        while self.inner.in_flight_count() > 0 && Instant::now() < deadline {
            self.inner.poll(Duration::from_millis(1));
        }
        if self.inner.in_flight_count() > 0 {
            // Out of time: the error librdkafka gives for it.
            self.inner.flush(Duration::ZERO).map_err(kafka_error)?;
        }
        let context = self.inner.context();
        let failed = context.failed.load(Ordering::Relaxed);
        if failed > self.failed_at_flush {
            let lost = failed - self.failed_at_flush;
            self.failed_at_flush = failed;
            let last = context
                .last_error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
                .unwrap_or_default();
            return Err(DataFusionError::External(
                format!("{lost} message(s) were not delivered: {last}").into(),
            ));
        }
        Ok(())
    }

    /// The producer underneath (for transactions).
    pub fn inner(&self) -> &BaseProducer<Deliveries> {
        &self.inner
    }
}

/// A Kafka error as a DataFusion error.
pub fn kafka_error(e: KafkaError) -> DataFusionError {
    DataFusionError::External(Box::new(e))
}

#[cfg(test)]
mod tests {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::mocking::MockCluster;
    use rdkafka::producer::DefaultProducerContext;

    use super::*;

    #[test]
    fn a_flush_returns_once_everything_sent_is_delivered() {
        let cluster = MockCluster::<DefaultProducerContext>::new(1).unwrap();
        cluster.create_topic("flushed", 1, 1).unwrap();
        let mut config = rdkafka::ClientConfig::new();
        config.set("bootstrap.servers", cluster.bootstrap_servers());
        let mut producer = Producer::new(config.clone(), None).unwrap();
        for i in 0..3 {
            producer
                .send("flushed", None, format!("m{i}").as_bytes(), None)
                .unwrap();
        }
        producer.flush(Duration::from_secs(30)).unwrap();
        assert_eq!(producer.inner().in_flight_count(), 0);
        // All three are on the topic.
        let consumer: BaseConsumer = config.set("group.id", "flush-test").create().unwrap();
        let (low, high) = consumer
            .fetch_watermarks("flushed", 0, Duration::from_secs(10))
            .unwrap();
        assert_eq!(high - low, 3);
    }

    #[test]
    fn a_flush_says_when_messages_were_lost() {
        // Nothing listens there: the message times out undelivered.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        drop(listener);
        let mut config = rdkafka::ClientConfig::new();
        config
            .set("bootstrap.servers", address.to_string())
            .set("message.timeout.ms", "300")
            .set("log_level", "0");
        let mut producer = Producer::new(config, None).unwrap();
        producer.send("nowhere", None, b"lost", None).unwrap();
        let err = producer.flush(Duration::from_secs(30)).unwrap_err();
        assert!(
            err.to_string().contains("1 message(s) were not delivered"),
            "{err}"
        );
        // Out of time before the delivery fails: librdkafka's time-out.
        producer.send("nowhere", None, b"late", None).unwrap();
        let err = producer.flush(Duration::from_millis(20)).unwrap_err();
        assert!(
            err.to_string().to_lowercase().contains("timed out"),
            "{err}"
        );
    }
}
