//! What `spotinfer publish` reads: one file, a folder, a `gs://` object, or a `gs://` prefix or
//! glob of many shards, each JSON lines, CSV/TSV or Parquet, plain, gzip or zstd.
//!
//! [`list`] turns what the user gave into an [`Input`]: its shards, listed once and sorted by
//! name, so every run reads them in the same order (a job keeps each shard's progress under its
//! name). [`read::rows`] reads one shard on a blocking thread and sends its rows, already made
//! into the message contract's JSON by [`columns::Columns`], to the publisher.

mod bounded;
pub mod columns;
pub mod read;

use crate::external::gcs::{Gcs, StorageError};
use std::path::{Path, PathBuf};

/// The longest record a row may make, in bytes: Pub/Sub's 10 MB message limit, which a record
/// is published as. A longer line or CSV record is refused without being held in memory.
pub const MAX_LINE_BYTES: usize = 10_000_000;

/// Errors finding or reading an input.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    /// A local file or folder cannot be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Cloud Storage refused.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// Nothing to read under what was given.
    #[error("{0}")]
    Empty(String),
    /// A file's format is not one spotinfer reads.
    #[error("{0}")]
    Format(String),
    /// The column mapping does not fit a shard's columns (nothing of it was published).
    #[error("{shard}: {reason}")]
    Columns {
        /// The shard.
        shard: String,
        /// What is missing or mistyped.
        reason: String,
    },
    /// A shard is not what its suffix says (not Parquet, bad gzip, bad CSV).
    #[error("{shard}: {reason}")]
    Unreadable {
        /// The shard.
        shard: String,
        /// The reader's error.
        reason: String,
    },
}

/// How a shard's rows are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// One JSON object per line (`.jsonl`, `.json`, `.ndjson`).
    Jsonl,
    /// Comma-separated values with a header row (`.csv`).
    Csv,
    /// Tab-separated values with a header row (`.tsv`, `.tab`), unquoted: a `"` is an ordinary
    /// character and every line is one row, as PostgreSQL and BigQuery write TSV.
    Tsv,
    /// Tab-separated values quoted as CSV quotes (fields holding a tab, a quote or a newline in
    /// `"…"`), as Python's `csv` excel-tab dialect and pandas' `to_csv(sep="\t")` write them:
    /// only by `--format quoted-tsv`.
    QuotedTsv,
    /// Apache Parquet (`.parquet`, `.pq`).
    Parquet,
}

/// How a shard's bytes are compressed (by suffix: `.gz`, `.zst`/`.zstd`). Parquet compresses
/// inside the file and takes none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Plain.
    None,
    /// gzip.
    Gzip,
    /// Zstandard.
    Zstd,
}

/// One file of an input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// Its full name, the key of its progress in a job and what a generated id is made of: an
    /// absolute path or a `gs://` URI.
    pub name: String,
    /// Its name under the input's root (for messages).
    pub rel: String,
    /// Its size in bytes.
    pub size: u64,
    /// What identifies its content: an object's generation, or a local file's size and
    /// modification time. A publish resumes a shard part-way only while it is the same.
    pub version: String,
    /// How its rows are written.
    pub format: Format,
    /// How its bytes are compressed.
    pub compression: Compression,
}

/// What a publish reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Input {
    /// The input as the user named it, made absolute: what its shards have in common.
    pub name: String,
    /// Its shards, by name.
    pub shards: Vec<Shard>,
    /// Files under a folder or prefix that were left out (no known suffix), by name.
    pub skipped: Vec<String>,
}

impl Input {
    /// The shards' bytes together.
    pub fn bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.size).sum()
    }
}

/// Opens a shard for [`read::rows`]: a local file as it is; a `gs://` Parquet shard copied
/// into an unnamed temporary file first (its reader seeks; the copy is gone once read); any
/// other `gs://` shard as a stream.
pub async fn open(shard: &Shard, gcs: Option<&Gcs>) -> Result<read::Bytes, InputError> {
    let io = |source| InputError::Io {
        path: shard.name.clone(),
        source,
    };
    if !shard.name.starts_with("gs://") {
        return Ok(read::Bytes::File(
            std::fs::File::open(&shard.name).map_err(io)?,
        ));
    }
    let gcs = gcs.ok_or_else(|| InputError::Empty("no Cloud Storage client".into()))?;
    let (_, mut reader) = gcs.open(&shard.name).await?;
    if shard.format != Format::Parquet {
        let bridge = tokio_util::io::SyncIoBridge::new(reader);
        return Ok(read::Bytes::Stream(Box::new(bridge)));
    }
    let file = tempfile::tempfile().map_err(io)?;
    let mut copy = tokio::fs::File::from_std(file.try_clone().map_err(io)?);
    tokio::io::copy_buf(&mut reader, &mut copy)
        .await
        .map_err(io)?;
    use tokio::io::AsyncWriteExt;
    copy.flush().await.map_err(io)?;
    Ok(read::Bytes::File(copy.into_std().await))
}

