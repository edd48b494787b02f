//! A model folder from a bucket, copied into a local cache directory.
//!
//! Each file is downloaded to a temporary name, checked against the object's CRC32C (or MD5),
//! and renamed into place, under a per-file lock so several workers starting on one node
//! download it once; a cached file whose checksum still matches the object is reused across
//! restarts. Which files a model needs is the model layer's knowledge, not this one's: the
//! caller says, through [`FileList`].

use super::{parse_uri, request_error, Gcs, StorageError};
use crate::external::file_lock::FileLock;
use std::path::{Path, PathBuf};
use tokio::io::AsyncWriteExt;

/// What [`Gcs::fetch_model`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchedModel {
    /// The local directory holding the model.
    pub dir: PathBuf,
    /// Files downloaded this time (the rest were reused from the cache).
    pub downloaded: Vec<String>,
}

/// The files of a model folder to copy, as the caller's model layer lists them (this layer
/// reads no model format).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FileList {
    /// Files the model cannot do without: a missing object is an error.
    pub required: Vec<String>,
    /// Files copied where the bucket has them.
    pub optional: Vec<String>,
}

impl Gcs {
    /// Copies the model under `gs://bucket/prefix` into `cache_dir` (see the module docs) and
    /// returns the local directory: first its `index` file (`modules.json`), where the bucket
    /// has one, then the files `files` lists for the folder holding it. The caller passes the
    /// model layer's list (`model::spec::model_files`), so this layer reads no model format. A
    /// missing required object or a bad checksum is an error; a missing optional one is skipped
    /// (and any stale cached copy removed).
    pub async fn fetch_model(
        &self,
        uri: &str,
        cache_dir: &Path,
        index: &str,
        files: impl FnOnce(&Path) -> FileList,
    ) -> Result<FetchedModel, StorageError> {
        let modules = [index.to_string()];
        let mut fetched = self.fetch_files(uri, cache_dir, &[], &modules).await?;
        let files = files(&fetched.dir);
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
            .fetch_model(
                "gs://models/a/../../../outside",
                &cache,
                "modules.json",
                |_| FileList::default(),
            )
            .await
            .unwrap_err();
        assert!(matches!(err, StorageError::UnsafeCachePath { .. }), "{err}");
        assert!(err.to_string().contains("`..` segment"), "{err}");
        assert!(!root.path().join("outside").exists());
        assert!(!cache.exists(), "nothing is created for a refused uri");
    }
}
