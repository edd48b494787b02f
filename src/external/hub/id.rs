//! What a model argument names on the Hub: `owner/name[@revision]`, and when it names one.

use std::fmt;
use std::path::Path;

/// The branch a Hub id without `@revision` means.
pub const DEFAULT_REVISION: &str = "main";

/// The prefix that makes a `--model` value a Hub id whatever the local disk holds.
pub const HUB_SCHEME: &str = "hf://";

/// A `--model` value that looks like a Hub id but is refused as one.
#[derive(Debug, thiserror::Error)]
pub enum NotAHubId {
    /// `owner/name` where `owner` is a local folder without `name`.
    #[error(
        "--model {arg}: no such folder, though {folder}/ is a local folder: is a model folder \
         missing (an unmounted volume, a misspelt name)? To fetch the Hub's model of that id \
         instead, write hf://{arg}"
    )]
    MissingFolder {
        /// The value as given.
        arg: String,
        /// The local folder its first part names.
        folder: String,
    },
    /// `hf://` followed by something that is no `owner/name[@revision]`.
    #[error("--model {0}: not a Hub id (hf://owner/name[@revision])")]
    Malformed(String),
}

/// A model repository on the Hugging Face Hub and the revision (branch, tag or commit sha) to
/// fetch, as `owner/name[@revision]` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubId {
    /// The account or organisation (`BAAI`).
    pub owner: String,
    /// The repository (`bge-small-en-v1.5`).
    pub name: String,
    /// A branch, tag or commit sha; `main` unless the id says.
    pub revision: String,
}

impl HubId {
    /// The Hub id a `--model` value names, if it names one. `hf://owner/name[@revision]` always
    /// does. Otherwise an existing local path wins (the default `models/all-MiniLM-L6-v2` has
    /// the Hub-id form too) and a `gs://` URI is not one; a value of the form
    /// `owner/name[@revision]` is, unless `owner` is a local folder: then a model folder is
    /// missing from it (an unmounted volume, a misspelt name), and fetching whichever public
    /// model has that id would compute with the wrong model, so it is refused.
    pub fn from_model_arg(model: &Path) -> Result<Option<Self>, NotAHubId> {
        let arg = model.to_string_lossy();
        if let Some(id) = arg.strip_prefix(HUB_SCHEME) {
            return Self::parse(id)
                .map(Some)
                .ok_or_else(|| NotAHubId::Malformed(arg.to_string()));
        }
        if model.exists() {
            return Ok(None);
        }
        let Some(id) = model.to_str().and_then(Self::parse) else {
            return Ok(None);
        };
        if Path::new(&id.owner).is_dir() {
            return Err(NotAHubId::MissingFolder {
                arg: arg.to_string(),
                folder: id.owner,
            });
        }
        Ok(Some(id))
    }

    /// Parses `owner/name[@revision]`: owner and name as the Hub allows them (letters, digits,
    /// `-`, `_`, `.`; neither `--` nor `..`; no `-` or `.` at either end; at most 96 characters),
    /// the revision a ref name whose `/`-separated parts are plain names.
    pub fn parse(s: &str) -> Option<Self> {
        let (repo, revision) = match s.split_once('@') {
            Some((repo, rev)) => (repo, Some(rev)),
            None => (s, None),
        };
        let (owner, name) = repo.split_once('/')?;
        if !is_repo_part(owner) || !is_repo_part(name) {
            return None;
        }
        let revision = revision.unwrap_or(DEFAULT_REVISION);
        is_revision(revision).then(|| Self {
            owner: owner.to_string(),
            name: name.to_string(),
            revision: revision.to_string(),
        })
    }

    /// `owner/name`.
    pub fn repo(&self) -> String {
        format!("{}/{}", self.owner, self.name)
    }

    /// The repository's folder in the Hub cache: `models--owner--name`.
    pub fn cache_folder(&self) -> String {
        format!("models--{}--{}", self.owner, self.name)
    }
}

impl fmt::Display for HubId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}@{}", self.owner, self.name, self.revision)
    }
}