/// The format and compression a file's name says, `None` for a name with no known suffix.
pub fn by_suffix(name: &str) -> Option<(Format, Compression)> {
    let lower = name.to_ascii_lowercase();
    let (stem, compression) = if let Some(s) = lower.strip_suffix(".gz") {
        (s, Compression::Gzip)
    } else if let Some(s) = lower.strip_suffix(".zst").or(lower.strip_suffix(".zstd")) {
        (s, Compression::Zstd)
    } else {
        (lower.as_str(), Compression::None)
    };
    let format = match stem.rsplit_once('.')?.1 {
        "jsonl" | "json" | "ndjson" => Format::Jsonl,
        "csv" => Format::Csv,
        "tsv" | "tab" => Format::Tsv,
        "parquet" | "pq" => Format::Parquet,
        _ => return None,
    };
    if format == Format::Parquet && compression != Compression::None {
        return None;
    }
    Some((format, compression))
}

/// Whether a folder's file is bookkeeping, never data: Hadoop's and Spark's `_SUCCESS`,
/// `_metadata`, `.part-0.crc`, and hidden files.
fn is_bookkeeping(rel: &str) -> bool {
    rel.split('/')
        .any(|part| part.starts_with('_') || part.starts_with('.'))
}

/// The shards of what the user gave: a local file or folder (walked, in path order), a `gs://`
/// object, prefix (ending in `/`, or any prefix with no exact object) or glob (`*`, `?`, `[`
/// in the last part: `*` stays within one folder). `format` overrides the suffixes; without
/// it, files of a folder or prefix with no known suffix are left out (and listed in
/// [`Input::skipped`]).
pub async fn list(
    given: &str,
    format: Option<Format>,
    gcs: Option<&Gcs>,
) -> Result<Input, InputError> {
    let (name, files) = match (given.strip_prefix("gs://"), gcs) {
        (Some(_), Some(gcs)) => (given.to_string(), gs_files(given, gcs).await?),
        (Some(_), None) => return Err(InputError::Empty("no Cloud Storage client".into())),
        (None, _) => {
            let path = Path::new(given).to_path_buf();
            tokio::task::spawn_blocking(move || local_files(&path))
                .await
                .map_err(|e| InputError::Empty(e.to_string()))??
        }
    };
    shards(name, files, format)
}

/// A file found: (full name, name under the root, size, version, whether it was named exactly).
type Found = (String, String, u64, String, bool);

/// The input's shards from the files found: each with its format, bookkeeping files dropped.
fn shards(name: String, files: Vec<Found>, format: Option<Format>) -> Result<Input, InputError> {
    let mut input = Input {
        name,
        shards: Vec::new(),
        skipped: Vec::new(),
    };
    for (name, rel, size, version, exact) in files {
        if !exact && is_bookkeeping(&rel) {
            continue;
        }
        let found = match (by_suffix(&name), format) {
            (Some((_, compression)), Some(f)) => Some((f, compression)),
            (None, Some(f)) => Some((f, Compression::None)),
            (found, None) => found,
        };
        match found {
            Some((format, compression)) => input.shards.push(Shard {
                name,
                rel,
                size,
                version,
                format,
                compression,
            }),
            None if exact => {
                return Err(InputError::Format(format!(
                    "{name}: no known suffix (.jsonl, .csv, .tsv, .parquet, with .gz or .zst); \
                     give --format"
                )))
            }
            None => input.skipped.push(rel),
        }
    }
    if input.shards.is_empty() {
        return Err(InputError::Empty(format!(
            "no input files under {}{}",
            input.name,
            if input.skipped.is_empty() {
                String::new()
            } else {
                format!(
                    " ({} files with no known suffix, such as {}; give --format)",
                    input.skipped.len(),
                    input.skipped[0]
                )
            }
        )));
    }
    Ok(input)
}

