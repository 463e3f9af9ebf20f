//! Object stores for remote table locations: `s3://`, `gs://`, `az://` (and `abfs[s]://`,
//! `azure://`), `http(s)://`.
//!
//! Two ways in, as in datafusion-cli:
//! - **the environment**: the first time a query touches a bucket or host, a store is built
//!   from the standard variables (`AWS_*`, `GOOGLE_*`, `AZURE_*`) and kept for the session;
//! - **`CREATE EXTERNAL TABLE … OPTIONS`**: keys with the scheme's prefix (`aws.`, `gcp.`,
//!   `azure.`, `http.`) configure the store for that table's location, on top of the
//!   environment, e.g. `'aws.region' 'eu-west-1'`. They are taken out of the options before
//!   DataFusion sees the rest (its `format.*` options).

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::Arc;

use datafusion::error::{DataFusionError, Result};

use crate::error::did_you_mean;
use datafusion::execution::object_store::{DefaultObjectStoreRegistry, ObjectStoreRegistry};
use object_store::ClientConfigKey;
use object_store::ObjectStore;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::http::HttpBuilder;
use url::Url;

/// The kinds of remote store Fulmen can reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    /// Amazon S3 and S3-compatible stores.
    S3,
    /// Google Cloud Storage.
    Gcs,
    /// Azure Blob Storage / ADLS Gen2.
    Azure,
    /// Plain HTTP(S) servers.
    Http,
}

impl StoreKind {
    /// The kind of store a URL scheme names, or `None` for local and unknown schemes.
    pub fn for_scheme(scheme: &str) -> Option<Self> {
        match scheme {
            "s3" | "s3a" => Some(Self::S3),
            "gs" | "gcs" => Some(Self::Gcs),
            "az" | "azure" | "abfs" | "abfss" | "adl" => Some(Self::Azure),
            "http" | "https" => Some(Self::Http),
            _ => None,
        }
    }

    /// The prefix of this kind's keys in `CREATE EXTERNAL TABLE … OPTIONS`.
    pub fn option_prefix(self) -> &'static str {
        match self {
            Self::S3 => "aws",
            Self::Gcs => "gcp",
            Self::Azure => "azure",
            Self::Http => "http",
        }
    }

    /// Keys users most often mean, for "did you mean" hints.
    fn common_keys(self) -> &'static [&'static str] {
        match self {
            Self::S3 => &[
                "access_key_id",
                "secret_access_key",
                "session_token",
                "region",
                "endpoint",
                "allow_http",
                "skip_signature",
                "virtual_hosted_style_request",
            ],
            Self::Gcs => &[
                "service_account",
                "service_account_key",
                "application_credentials",
                "skip_signature",
            ],
            Self::Azure => &[
                "account_name",
                "account_key",
                "sas_token",
                "client_id",
                "client_secret",
                "tenant_id",
                "endpoint",
                "use_emulator",
                "skip_signature",
            ],
            Self::Http => &[
                "allow_http",
                "allow_invalid_certificates",
                "timeout",
                "connect_timeout",
            ],
        }
    }
}

/// Every option prefix that configures an object store.
const PREFIXES: &[&str] = &["aws", "gcp", "azure", "http"];

/// Splits the object-store keys (`aws.…`, `gcp.…`, `azure.…`, `http.…`) out of a table's
/// options, leaving the rest for DataFusion.
pub fn take_store_options(options: &mut HashMap<String, String>) -> Vec<(String, String)> {
    let keys: Vec<String> = options
        .keys()
        .filter(|k| {
            k.split_once('.')
                .is_some_and(|(prefix, _)| PREFIXES.contains(&prefix.to_ascii_lowercase().as_str()))
        })
        .cloned()
        .collect();
    let mut taken: Vec<(String, String)> = keys
        .into_iter()
        .filter_map(|k| options.remove_entry(&k))
        .collect();
    taken.sort();
    taken
}

fn unknown_option(kind: StoreKind, key: &str, full: &str) -> DataFusionError {
    let prefix = format!("{}.", kind.option_prefix());
    let hint = did_you_mean(key, kind.common_keys().iter().copied(), &prefix);
    DataFusionError::Configuration(format!("unknown object store option '{full}'{hint}"))
}

