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
        self.inner.flush(timeout).map_err(kafka_error)?;
        while self.inner.in_flight_count() > 0 && Instant::now() < deadline {
            self.inner.poll(Duration::from_millis(10));
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
