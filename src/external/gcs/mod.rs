//! Cloud Storage: model weights, record inputs and exports, from and to `gs://` URIs.
//!
//! On Spot nodes the local disk dies with the node, so models and large inputs live in a bucket.
//! This file holds the client ([`Gcs`]), its errors and how a URI names an object; the work is
//! one job a file:
//!
//! * `read`: whole-object and streaming reads, and [`InputReader`], the source's reader of the
//!   records that carry a `uri` instead of a `text`;
//! * `model_cache`: [`Gcs::fetch_model`], a model folder copied into a local cache, each file
//!   checked against the object's checksum under a per-file lock;
//! * `upload`: [`Gcs::upload`], resumable uploads for `export`;
//! * `list`: [`Gcs::list`], the objects under a prefix (the shards `publish` reads).
//!
//! The official crate does not read `STORAGE_EMULATOR_HOST`; spotinfer does, like Google's other
//! client libraries: when set, the client talks to that endpoint with anonymous credentials.

mod list;
mod model_cache;
mod read;
mod upload;

pub use list::Listed;
pub use model_cache::{cache_path, FetchedModel, FileList};
pub use read::{check_bucket, InputReader};
pub use upload::Upload;

use google_cloud_auth::credentials::anonymous;
use google_cloud_storage::client::Storage;
use std::path::PathBuf;

/// Errors reading from Cloud Storage.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// Not a `gs://bucket/object` URI.
    #[error("{0:?} is not a gs://BUCKET/OBJECT uri")]
    BadUri(String),
    /// The object does not exist.
    #[error("{0} does not exist")]
    NotFound(String),
    /// An upload's bucket does not exist.
    #[error("cannot write {0}: the bucket does not exist")]
    NoBucket(String),
    /// The object is larger than allowed.
    #[error("{uri} is {size} bytes, the limit is {max} (--max-object-bytes)")]
    TooLarge {
        /// The object.
        uri: String,
        /// Its size.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// Cloud Storage refused the request for a reason a retry cannot change (400 bad request,
    /// 401/403 no permission, 412 a precondition such as requester-pays).
    #[error("reading {uri} was refused: {status} ({detail})")]
    Refused {
        /// The object.
        uri: String,
        /// The HTTP status or gRPC code, as Cloud Storage gave it.
        status: String,
        /// The service's message.
        detail: String,
    },
    /// The bucket is not one this worker may read (`--allowed-buckets`).
    #[error("{uri}: bucket {bucket:?} is not in --allowed-buckets")]
    NotAllowed {
        /// The object.
        uri: String,
        /// Its bucket.
        bucket: String,
    },
    /// The object is not UTF-8 text.
    #[error("{0} is not UTF-8 text")]
    NotUtf8(String),
    /// The bytes do not match the object's checksum.
    #[error("{uri}: checksum mismatch ({detail})")]
    Checksum {
        /// The object.
        uri: String,
        /// What differed.
        detail: String,
    },
    /// The object's metadata carries no checksum to verify against.
    #[error("{0} has no crc32c or md5 checksum in its metadata")]
    NoChecksum(String),
    /// The client could not be built.
    #[error("cannot build the Cloud Storage client: {0}")]
    Client(String),
    /// A request failed (network, permission, server): may succeed later.
    #[error("reading {uri} failed: {source}")]
    Request {
        /// The object.
        uri: String,
        /// Why.
        #[source]
        source: google_cloud_storage::Error,
    },
    /// A read did not finish in time (the client retries transient errors until then).
    #[error("reading {0} timed out")]
    Timeout(String),
    /// A model URI whose bucket or prefix cannot name a directory inside the model cache.
    #[error("{uri:?} cannot be cached: {reason}")]
    UnsafeCachePath {
        /// The model URI.
        uri: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A local cache file could not be written.
    #[error("model cache {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl StorageError {
    /// Whether retrying cannot help (the record is then recorded as failed, not redelivered).
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            Self::BadUri(_)
                | Self::NotFound(_)
                | Self::Refused { .. }
                | Self::NotAllowed { .. }
                | Self::TooLarge { .. }
                | Self::NotUtf8(_)
        )
    }
}

