//! [`ConnectionPool`]: an executor's connections to the other executors' Flight services,
//! kept for reuse between shuffle fetches, as Ballista's own executor does (opening one
//! per fetch can run a busy host out of ephemeral ports).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ballista_core::client::BallistaClient;
use ballista_core::client_pool::{BallistaClientPool, PooledClient};
use ballista_core::error::Result;
use ballista_core::extension::BallistaConfigGrpcEndpoint;
use ballista_core::utils::GrpcClientConfig;

type Key = (String, u16, GrpcClientConfig);

/// Idle connections, each with the time it was given back.
type Idle = HashMap<Key, Vec<(Instant, BallistaClient)>>;

/// Idle connections per (host, port, client settings); one idle longer than the TTL is
/// dropped the next time the pool is used.
#[derive(Clone)]
pub struct ConnectionPool {
    idle: Arc<Mutex<Idle>>,
    ttl: Duration,
}

impl ConnectionPool {
    /// A pool keeping idle connections for `ttl`.
    pub fn new(ttl: Duration) -> Self {
        Self {
            idle: Arc::default(),
            ttl,
        }
    }

    /// Drops the connections idle longer than the TTL.
    fn evict(&self, idle: &mut Idle) {
        let now = Instant::now();
        idle.retain(|_, clients| {
            clients.retain(|(since, _)| now.duration_since(*since) < self.ttl);
            !clients.is_empty()
        });
    }

    fn take(&self, key: &Key) -> Option<BallistaClient> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        self.evict(&mut idle);
        idle.get_mut(key)
            .and_then(Vec::pop)
            .map(|(_, client)| client)
    }
}

impl std::fmt::Debug for ConnectionPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionPool")
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

#[async_trait::async_trait]
impl BallistaClientPool for ConnectionPool {
    async fn acquire(
        &self,
        host: &str,
        port: u16,
        config: &GrpcClientConfig,
        customize_endpoint: Option<Arc<BallistaConfigGrpcEndpoint>>,
    ) -> Result<PooledClient> {
        let key = (host.to_string(), port, config.clone());
        let client = match self.take(&key) {
            Some(client) => client,
            None => {
                BallistaClient::try_new(
                    host,
                    port,
                    config.max_message_size,
                    config.use_tls,
                    customize_endpoint,
                    config.io_retries_times,
                    config.io_retry_wait_time_ms,
                    config.initial_connection_window_size,
                    config.initial_stream_window_size,
                )
                .await?
            }
        };
        let idle = Arc::clone(&self.idle);
        Ok(PooledClient::new(
            client,
            Box::new(move |client| {
                idle.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(key)
                    .or_default()
                    .push((Instant::now(), client));
            }),
        ))
    }

    async fn evict_idle(&self) {
        self.evict(&mut self.idle.lock().unwrap_or_else(|p| p.into_inner()));
    }
}