/// An owner or repository name as the Hub allows it.
fn is_repo_part(s: &str) -> bool {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
    !s.is_empty()
        && s.len() <= 96
        && s.chars().all(allowed)
        && !s.contains("--")
        && !s.contains("..")
        && !s.starts_with(['-', '.'])
        && !s.ends_with(['-', '.'])
}

/// A revision that is safe as a path under the cache's `refs/` (where its commit is recorded).
fn is_revision(s: &str) -> bool {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "-_./".contains(c);
    s.len() <= 255 && s.chars().all(allowed) && s.split('/').all(is_plain_name)
}

/// A path segment that names an entry inside its folder: not empty, `.` or `..`.
pub(super) fn is_plain_name(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".."
}

/// A repository file name that stays inside a snapshot folder: relative, plain segments.
pub(super) fn is_repo_file(s: &str) -> bool {
    !s.contains(['\\', '\0']) && s.split('/').all(is_plain_name)
}

/// Whether `s` can name a blob of the cache: a git sha1 or a sha256 in hex, so nothing a Hub (or
/// a mirror) answers can make a path leave `blobs/`.
pub(super) fn is_blob_name(s: &str) -> bool {
    matches!(s.len(), 40 | 64) && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Whether `s` is a full commit sha (40 hexadecimal digits).
pub(super) fn is_commit(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_parse_with_and_without_a_revision() {
        let id = HubId::parse("BAAI/bge-small-en-v1.5").unwrap();
        assert_eq!(
            (id.owner.as_str(), id.name.as_str(), id.revision.as_str()),
            ("BAAI", "bge-small-en-v1.5", "main")
        );
        assert_eq!(id.cache_folder(), "models--BAAI--bge-small-en-v1.5");
        let pinned = HubId::parse("BAAI/bge-small-en-v1.5@refs/pr/3").unwrap();
        assert_eq!(pinned.revision, "refs/pr/3");
        assert_eq!(pinned.to_string(), "BAAI/bge-small-en-v1.5@refs/pr/3");
        for bad in [
            "bge-small",
            "a/b/c",
            "/b",
            "a/",
            "a--b/c",
            "a/..",
            ".a/b",
            "a/b-",
            "a/b@",
            "a/b@../../etc",
            "a/b@main/../x",
            "a/b@x y",
            "gs://bucket/model",
            "./models/x",
        ] {
            assert_eq!(HubId::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn an_existing_local_path_wins_over_the_hub() {
        // Unit tests run in the package root, where `src/external` is a folder of the Hub-id
        // form, as the default `models/all-MiniLM-L6-v2` is.
        assert!(HubId::parse("src/external").is_some());
        let arg = |s: &str| HubId::from_model_arg(Path::new(s));
        assert_eq!(arg("src/external").unwrap(), None);
        assert_eq!(arg("gs://models/minilm").unwrap(), None);
        // No local folder `acme`: the Hub's.
        let hub = arg("acme/no-such-model@v2").unwrap().unwrap();
        assert_eq!(
            (hub.repo(), hub.revision),
            ("acme/no-such-model".into(), "v2".into())
        );
    }

    #[test]
    fn a_missing_folder_inside_a_local_one_is_not_asked_of_the_hub() {
        let arg = |s: &str| HubId::from_model_arg(Path::new(s));
        let err = arg("src/no-such-model@v2").unwrap_err().to_string();
        assert!(
            err.contains("src/ is a local folder") && err.contains("hf://src/no-such-model@v2"),
            "{err}"
        );
        // hf:// says the Hub is meant, whatever the disk holds.
        let hub = arg("hf://src/external").unwrap().unwrap();
        assert_eq!(
            (hub.repo(), hub.revision),
            ("src/external".into(), "main".into())
        );
        assert!(arg("hf://not-an-id").is_err());
    }

    #[test]
    fn repo_files_stay_inside_the_snapshot() {
        assert!(is_repo_file("1_Pooling/config.json"));
        for bad in ["../x", "a/../../x", "/etc/passwd", "a//b", "a\\b", ""] {
            assert!(!is_repo_file(bad), "{bad}");
        }
    }
}