/// A local file, or every file under a local folder, in path order, with its absolute name.
fn local_files(path: &Path) -> Result<(String, Vec<Found>), InputError> {
    let io = |p: &Path, source| InputError::Io {
        path: p.display().to_string(),
        source,
    };
    let root = std::fs::canonicalize(path).map_err(|e| io(path, e))?;
    let meta = std::fs::metadata(&root).map_err(|e| io(&root, e))?;
    if !meta.is_dir() {
        let rel = root
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        let name = root.display().to_string();
        return Ok((
            name.clone(),
            vec![(name, rel, meta.len(), version(&meta), true)],
        ));
    }
    let mut out = Vec::new();
    let mut folders = vec![root.clone()];
    while let Some(dir) = folders.pop() {
        for entry in std::fs::read_dir(&dir).map_err(|e| io(&dir, e))? {
            let entry = entry.map_err(|e| io(&dir, e))?;
            let path: PathBuf = entry.path();
            let meta = std::fs::metadata(&path).map_err(|e| io(&path, e))?;
            if meta.is_dir() {
                folders.push(path);
                continue;
            }
            let rel = path
                .strip_prefix(&root)
                .map_or_else(|_| path.clone(), Path::to_path_buf);
            out.push((
                path.display().to_string(),
                rel.to_string_lossy().into_owned(),
                meta.len(),
                version(&meta),
                false,
            ));
        }
    }
    out.sort();
    Ok((root.display().to_string(), out))
}

/// A local file's version: its size and modification time (to the nanosecond where the file
/// system keeps it), which a rewrite of the file changes.
fn version(meta: &std::fs::Metadata) -> String {
    let modified = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    format!("size {} modified {modified}", meta.len())
}

/// A `gs://` object, or the objects under a prefix or matching a glob, in name order.
async fn gs_files(given: &str, gcs: &Gcs) -> Result<Vec<Found>, InputError> {
    if let Some(at) = given.find(['*', '?', '[']) {
        let root = &given[..given[..at].rfind('/').map_or(at, |slash| slash + 1)];
        let pattern =
            glob::Pattern::new(given).map_err(|e| InputError::Format(format!("{given}: {e}")))?;
        let options = glob::MatchOptions {
            require_literal_separator: true,
            ..Default::default()
        };
        let listed = gcs.list(root).await?;
        let matching = listed
            .into_iter()
            .filter(|l| pattern.matches_with(&l.uri, options));
        return Ok(matching.map(|l| under(root, l, false)).collect());
    }
    let listed = gcs.list(given).await?;
    if let Some(object) = listed.iter().find(|l| l.uri == given) {
        let root = &given[..given.rfind('/').map_or(0, |slash| slash + 1)];
        return Ok(vec![under(root, object.clone(), true)]);
    }
    // No object of that name: a folder (`exports` is `exports/`, not `exports-old/…`).
    let root = format!("{}/", given.trim_end_matches('/'));
    let inside = listed
        .into_iter()
        .filter(|l| l.uri.starts_with(&root) && !l.uri.ends_with('/'));
    Ok(inside.map(|l| under(&root, l, false)).collect())
}

/// A listed object with its name under `root`.
fn under(root: &str, object: crate::external::gcs::Listed, exact: bool) -> Found {
    let rel = object
        .uri
        .strip_prefix(root)
        .unwrap_or(&object.uri)
        .to_string();
    let version = format!("generation {}", object.generation);
    (object.uri, rel, object.size, version, exact)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffixes_say_format_and_compression() {
        assert_eq!(
            by_suffix("a/part-0.jsonl.gz"),
            Some((Format::Jsonl, Compression::Gzip))
        );
        assert_eq!(
            by_suffix("x.TSV.zst"),
            Some((Format::Tsv, Compression::Zstd))
        );
        assert_eq!(
            by_suffix("000000000000.parquet"),
            Some((Format::Parquet, Compression::None))
        );
        assert_eq!(by_suffix("x.parquet.gz"), None, "Parquet compresses inside");
        assert_eq!(by_suffix("_SUCCESS"), None);
        assert!(is_bookkeeping("year=2024/_SUCCESS") && is_bookkeeping(".part-0.crc"));
        assert!(!is_bookkeeping("year=2024/part-0.parquet"));
    }

    #[test]
    fn a_folder_is_walked_in_path_order_without_bookkeeping() {
        let dir = tempfile::tempdir().unwrap();
        for name in [
            "b/2.csv",
            "a.jsonl",
            "b/1.csv",
            "_SUCCESS",
            "b/.1.csv.crc",
            "notes.txt",
        ] {
            let path = dir.path().join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, "x").unwrap();
        }
        let (name, found) = local_files(dir.path()).unwrap();
        let input = shards(name, found, None).unwrap();
        let rels: Vec<_> = input.shards.iter().map(|s| s.rel.as_str()).collect();
        assert_eq!(rels, ["a.jsonl", "b/1.csv", "b/2.csv"]);
        assert_eq!(input.skipped, ["notes.txt"]);
        let (name, found) = local_files(dir.path()).unwrap();
        let forced = shards(name, found, Some(Format::Csv)).unwrap();
        assert_eq!(forced.shards.len(), 4, "--format reads every data file");
        let (name, file) = local_files(&dir.path().join("notes.txt")).unwrap();
        let err = shards(name, file, None).unwrap_err().to_string();
        assert!(err.contains("give --format"), "{err}");
    }
}
