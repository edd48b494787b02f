//! Cloud Storage: model weights and record inputs from `gs://` URIs.
//!
//! On Spot nodes the local disk dies with the node, so models and large inputs live in a bucket.
//! [`Gcs::fetch_model`] copies a model prefix into a local cache directory: each file is
//! downloaded to a temporary name, checked against the object's CRC32C, and renamed into place,
//! under a per-file lock so several workers starting on one node download it once; a cached file
//! whose CRC32C still matches the object is reused across restarts. [`Gcs::read`] reads one object
//! with a size limit, for records that carry a `uri` instead of a `text`.
//!
//! The official crate does not read `STORAGE_EMULATOR_HOST`; spotinfer does, like Google's other
//! client libraries: when set, the client talks to that endpoint with anonymous credentials.

use google_cloud_auth::credentials::anonymous;
use google_cloud_storage::client::Storage;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::AsyncWriteExt;

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
}

/// What [`Gcs::fetch_model`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchedModel {
    /// The local directory holding the model.
    pub dir: PathBuf,
    /// Files downloaded this time (the rest were reused from the cache).
    pub downloaded: Vec<String>,
}

impl Gcs {
    /// A client for the real service (Application Default Credentials, e.g. Workload Identity),
    /// or for the emulator at `emulator_host` (`STORAGE_EMULATOR_HOST`) with anonymous credentials.
    pub async fn new(emulator_host: Option<&str>) -> Result<Self, StorageError> {
        let mut b = Storage::builder();
        if let Some(host) = emulator_host.filter(|h| !h.trim().is_empty()) {
            let endpoint = if host.starts_with("http://") || host.starts_with("https://") {
                host.to_string()
            } else {
                format!("http://{host}")
            };
            b = b
                .with_endpoint(endpoint)
                .with_credentials(anonymous::Builder::new().build());
        }
        let client = b
            .build()
            .await
            .map_err(|e| StorageError::Client(e.to_string()))?;
        Ok(Self { client })
    }

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

    /// Reads an object as UTF-8 text.
    pub async fn read_text(&self, uri: &str, max_bytes: u64) -> Result<String, StorageError> {
        let bytes = self.read(uri, Some(max_bytes)).await?;
        String::from_utf8(bytes).map_err(|_| StorageError::NotUtf8(uri.to_string()))
    }

    /// Copies the model under `gs://bucket/prefix` into `cache_dir` (see the module docs) and
    /// returns the local directory: first its `modules.json`, then the files that names (see
    /// [`crate::model::spec::model_files`]). A missing required object or a bad checksum is an
    /// error; a missing optional one is skipped (and any stale cached copy removed).
    pub async fn fetch_model(
        &self,
        uri: &str,
        cache_dir: &Path,
    ) -> Result<FetchedModel, StorageError> {
        let modules = ["modules.json".to_string()];
        let mut fetched = self.fetch_files(uri, cache_dir, &[], &modules).await?;
        let files = crate::model::spec::model_files(&fetched.dir);
        let rest = self
            .fetch_files(uri, cache_dir, &files.required, &files.optional)
            .await?;
        fetched.downloaded.extend(rest.downloaded);
        Ok(fetched)
    }