/// Builds the store that serves `url`, from the environment plus `options` (keys with the
/// scheme's prefix, e.g. `aws.region`). Building touches no network.
pub fn build_store(url: &Url, options: &[(String, String)]) -> Result<Arc<dyn ObjectStore>> {
    let Some(kind) = StoreKind::for_scheme(url.scheme()) else {
        return Err(DataFusionError::Configuration(format!(
            "no object store for '{}://' locations (Fulmen reads file paths, s3://, gs://, \
             az://, abfs[s]://, http:// and https://)",
            url.scheme()
        )));
    };
    // (key without prefix, full key, value)
    let mut keyed = Vec::with_capacity(options.len());
    for (full, value) in options {
        let (prefix, key) = full.split_once('.').unwrap_or((full.as_str(), ""));
        if !prefix.eq_ignore_ascii_case(kind.option_prefix()) {
            return Err(DataFusionError::Configuration(format!(
                "option '{full}' does not apply to {}:// locations (their options start with \
                 '{}.')",
                url.scheme(),
                kind.option_prefix()
            )));
        }
        keyed.push((key.to_ascii_lowercase(), full.as_str(), value.as_str()));
    }
    let built = |e: object_store::Error| {
        DataFusionError::Configuration(format!("cannot set up the store for '{url}': {e}"))
    };
    let store: Arc<dyn ObjectStore> = match kind {
        StoreKind::S3 => {
            let mut b = AmazonS3Builder::from_env().with_url(url.as_str());
            for (key, full, value) in keyed {
                let key = match key.as_str() {
                    // datafusion-cli's spellings, kept so its scripts work here.
                    "skip_signature" | "nosign" => AmazonS3ConfigKey::SkipSignature,
                    k => {
                        AmazonS3ConfigKey::from_str(k).map_err(|_| unknown_option(kind, k, full))?
                    }
                };
                b = b.with_config(key, value);
            }
            Arc::new(b.build().map_err(built)?)
        }
        StoreKind::Gcs => {
            let mut b = GoogleCloudStorageBuilder::from_env().with_url(url.as_str());
            for (key, full, value) in keyed {
                let k = GoogleConfigKey::from_str(&key)
                    .map_err(|_| unknown_option(kind, &key, full))?;
                b = b.with_config(k, value);
            }
            Arc::new(b.build().map_err(built)?)
        }
        StoreKind::Azure => {
            let mut b = MicrosoftAzureBuilder::from_env().with_url(url.as_str());
            for (key, full, value) in keyed {
                let k =
                    AzureConfigKey::from_str(&key).map_err(|_| unknown_option(kind, &key, full))?;
                b = b.with_config(k, value);
            }
            Arc::new(b.build().map_err(built)?)
        }
        StoreKind::Http => {
            let mut b = HttpBuilder::new().with_url(url.origin().ascii_serialization());
            for (key, full, value) in keyed {
                let k = ClientConfigKey::from_str(&key)
                    .map_err(|_| unknown_option(kind, &key, full))?;
                b = b.with_config(k, value);
            }
            Arc::new(b.build().map_err(built)?)
        }
    };
    Ok(store)
}

/// DataFusion's registry of object stores, extended to build a store for a remote URL from
/// the environment the first time it is needed.
#[derive(Debug, Default)]
pub struct FulmenObjectStoreRegistry {
    inner: DefaultObjectStoreRegistry,
}

impl FulmenObjectStoreRegistry {
    /// A registry that knows the local file system and builds remote stores on demand.
    pub fn new() -> Self {
        Self::default()
    }
}

impl ObjectStoreRegistry for FulmenObjectStoreRegistry {
    fn register_store(
        &self,
        url: &Url,
        store: Arc<dyn ObjectStore>,
    ) -> Option<Arc<dyn ObjectStore>> {
        self.inner.register_store(url, store)
    }

    fn deregister_store(&self, url: &Url) -> Result<Arc<dyn ObjectStore>> {
        self.inner.deregister_store(url)
    }

    fn get_store(&self, url: &Url) -> Result<Arc<dyn ObjectStore>> {
        match self.inner.get_store(url) {
            Ok(store) => Ok(store),
            Err(e) if StoreKind::for_scheme(url.scheme()).is_none() => Err(e),
            Err(_) => {
                let store = build_store(url, &[])?;
                self.inner.register_store(url, Arc::clone(&store));
                Ok(store)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn store_options_are_taken_out_and_the_rest_left() {
        let mut options: HashMap<String, String> = [
            ("aws.region", "eu-west-1"),
            ("format.has_header", "true"),
            ("gcp.service_account", "/x.json"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let taken = take_store_options(&mut options);
        assert_eq!(
            taken,
            opts(&[
                ("aws.region", "eu-west-1"),
                ("gcp.service_account", "/x.json")
            ])
        );
        assert_eq!(options.len(), 1);
        assert!(options.contains_key("format.has_header"));
    }

    #[test]
    fn builds_each_kind_without_network() {
        let s3 = Url::parse("s3://bucket/path/t.parquet").unwrap();
        build_store(
            &s3,
            &opts(&[
                ("aws.region", "eu-west-1"),
                ("aws.access_key_id", "k"),
                ("aws.secret_access_key", "s"),
                ("aws.allow_http", "true"),
            ]),
        )
        .unwrap();
        let http = Url::parse("http://127.0.0.1:8080/data/t.csv").unwrap();
        build_store(&http, &opts(&[("http.allow_http", "true")])).unwrap();
        let az = Url::parse("az://container/t.parquet").unwrap();
        build_store(
            &az,
            &opts(&[
                ("azure.account_name", "acct"),
                ("azure.skip_signature", "true"),
            ]),
        )
        .unwrap();
    }

    #[test]
    fn misspelled_or_misplaced_options_are_named() {
        let s3 = Url::parse("s3://bucket/t.parquet").unwrap();
        let e = build_store(&s3, &opts(&[("aws.regoin", "x")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("'aws.regoin'") && e.contains("did you mean 'aws.region'"),
            "{e}"
        );
        let e = build_store(&s3, &opts(&[("gcp.service_account", "x")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not apply to s3://"), "{e}");
        let ftp = Url::parse("ftp://host/t.csv").unwrap();
        let e = build_store(&ftp, &[]).unwrap_err().to_string();
        assert!(e.contains("ftp://"), "{e}");
    }

    #[test]
    fn registry_builds_remote_stores_on_demand_and_keeps_them() {
        let registry = FulmenObjectStoreRegistry::new();
        let url = Url::parse("http://127.0.0.1:9/data/t.csv").unwrap();
        let first = registry.get_store(&url).unwrap();
        let again = registry.get_store(&url).unwrap();
        assert!(Arc::ptr_eq(&first, &again));
        assert!(
            registry
                .get_store(&Url::parse("ftp://x/y").unwrap())
                .is_err()
        );
        registry
            .get_store(&Url::parse("file:///tmp").unwrap())
            .unwrap();
    }
}