/// Splits `gs://bucket/object` into the crate's bucket name and the object name.
pub fn parse_uri(uri: &str) -> Result<(String, String), StorageError> {
    let (bucket, object) =
        crate::record::split_gs_uri(uri).ok_or_else(|| StorageError::BadUri(uri.to_string()))?;
    Ok((format!("projects/_/buckets/{bucket}"), object.to_string()))
}

/// A Cloud Storage client.
#[derive(Clone, Debug)]
pub struct Gcs {
    client: Storage,
    /// Where the JSON API is reached (the emulator's host, or Cloud Storage's), for listings.
    endpoint: String,
    /// The credentials listings carry; none for the emulator.
    credentials: Option<google_cloud_auth::credentials::Credentials>,
    http: reqwest::Client,
}

impl Gcs {
    /// A client for the real service (Application Default Credentials, e.g. Workload Identity),
    /// or for the emulator at `emulator_host` (`STORAGE_EMULATOR_HOST`) with anonymous credentials.
    pub async fn new(emulator_host: Option<&str>) -> Result<Self, StorageError> {
        let mut b = Storage::builder();
        let mut endpoint = "https://storage.googleapis.com".to_string();
        let mut credentials = None;
        match emulator_host.filter(|h| !h.trim().is_empty()) {
            Some(host) => {
                endpoint = if host.starts_with("http://") || host.starts_with("https://") {
                    host.to_string()
                } else {
                    format!("http://{host}")
                };
                b = b
                    .with_endpoint(endpoint.clone())
                    .with_credentials(anonymous::Builder::new().build());
            }
            None => {
                let adc = google_cloud_auth::credentials::Builder::default().build();
                credentials = adc.ok();
            }
        }
        let client = b
            .build()
            .await
            .map_err(|e| StorageError::Client(e.to_string()))?;
        Ok(Self {
            client,
            endpoint,
            credentials,
            http: reqwest::Client::new(),
        })
    }
}

fn request_error(uri: &str, e: google_cloud_storage::Error) -> StorageError {
    use google_cloud_gax::error::rpc::Code;
    let http = e.http_status_code();
    let code = e.status().map(|s| s.code);
    if http == Some(404) || code == Some(Code::NotFound) {
        return StorageError::NotFound(uri.to_string());
    }
    // What the service refuses for this request whatever the moment: an invalid name, no
    // permission on the bucket, a failed precondition (requester-pays). Retried, such a record
    // would come back on every delivery until it was dead-lettered.
    let permanent_http = matches!(http, Some(400 | 401 | 403 | 405 | 412 | 416));
    let permanent_code = matches!(
        code,
        Some(
            Code::InvalidArgument
                | Code::PermissionDenied
                | Code::Unauthenticated
                | Code::FailedPrecondition
                | Code::OutOfRange
        )
    );
    if permanent_http || permanent_code {
        let status = match (http, code) {
            (Some(h), _) => format!("HTTP {h}"),
            (None, Some(c)) => format!("{c:?}"),
            (None, None) => "refused".to_string(),
        };
        return StorageError::Refused {
            uri: uri.to_string(),
            status,
            detail: e.to_string(),
        };
    }
    StorageError::Request {
        uri: uri.to_string(),
        source: e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_gs_uris() {
        assert_eq!(
            parse_uri("gs://b/dir/o.txt").unwrap(),
            ("projects/_/buckets/b".to_string(), "dir/o.txt".to_string())
        );
        assert!(parse_uri("gs://b").is_err());
        assert!(parse_uri("gs:///o").is_err());
        assert!(parse_uri("s3://b/o").is_err());
    }
}