    /// Copies `required` and, where they exist, `optional` files of the model under `uri` into
    /// its cache directory.
    async fn fetch_files(
        &self,
        uri: &str,
        cache_dir: &Path,
        required: &[String],
        optional: &[String],
    ) -> Result<FetchedModel, StorageError> {
        let base = uri.trim_end_matches('/');
        let (bucket, prefix) = parse_uri(base)?;
        let bucket_name = bucket.rsplit('/').next().unwrap_or_default().to_string();
        let dir = cache_path(cache_dir, &bucket_name, &prefix).map_err(|reason| {
            StorageError::UnsafeCachePath {
                uri: base.chars().take(80).collect(),
                reason,
            }
        })?;
        let mut downloaded = Vec::new();
        let files = required.iter().map(|f| (f, true));
        for (file, needed) in files.chain(optional.iter().map(|f| (f, false))) {
            let object = format!("{prefix}/{file}");
            let local = dir.join(file);
            let object_uri = format!("gs://{bucket_name}/{object}");
            match self.cache_file(&bucket, &object, &object_uri, &local).await {
                Ok(true) => downloaded.push(file.to_string()),
                Ok(false) => {}
                Err(StorageError::NotFound(_)) if !needed => {
                    let _ = tokio::fs::remove_file(&local).await;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(FetchedModel { dir, downloaded })
    }

    /// Makes `local` a verified copy of the object; returns whether it downloaded.
    async fn cache_file(
        &self,
        bucket: &str,
        object: &str,
        uri: &str,
        local: &Path,
    ) -> Result<bool, StorageError> {
        let io = |path: &Path, source| StorageError::Io {
            path: path.to_path_buf(),
            source,
        };
        let parent = local.parent().unwrap_or(Path::new("."));
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(|e| io(parent, e))?;
        let lock_path = local.with_extension("lock");
        let _lock = FileLock::acquire(&lock_path)
            .await
            .map_err(|e| io(&lock_path, e))?;

        let mut resp = self
            .client
            .read_object(bucket.to_string(), object.to_string())
            .send()
            .await
            .map_err(|e| request_error(uri, e))?;
        let meta = resp.object();
        let want = Expected::from_metadata(uri, &meta)?;
        if let Ok(bytes) = tokio::fs::read(local).await {
            if want.matches(&bytes) {
                return Ok(false); // a valid cache: the response body is never read
            }
            tracing::warn!(file = %local.display(), "cached model file does not match the object; downloading again");
        }
        let tmp = local.with_extension(format!("partial.{}", std::process::id()));
        let mut out = tokio::fs::File::create(&tmp)
            .await
            .map_err(|e| io(&tmp, e))?;
        let mut crc = 0u32;
        let mut md5 = md5::Context::new();
        while let Some(chunk) = resp.next().await {
            let chunk = chunk.map_err(|e| request_error(uri, e))?;
            crc = crc32c::crc32c_append(crc, &chunk);
            md5.consume(&chunk);
            out.write_all(&chunk).await.map_err(|e| io(&tmp, e))?;
        }
        out.sync_all().await.map_err(|e| io(&tmp, e))?;
        drop(out);
        if let Err(e) = want.check(uri, crc, &md5.finalize().0) {
            let _ = tokio::fs::remove_file(&tmp).await;
            return Err(e);
        }
        tokio::fs::rename(&tmp, local)
            .await
            .map_err(|e| io(local, e))?;
        Ok(true)
    }
}

/// Where the model under `gs://bucket/prefix` is cached: `cache_dir/bucket/prefix`, refused
/// unless every part is a plain name, so no URI can name a directory outside `cache_dir` (`..`,
/// `.`, an absolute or empty segment) or one shared with another model's files.
pub fn cache_path(cache_dir: &Path, bucket: &str, prefix: &str) -> Result<PathBuf, &'static str> {
    let valid_bucket = !bucket.is_empty()
        && bucket.len() <= 222
        && bucket
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b))
        && bucket.starts_with(|c: char| c.is_ascii_alphanumeric());
    if !valid_bucket {
        return Err("not a Cloud Storage bucket name");
    }
    let mut dir = cache_dir.join(bucket);
    for segment in prefix.split('/') {
        match segment {
            "" => return Err("the prefix has an empty segment (`//` or a leading `/`)"),
            "." | ".." => return Err("the prefix has a `.` or `..` segment"),
            s if s.contains('\\') || s.contains('\0') => {
                return Err("the prefix has a backslash or NUL")
            }
            s => dir.push(s),
        }
    }
    Ok(dir)
}

/// Longest one input read may take before its message is NACKed for a later retry.
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
        if self.allowed_buckets.is_empty() || self.allowed_buckets.iter().any(|b| b == bucket) {
            return Ok(());
        }
        Err(StorageError::NotAllowed {
            uri: uri.to_string(),
            bucket: bucket.to_string(),
        })
    }

    /// The object's text. Permanent errors ([`StorageError::is_permanent`]) mean the record can
    /// never succeed; any other error may pass on a retry.
    pub async fn text(&self, uri: &str) -> Result<String, StorageError> {
        // The client retries transient errors with backoff for a long time; a record should go
        // back to Pub/Sub (NACK) well before its lease matters. The first call builds the
        // client, inside the same limit.
        self.check_allowed(uri)?;
        let read = async {
            let client = self
                .client
                .get_or_try_init(|| Gcs::new(self.emulator_host.as_deref()))
                .await?;
            client.read_text(uri, self.max_bytes).await
        };
        tokio::time::timeout(INPUT_TIMEOUT, read)
            .await
            .map_err(|_| StorageError::Timeout(uri.to_string()))?
    }
}

