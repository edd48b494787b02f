//! A cached file checked against the hash the Hub gave for it.
//!
//! hf-hub names each blob after the file's etag (`X-Linked-Etag`, else `ETag`): the sha256 of an
//! LFS file, the git blob sha1 (`sha1("blob {len}\0" + bytes)`) of a small one. It checks neither
//! (hf-hub 1.0.0: `download_file_to_cache_network` streams the body to `.incomplete` and renames
//! it, no digest anywhere in `repository/download.rs`), so this layer does, from the name the
//! snapshot's link points at.

use std::io::Read;
use std::path::{Path, PathBuf};

/// What a snapshot file's check found wrong.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Unverified {
    /// Its blob's name is no sha256 or git sha1 (or the file is no link to a blob).
    NoHash(String),
    /// Its bytes hash to something else: (what they hash to, what the Hub said).
    Mismatch(String, String),
}

/// The hash a blob name promises.
enum Expected {
    Sha256(String),
    GitSha1(String),
}

impl Expected {
    fn from_blob_name(name: &str) -> Option<Self> {
        let hex = name.bytes().all(|b| b.is_ascii_hexdigit());
        match name.len() {
            64 if hex => Some(Self::Sha256(name.to_ascii_lowercase())),
            40 if hex => Some(Self::GitSha1(name.to_ascii_lowercase())),
            _ => None,
        }
    }
}

/// The blob a snapshot entry links to.
pub(super) fn blob_of(snapshot_file: &Path) -> std::io::Result<PathBuf> {
    let target = std::fs::read_link(snapshot_file)?;
    Ok(snapshot_file
        .parent()
        .unwrap_or(Path::new("."))
        .join(target))
}

/// Checks the snapshot file at `path` against the hash its blob is named by.
pub(super) fn check(path: &Path) -> std::io::Result<Result<(), Unverified>> {
    let blob = match blob_of(path) {
        Ok(blob) => blob,
        Err(_) => return Ok(Err(Unverified::NoHash("not a link to a blob".into()))),
    };
    let name = blob
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    let Some(want) = Expected::from_blob_name(name) else {
        return Ok(Err(Unverified::NoHash(format!("etag {name:?}"))));
    };
    let (kind, got, want) = match want {
        Expected::Sha256(w) => ("sha256", digest::<sha2::Sha256>(path, "")?, w),
        Expected::GitSha1(w) => ("git sha1", git_sha1(path)?, w),
    };
    if got == want {
        Ok(Ok(()))
    } else {
        Ok(Err(Unverified::Mismatch(format!("{kind} {got}"), want)))
    }
}

/// The git blob sha1 of the file at `path`.
fn git_sha1(path: &Path) -> std::io::Result<String> {
    let len = std::fs::metadata(path)?.len();
    digest::<sha1::Sha1>(path, &format!("blob {len}\0"))
}

/// The hex digest of `prefix` then the bytes of the file at `path`, read 1 MiB at a time.
fn digest<D: sha1::Digest>(path: &Path, prefix: &str) -> std::io::Result<String> {
    let mut hasher = D::new();
    hasher.update(prefix.as_bytes());
    let mut file = std::fs::File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            return Ok(hex::encode(hasher.finalize()));
        }
        hasher.update(&buf[..n]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A blob named `name` holding `bytes`, and a snapshot entry linking to it.
    fn cached(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        std::fs::create_dir_all(dir.join("blobs")).unwrap();
        std::fs::create_dir_all(dir.join("snapshots/c")).unwrap();
        std::fs::write(dir.join("blobs").join(name), bytes).unwrap();
        let link = dir.join("snapshots/c/file");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(format!("../../blobs/{name}"), &link).unwrap();
        link
    }

    #[test]
    fn files_are_checked_against_the_hash_their_blob_is_named_by() {
        let dir = tempfile::tempdir().unwrap();
        // `git hash-object` of "hello\n" and sha256 of "hello\n".
        let git = "ce013625030ba8dba906f756967f9e9ca394464a";
        let sha = "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03";
        assert_eq!(check(&cached(dir.path(), git, b"hello\n")).unwrap(), Ok(()));
        assert_eq!(check(&cached(dir.path(), sha, b"hello\n")).unwrap(), Ok(()));
        let bad = check(&cached(dir.path(), sha, b"hellO\n")).unwrap();
        assert!(matches!(bad, Err(Unverified::Mismatch(..))), "{bad:?}");
        let bad = check(&cached(dir.path(), git, b"hellO\n")).unwrap();
        assert!(matches!(bad, Err(Unverified::Mismatch(..))), "{bad:?}");
        let unnamed = check(&cached(dir.path(), "W-abc", b"hello\n")).unwrap();
        assert!(matches!(unnamed, Err(Unverified::NoHash(_))), "{unnamed:?}");
        std::fs::write(dir.path().join("plain"), b"hello\n").unwrap();
        let plain = check(&dir.path().join("plain")).unwrap();
        assert!(matches!(plain, Err(Unverified::NoHash(_))), "{plain:?}");
    }
}
