//! Reading objects: whole (with a size limit) or as a stream, and the worker's reader of record
//! inputs, which builds its client on first use and refuses buckets outside `--allowed-buckets`.

use super::{parse_uri, request_error, Gcs, StorageError};
use std::time::Duration;

impl Gcs {
    /// Reads a whole object, refusing one larger than `max_bytes`.
    pub async fn read(&self, uri: &str, max_bytes: Option<u64>) -> Result<Vec<u8>, StorageError> {
        let (mut resp, size) = self.request(uri).await?;
        if let Some(max) = max_bytes.filter(|m| size > *m) {
            return Err(StorageError::TooLarge {
                uri: uri.to_string(),
                size,
                max,
            });
        }
        let mut out = Vec::with_capacity(size as usize);
        while let Some(chunk) = resp.next().await {
            let chunk = chunk.map_err(|e| request_error(uri, e))?;
            out.extend_from_slice(&chunk);
            if let Some(max) = max_bytes.filter(|m| out.len() as u64 > *m) {
                return Err(StorageError::TooLarge {
                    uri: uri.to_string(),
                    size: out.len() as u64,
                    max,
                });
            }
        }
        Ok(out)
    }

    /// Opens an object for reading as it is consumed, chunk by chunk (constant memory), and
    /// returns its size with the reader.
    pub async fn open(
        &self,
        uri: &str,
    ) -> Result<(u64, impl tokio::io::AsyncBufRead + Unpin + Send), StorageError> {
        let (resp, size) = self.request(uri).await?;
        let chunks = futures::stream::unfold(resp, |mut resp| async move {
            let chunk = resp.next().await?;
            Some((chunk.map_err(std::io::Error::other), resp))
        });
        Ok((size, tokio_util::io::StreamReader::new(Box::pin(chunks))))
    }

    /// Starts reading the object at `uri`: the response (its body not yet read) and the size.
    async fn request(
        &self,
        uri: &str,
    ) -> Result<(google_cloud_storage::read_object::ReadObjectResponse, u64), StorageError> {
        let (bucket, object) = parse_uri(uri)?;
        let resp = self
            .client
            .read_object(bucket, object)
            .send()
            .await
            .map_err(|e| request_error(uri, e))?;
        let size = resp.object().size.max(0) as u64;
        Ok((resp, size))
    }
}

/// Longest one input read may take before it counts as a transient failure (the source retries
/// it in place a few times, then NACKs the message).
const INPUT_TIMEOUT: Duration = Duration::from_secs(10);

/// Reads record inputs (`"uri"` records) for the source: builds its client on first use, so a
/// worker that never sees a `uri` never needs Cloud Storage credentials.
#[derive(Debug)]
pub struct InputReader {
    emulator_host: Option<String>,
    max_bytes: u64,
    allowed_buckets: Vec<String>,
    client: tokio::sync::OnceCell<Gcs>,
}

/// Refuses `uri`, in `bucket`, when `allowed` (`--allowed-buckets`) is set and does not name
/// it: the one rule for records' `uri`s and for `publish`'s input.
pub fn check_bucket(allowed: &[String], bucket: &str, uri: &str) -> Result<(), StorageError> {
    if allowed.is_empty() || allowed.iter().any(|b| b == bucket) {
        return Ok(());
    }
    Err(StorageError::NotAllowed {
        uri: uri.to_string(),
        bucket: bucket.to_string(),
    })
}

impl InputReader {
    /// A reader for objects of at most `max_bytes` in `allowed_buckets` (empty: any bucket).
    /// The list is what keeps a publisher from making the workers read, with their service
    /// account, objects they were never meant to read.
    pub fn new(
        emulator_host: Option<String>,
        max_bytes: u64,
        allowed_buckets: Vec<String>,
    ) -> Self {
        Self {
            emulator_host,
            max_bytes,
            allowed_buckets,
            client: tokio::sync::OnceCell::new(),
        }
    }

    /// Refuses a `uri` whose bucket is not in the allowed list.
    fn check_allowed(&self, uri: &str) -> Result<(), StorageError> {
        let (bucket, _) = crate::record::split_gs_uri(uri)
            .ok_or_else(|| StorageError::BadUri(uri.to_string()))?;
        check_bucket(&self.allowed_buckets, bucket, uri)
    }

    /// The object's bytes (a text, or an image for an image model). Permanent errors
    /// ([`StorageError::is_permanent`]) mean the record can never succeed; any other error may
    /// pass on a retry.
    pub async fn bytes(&self, uri: &str) -> Result<Vec<u8>, StorageError> {
        // The client retries transient errors with backoff for a long time; one read must give
        // up well before the message's lease matters (the source retries it a few times, then
        // NACKs). The first call builds the client, inside the same limit.
        self.check_allowed(uri)?;
        let read = async {
            let client = self
                .client
                .get_or_try_init(|| Gcs::new(self.emulator_host.as_deref()))
                .await?;
            client.read(uri, Some(self.max_bytes)).await
        };
        tokio::time::timeout(INPUT_TIMEOUT, read)
            .await
            .map_err(|_| StorageError::Timeout(uri.to_string()))?
    }
}