/// The checksums an object's metadata promises.
struct Expected {
    crc32c: Option<u32>,
    md5: Option<[u8; 16]>,
}

impl Expected {
    fn from_metadata(
        uri: &str,
        meta: &google_cloud_storage::model_ext::ObjectHighlights,
    ) -> Result<Self, StorageError> {
        let sums = meta.checksums.as_ref();
        let crc32c = sums.and_then(|c| c.crc32c);
        let md5 = sums.and_then(|c| <[u8; 16]>::try_from(c.md5_hash.as_ref()).ok());
        if crc32c.is_none() && md5.is_none() {
            return Err(StorageError::NoChecksum(uri.to_string()));
        }
        Ok(Self { crc32c, md5 })
    }

    fn matches(&self, bytes: &[u8]) -> bool {
        self.crc32c.is_none_or(|c| crc32c::crc32c(bytes) == c)
            && self.md5.is_none_or(|m| md5::compute(bytes).0 == m)
    }

    fn check(&self, uri: &str, crc: u32, md5: &[u8; 16]) -> Result<(), StorageError> {
        if let Some(want) = self.crc32c.filter(|w| *w != crc) {
            return Err(StorageError::Checksum {
                uri: uri.to_string(),
                detail: format!("crc32c {crc:08x}, object says {want:08x}"),
            });
        }
        if let Some(want) = self.md5.filter(|w| w != md5) {
            return Err(StorageError::Checksum {
                uri: uri.to_string(),
                detail: format!(
                    "md5 {}, object says {}",
                    hex::encode(md5),
                    hex::encode(want)
                ),
            });
        }
        Ok(())
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

/// An exclusive lock on a file (`File::lock`: flock on Linux), held while the value lives; the
/// lock goes with the file descriptor when it is dropped.
struct FileLock(#[allow(dead_code)] std::fs::File);

impl FileLock {
    /// Waits for the lock on a blocking thread, so other tasks run meanwhile.
    async fn acquire(path: &Path) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)?;
        tokio::task::spawn_blocking(move || file.lock().map(|()| Self(file)))
            .await
            .map_err(std::io::Error::other)?
    }
}

/// Pieces an upload may hold queued before [`Upload::write`] waits (the client buffers its own
/// resumable chunk on top).
const UPLOAD_QUEUE: usize = 4;

/// One piece of an upload's data, or its end: the upload is finalised only by an explicit end,
/// so one cut off (an error, a dropped [`Upload`]) never becomes a short object.
enum Piece {
    Bytes(bytes::Bytes),
    End,
}

/// The upload's data as the storage client pulls it. It tells [`Gcs::upload`] when the client
/// first asks for data, which is after the resumable session was created: a missing bucket or
/// a refused write fails before that, with nothing written.
struct Pieces {
    rx: tokio::sync::mpsc::Receiver<Piece>,
    asked: Option<tokio::sync::oneshot::Sender<()>>,
}

impl google_cloud_storage::streaming_source::StreamingSource for Pieces {
    type Error = std::io::Error;

    async fn next(&mut self) -> Option<Result<bytes::Bytes, Self::Error>> {
        if let Some(asked) = self.asked.take() {
            let _ = asked.send(());
        }
        match self.rx.recv().await {
            Some(Piece::Bytes(b)) => Some(Ok(b)),
            Some(Piece::End) => None,
            None => Some(Err(std::io::Error::other(
                "the upload was abandoned before its end",
            ))),
        }
    }
}

/// An object being written by a resumable upload (CRC32C-checked by the client against what
/// the service stored). The object exists only once [`Upload::finish`] returns.
pub struct Upload {
    uri: String,
    tx: tokio::sync::mpsc::Sender<Piece>,
    task: tokio::task::JoinHandle<Result<(), google_cloud_storage::Error>>,
}

impl Gcs {
    /// Starts a resumable upload to `uri`; returns once the service accepted the session.
    pub async fn upload(&self, uri: &str) -> Result<Upload, StorageError> {
        let (bucket, object) = parse_uri(uri)?;
        let (tx, rx) = tokio::sync::mpsc::channel(UPLOAD_QUEUE);
        let (asked, asked_rx) = tokio::sync::oneshot::channel();
        let source = Pieces {
            rx,
            asked: Some(asked),
        };
        let client = self.client.clone();
        let task = tokio::spawn(async move {
            client
                .write_object(bucket, object, source)
                .send_buffered()
                .await
                .map(|_| ())
        });
        let mut upload = Upload {
            uri: uri.to_string(),
            tx,
            task,
        };
        if asked_rx.await.is_err() {
            // The task ended before asking for data: the session was refused.
            return Err(upload.outcome().await.err().unwrap_or_else(|| {
                StorageError::Client(format!("the upload to {uri} ended before it started"))
            }));
        }
        Ok(upload)
    }
}

impl Upload {
    /// Queues bytes for the upload.
    pub async fn write(&mut self, bytes: bytes::Bytes) -> Result<(), StorageError> {
        if self.tx.send(Piece::Bytes(bytes)).await.is_err() {
            return self.outcome().await;
        }
        Ok(())
    }

    /// Ends the upload and waits until the object is stored and its checksum verified.
    pub async fn finish(mut self) -> Result<(), StorageError> {
        if self.tx.send(Piece::End).await.is_err() {
            return self.outcome().await;
        }
        self.outcome().await
    }

    /// What the upload task ended with.
    async fn outcome(&mut self) -> Result<(), StorageError> {
        let uri = self.uri.clone();
        match (&mut self.task).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => match request_error(&uri, e) {
                StorageError::NotFound(uri) => Err(StorageError::NoBucket(uri)),
                other => Err(other),
            },
            Err(e) => Err(StorageError::Client(format!("upload to {uri}: {e}"))),
        }
    }
}

impl Drop for Upload {
    /// An upload dropped before [`Upload::finish`] is cancelled: its session is never
    /// finalised, so no object appears.
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_checksum_is_refused() {
        let data = b"model bytes";
        let good = Expected {
            crc32c: Some(crc32c::crc32c(data)),
            md5: Some(md5::compute(data).0),
        };
        assert!(good.matches(data));
        assert!(good
            .check("gs://b/o", crc32c::crc32c(data), &md5::compute(data).0)
            .is_ok());
        let err = good
            .check("gs://b/o", crc32c::crc32c(b"other"), &md5::compute(data).0)
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("gs://b/o: checksum mismatch (crc32c"),
            "{err}"
        );
        let md5_only = Expected {
            crc32c: None,
            md5: Some(md5::compute(data).0),
        };
        assert!(!md5_only.matches(b"model bytez"));
        assert!(md5_only
            .check("gs://b/o", 0, &md5::compute(b"x").0)
            .unwrap_err()
            .to_string()
            .contains("md5"));
    }

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

    #[test]
    fn the_model_cache_path_stays_inside_the_cache() {
        let cache = Path::new("/cache");
        assert_eq!(
            cache_path(cache, "models", "team/minilm-v2").unwrap(),
            Path::new("/cache/models/team/minilm-v2")
        );
        for (bucket, prefix) in [
            ("models", "../../etc"),
            ("models", "a/../../../x"),
            ("models", "/etc"),
            ("models", "a//b"),
            ("models", "./a"),
            ("models", ""),
            ("..", "x"),
            (".", "x"),
            ("Models", "x"),
            ("", "x"),
            ("models", "a\\..\\b"),
        ] {
            let got = cache_path(cache, bucket, prefix);
            assert!(got.is_err(), "gs://{bucket}/{prefix} gave {got:?}");
        }
    }

    #[tokio::test]
    async fn fetching_a_model_refuses_a_prefix_that_leaves_the_cache() {
        let gcs = Gcs::new(Some("127.0.0.1:9")).await.unwrap();
        let root = tempfile::tempdir().unwrap();
        let cache = root.path().join("cache");
        let err = gcs
            .fetch_model("gs://models/a/../../../outside", &cache)
            .await
            .unwrap_err();
        assert!(matches!(err, StorageError::UnsafeCachePath { .. }), "{err}");
        assert!(err.to_string().contains("`..` segment"), "{err}");
        assert!(!root.path().join("outside").exists());
        assert!(!cache.exists(), "nothing is created for a refused uri");
    }
}
