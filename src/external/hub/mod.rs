//! Models by Hugging Face Hub id (`owner/name[@revision]`), downloaded with the `hf-hub` crate
//! into the Hub's standard cache (`HF_HUB_CACHE`, else `$HF_HOME/hub`:
//! `models--owner--name/{blobs,snapshots/<commit>,refs/<revision>}`), so a node's cache is
//! shared with Python tools. hf-hub reads `HF_ENDPOINT` (a mirror) and `HF_TOKEN` (gated models)
//! itself; this layer never logs the token.
//!
//! The revision is resolved to its commit first (`/api/models/{id}/revision/{rev}`), and every
//! file is then fetched at that commit, so a push during the download cannot mix two commits;
//! `refs/{rev}` records the commit once the model is complete. What hf-hub 1.0.0 lacks (read in
//! its source: `repository/download.rs`, `cache/storage.rs`), this layer adds:
//!
//! * **hash checks**: hf-hub stores whatever bytes arrive under the etag's name; [`verify`]
//!   checks each file against that name (sha256 for LFS files, git blob sha1 for small ones)
//!   and removes a file that fails from the cache;
//! * **one download per node**: hf-hub's per-blob lock is taken after it saw the blob missing
//!   and the blob is not looked for again once the lock is held, and it gives up after 10 s, so
//!   two workers both download; here a lock per file is held around the whole download, and a
//!   file already in the snapshot and verified is not asked for again;
//! * **resume**: hf-hub writes `blobs/<etag>.incomplete` and renames it only when complete;
//!   after a cut-off download the next one truncates it and starts over. [`resume`] asks for the
//!   rest alone first, so a large file cut off near its end costs only what is missing.

mod id;
mod resume;
mod verify;

pub use id::{HubId, DEFAULT_REVISION};

use super::file_lock::FileLock;
use super::gcs::{FetchedModel, FileList};
use hf_hub::{HFClient, HFError, RepoTypeModel};
use std::path::{Path, PathBuf};

/// Errors fetching a model from the Hub, each worded for the person who set `--model`.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// The Hub has no model of that id.
    #[error("the Hub has no model {repo:?} (nor is it a local path)")]
    RepoNotFound {
        /// `owner/name`.
        repo: String,
    },
    /// The model has no such branch, tag or commit.
    #[error("the Hub's model {repo:?} has no revision {revision:?} (a branch, tag or commit sha)")]
    RevisionNotFound {
        /// `owner/name`.
        repo: String,
        /// The revision asked for.
        revision: String,
    },
    /// 401 or 403: the model is gated or private and no (or no good) token was sent.
    #[error(
        "the Hub refused access to {repo:?} ({status}): the model is gated or private (the Hub \
         also answers so for a model it does not show, nor is it a local path); set HF_TOKEN to \
         a token of an account that may read it (for a gated model, one that has accepted its \
         terms on the model's page)"
    )]
    Denied {
        /// `owner/name`.
        repo: String,
        /// 401 or 403.
        status: u16,
    },
    /// 401 with the Hub saying the credentials are invalid: the token sent is no account's
    /// (mistyped, revoked, expired), whatever the model.
    #[error(
        "the Hub rejected the token in HF_TOKEN for {repo:?} ({hub:?}): it is not a valid token \
         (mistyped, revoked or expired); set HF_TOKEN to a current token, or unset it for a public \
         model"
    )]
    TokenRejected {
        /// `owner/name`.
        repo: String,
        /// The Hub's own words.
        hub: String,
    },
    /// A file the model needs is not in the repository.
    #[error("{repo}@{commit}: the model needs {file}, and the repository has no such file")]
    MissingFile {
        /// `owner/name`.
        repo: String,
        /// The commit fetched.
        commit: String,
        /// The missing file.
        file: String,
    },
    /// The connection broke before the whole file came.
    #[error(
        "{repo}: the download of {file} was cut off ({detail}); nothing partial was put in \
         place: run again to resume it"
    )]
    CutOff {
        /// `owner/name`.
        repo: String,
        /// The file.
        file: String,
        /// The transport's error.
        detail: String,
    },
    /// The bytes do not hash to what the Hub said; the file was removed from the cache.
    #[error("{repo}: {file}: hash mismatch ({got}, the Hub says {want}); removed from the cache")]
    HashMismatch {
        /// `owner/name`.
        repo: String,
        /// The file.
        file: String,
        /// What the bytes hash to.
        got: String,
        /// What the Hub said.
        want: String,
    },
    /// The Hub gave no sha256 or git sha1 for the file, so it cannot be checked.
    #[error("{repo}: {file}: the Hub gave no sha256 or git sha1 to check it against ({detail})")]
    NoHash {
        /// `owner/name`.
        repo: String,
        /// The file.
        file: String,
        /// What it gave.
        detail: String,
    },
    /// An answer this layer cannot use (a commit that is no sha, a file name that leaves the
    /// snapshot).
    #[error("{repo}: {what}")]
    Malformed {
        /// `owner/name`.
        repo: String,
        /// What was wrong.
        what: String,
    },
    /// Any other failure of the Hub or of the way to it.
    #[error("{repo}: {source}")]
    Hub {
        /// `owner/name`.
        repo: String,
        /// hf-hub's error.
        #[source]
        source: Box<HFError>,
    },
    /// The Hub could not be asked (offline, unreachable, no answer in time) and the cache has
    /// no complete copy of the revision.
    #[error(
        "{repo}@{revision}: {why}, and the Hub cache ({}) has no complete copy of it (run once \
         with the Hub reachable, or mount a filled cache)",
        cache.display()
    )]
    NotCached {
        /// `owner/name`.
        repo: String,
        /// The revision asked for.
        revision: String,
        /// Why the Hub was not asked, or what asking it gave.
        why: String,
        /// The cache looked in.
        cache: PathBuf,
    },
    /// The local cache could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// Where the Hub is and who asks; what is left unset hf-hub takes from the environment
/// (`HF_ENDPOINT`, `HF_TOKEN`, `HF_HUB_CACHE` / `HF_HOME`), as Python's huggingface_hub does.
#[derive(Clone, Default)]
pub struct HubSettings {
    /// The Hub or a mirror (`https://huggingface.co`).
    pub endpoint: Option<String>,
    /// An access token, for gated and private models.
    pub token: Option<String>,
    /// The Hub cache directory.
    pub cache_dir: Option<PathBuf>,
}

impl std::fmt::Debug for HubSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubSettings")
            .field("endpoint", &self.endpoint)
            .field("token", &self.token.as_ref().map(|_| "<hidden>"))
            .field("cache_dir", &self.cache_dir)
            .finish()
    }
}

/// A client of the Hub, with its cache.
#[derive(Clone)]
pub struct Hub {
    client: HFClient,
    /// The token requests carry (kept for the one request hf-hub cannot make: see `resume`).
    token: Option<String>,
}

impl Hub {
    /// A client with `settings`, the rest from the environment.
    pub fn new(settings: &HubSettings) -> Result<Self, HubError> {
        // Every request bounded: a connection within CONNECT_TIMEOUT, and no read that waits
        // past READ_TIMEOUT (hf-hub's own client has neither: a Hub that accepts and never
        // answers held `models check` past 90 s).
        let http = reqwest::Client::builder()
            .user_agent(USER_AGENT)
            .connect_timeout(CONNECT_TIMEOUT)
            .read_timeout(READ_TIMEOUT)
            .build()
            .map_err(|e| HubError::Hub {
                repo: String::new(),
                source: Box::new(HFError::Request {
                    source: e,
                    url: None,
                }),
            })?;
        let mut b = HFClient::builder().client(http);
        if let Some(e) = &settings.endpoint {
            b = b.endpoint(e.clone());
        }
        if let Some(t) = &settings.token {
            b = b.token(t.clone());
        }
        if let Some(c) = &settings.cache_dir {
            b = b.cache_dir(c.clone());
        }
        let client = b.build().map_err(|e| HubError::Hub {
            repo: String::new(),
            source: Box::new(e),
        })?;
        let token = settings
            .token
            .clone()
            .or_else(|| std::env::var("HF_TOKEN").ok());
        Ok(Self { client, token })
    }

    /// The Hub (or mirror) this client asks.
    pub fn endpoint(&self) -> &str {
        self.client.endpoint()
    }

    /// The Hub cache directory.
    pub fn cache_dir(&self) -> &Path {
        self.client.cache_dir()
    }

    /// Fetches the model `id` into the cache (see the module docs) and returns its snapshot
    /// directory: first its `index` file (`modules.json`) where the repository has one, then
    /// the files `files` lists for that directory (the model layer's list,
    /// `model::spec::model_files`, as for gs://). A missing optional file is skipped; a missing
    /// required one, an unknown repository or revision, a refusal, a cut-off download or a hash
    /// mismatch is an error.
    ///
    /// Where the Hub cannot be asked (`HF_HUB_OFFLINE=1`, as transformers honours it; or no
    /// answer within `HF_HUB_ETAG_TIMEOUT` seconds (10 unset), a transport error, a 5xx or 429)
    /// the cache's complete copy
    /// of the revision is used instead, saying so in the log: a fleet of Spot workers
    /// restarting during a Hub outage starts from its cache. An answer of the Hub's (no such
    /// model or revision, access refused) is not overridden by the cache.
    pub async fn fetch_model(
        &self,
        id: &HubId,
        index: &str,
        files: impl FnOnce(&Path) -> FileList,
    ) -> Result<FetchedModel, HubError> {
        let commit = if offline() {
            Err("HF_HUB_OFFLINE is set".to_string())
        } else {
            let wait = ask_timeout();
            match tokio::time::timeout(wait, self.commit(id)).await {
                Ok(Ok(commit)) => Ok(commit),
                Ok(Err(e)) if !e.is_unreachable() => return Err(e),
                Ok(Err(e)) => Err(format!("the Hub could not be asked ({e})")),
                Err(_) => Err(format!("the Hub did not answer within {wait:?}")),
            }
        };
        let commit = match commit {
            Ok(commit) => commit,
            Err(why) => return self.cached(id, files, why).await,
        };
        let snapshot = Snapshot::new(self, id, commit);
        let mut downloaded = snapshot.fetch(&[], &[index.to_string()]).await?;
        let list = files(&snapshot.dir);
        downloaded.extend(snapshot.fetch(&list.required, &list.optional).await?);
        snapshot.write_ref()?;
        Ok(FetchedModel {
            dir: snapshot.dir,
            downloaded,
        })
    }

    /// The cache's complete copy of `id`'s revision, without asking the Hub (`why` says why
    /// not): the commit a commit sha names, or the one `refs/<revision>` recorded when the model
    /// was last fetched whole; every required file of `files` present and matching its hash.
    async fn cached(
        &self,
        id: &HubId,
        files: impl FnOnce(&Path) -> FileList,
        why: String,
    ) -> Result<FetchedModel, HubError> {
        let not_cached = |why: String| HubError::NotCached {
            repo: id.repo(),
            revision: id.revision.clone(),
            why,
            cache: self.cache_dir().to_path_buf(),
        };
        let root = self.cache_dir().join(id.cache_folder());
        let commit = if id::is_commit(&id.revision) {
            id.revision.to_ascii_lowercase()
        } else {
            match std::fs::read_to_string(root.join("refs").join(&id.revision)) {
                Ok(c) if id::is_commit(c.trim()) => c.trim().to_ascii_lowercase(),
                _ => return Err(not_cached(why)),
            }
        };
        let snapshot = Snapshot::new(self, id, commit);
        if !snapshot.dir.is_dir() {
            return Err(not_cached(why));
        }
        let list = files(&snapshot.dir);
        for file in list.required.iter().chain(&list.optional) {
            let path = snapshot.dir.join(file);
            let required = list.required.contains(file);
            if !path.exists() && !required {
                continue;
            }
            if !path.exists() || snapshot.verified(file, &path).await.is_err() {
                return Err(not_cached(format!("{why}; {file} is missing or damaged")));
            }
        }
        tracing::warn!(model = %id, commit = %snapshot.commit, reason = %why, "model taken from the Hub cache without asking the Hub");
        Ok(FetchedModel {
            dir: snapshot.dir,
            downloaded: Vec::new(),
        })
    }

    /// The commit `id`'s revision names now.
    async fn commit(&self, id: &HubId) -> Result<String, HubError> {
        let repo = self.client.model(&id.owner, &id.name);
        let info = repo
            .info()
            .revision(id.revision.clone())
            .send()
            .await
            .map_err(|e| hub_error(id, e))?;
        match info.sha {
            Some(sha) if id::is_commit(&sha) => Ok(sha.to_ascii_lowercase()),
            other => Err(HubError::Malformed {
                repo: id.repo(),
                what: format!("revision {:?} gave commit {other:?}", id.revision),
            }),
        }
    }
}

/// One commit of a model in the cache, being filled.
struct Snapshot<'a> {
    repo: hf_hub::HFRepository<RepoTypeModel>,
    id: &'a HubId,
    commit: String,
    /// `models--owner--name` in the cache.
    root: PathBuf,
    /// `snapshots/<commit>` under it.
    dir: PathBuf,
    /// Where this layer's per-file locks live.
    locks: PathBuf,
    /// The Hub asked, and the token, for resuming a cut-off download.
    endpoint: String,
    token: Option<String>,
}

impl<'a> Snapshot<'a> {
    fn new(hub: &Hub, id: &'a HubId, commit: String) -> Self {
        let cache = hub.cache_dir();
        let root = cache.join(id.cache_folder());
        Self {
            repo: hub.client.model(&id.owner, &id.name),
            dir: root.join("snapshots").join(&commit),
            locks: cache.join(".locks").join(id.cache_folder()),
            endpoint: hub.endpoint().trim_end_matches('/').to_string(),
            token: hub.token.clone(),
            root,
            id,
            commit,
        }
    }

    /// Fetches `required` and, where the repository has them, `optional` files; returns those
    /// downloaded this time.
    async fn fetch(
        &self,
        required: &[String],
        optional: &[String],
    ) -> Result<Vec<String>, HubError> {
        let mut downloaded = Vec::new();
        let files = required.iter().map(|f| (f, true));
        for (file, needed) in files.chain(optional.iter().map(|f| (f, false))) {
            if self.fetch_file(file, needed).await? {
                downloaded.push(file.clone());
            }
        }
        Ok(downloaded)
    }

    /// Makes `file` a verified file of the snapshot, under a lock; returns whether it was
    /// downloaded (false: already there, or optional and absent).
    async fn fetch_file(&self, file: &str, required: bool) -> Result<bool, HubError> {
        if !id::is_repo_file(file) {
            return Err(
                self.malformed(format!("{file:?} is not a file name inside the repository"))
            );
        }
        let _lock = self.lock(file).await?;
        let path = self.dir.join(file);
        if path.exists() {
            match self.verified(file, &path).await {
                Ok(()) => return Ok(false),
                Err(e) => {
                    tracing::warn!(error = %e, "cached Hub file is bad; downloading it again")
                }
            }
        }
        if !required && self.marked_absent(file) {
            return Ok(false);
        }
        // The blob's lock too, not only this snapshot file's: two revisions of a repository
        // share blobs (named by etag), and hf-hub streams each into blobs/<etag>.incomplete.
        let blob = self.head(file).await;
        let _blob_lock = match &blob {
            Some((etag, _)) if !id::is_blob_name(etag) => {
                return Err(self.malformed(format!(
                    "the Hub names {file}'s blob {etag:?}, which is no sha256 or git sha1"
                )))
            }
            Some((etag, size)) => {
                let lock = self
                    .lock_named(format!("spotinfer-blob-{etag}.lock"))
                    .await?;
                self.resume(file, etag, *size).await;
                Some(lock)
            }
            None => None,
        };
        let got = self
            .repo
            .download_file()
            .filename(file.to_string())
            .revision(self.commit.clone())
            .send()
            .await;
        match got {
            Ok(_) => self.verified(file, &path).await.map(|()| true),
            Err(HFError::EntryNotFound { .. }) if !required => Ok(false),
            Err(HFError::EntryNotFound { .. }) => Err(HubError::MissingFile {
                repo: self.id.repo(),
                commit: self.commit.clone(),
                file: file.to_string(),
            }),
            Err(e) => Err(file_error(self.id, file, e)),
        }
    }

    /// Checks the cached `file` at `path` against its hash; a file that fails is removed (its
    /// snapshot link and its blob), so no bad copy stays in the cache.
    async fn verified(&self, file: &str, path: &Path) -> Result<(), HubError> {
        let owned = path.to_path_buf();
        let checked = tokio::task::spawn_blocking(move || verify::check(&owned))
            .await
            .map_err(|e| self.io(path, std::io::Error::other(e)))?
            .map_err(|e| self.io(path, e))?;
        let Err(bad) = checked else {
            return Ok(());
        };
        if let Ok(blob) = verify::blob_of(path) {
            let _ = std::fs::remove_file(blob);
        }
        let _ = std::fs::remove_file(path);
        let (repo, file) = (self.id.repo(), file.to_string());
        Err(match bad {
            verify::Unverified::Mismatch(got, want) => HubError::HashMismatch {
                repo,
                file,
                got,
                want,
            },
            verify::Unverified::NoHash(detail) => HubError::NoHash { repo, file, detail },
        })
    }

    /// Whether an earlier fetch of this commit found `file` absent (hf-hub's `.no_exist`
    /// marker, as Python writes it): a commit does not change, so the Hub is not asked again.
    fn marked_absent(&self, file: &str) -> bool {
        self.root
            .join(".no_exist")
            .join(&self.commit)
            .join(file)
            .exists()
    }

    /// Waits for this layer's lock on `file` of this commit.
    async fn lock(&self, file: &str) -> Result<FileLock, HubError> {
        let name = format!(
            "spotinfer-{}-{}.lock",
            self.commit,
            file.replace('/', "%2F")
        );
        self.lock_named(name).await
    }

    /// Waits for the lock file `name` of this repository (a file's, or a blob's: its etag was
    /// checked to be a hash, so no name leaves the folder).
    async fn lock_named(&self, name: String) -> Result<FileLock, HubError> {
        std::fs::create_dir_all(&self.locks).map_err(|e| self.io(&self.locks, e))?;
        let path = self.locks.join(name);
        FileLock::acquire(&path)
            .await
            .map_err(|e| self.io(&path, e))
    }

    /// Records the commit the revision named (`refs/<revision>`), as the Hub's tools do; a
    /// commit sha needs no ref.
    fn write_ref(&self) -> Result<(), HubError> {
        if self.id.revision.eq_ignore_ascii_case(&self.commit) {
            return Ok(());
        }
        let path = self.root.join("refs").join(&self.id.revision);
        let parent = path.parent().unwrap_or(&self.root);
        std::fs::create_dir_all(parent).map_err(|e| self.io(parent, e))?;
        let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
        std::fs::write(&tmp, &self.commit).map_err(|e| self.io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| self.io(&path, e))
    }

    fn malformed(&self, what: String) -> HubError {
        HubError::Malformed {
            repo: self.id.repo(),
            what,
        }
    }

    fn io(&self, path: &Path, source: std::io::Error) -> HubError {
        HubError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// hf-hub's error for a request about the repository or revision, in this layer's words.
fn hub_error(id: &HubId, e: HFError) -> HubError {
    let repo = id.repo();
    match e {
        // The Hub's wording for a token that is no account's (huggingface_hub tells it apart
        // from a gated or private repo by the same message).
        HFError::AuthRequired { context }
            if context
                .server_message
                .as_deref()
                .is_some_and(|m| m.contains("Invalid credentials")) =>
        {
            HubError::TokenRejected {
                repo,
                hub: context.server_message.unwrap_or_default(),
            }
        }
        HFError::AuthRequired { .. } => HubError::Denied { repo, status: 401 },
        HFError::Forbidden { .. } => HubError::Denied { repo, status: 403 },
        HFError::RepoNotFound { .. } => HubError::RepoNotFound { repo },
        // The revision endpoint's 404 is hf-hub's RevisionNotFound even for an unknown repo;
        // the Hub says which in X-Error-Code.
        HFError::RevisionNotFound { context, .. }
            if context.as_ref().and_then(|c| c.error_code.as_deref()) == Some("RepoNotFound") =>
        {
            HubError::RepoNotFound { repo }
        }
        HFError::RevisionNotFound { .. } => HubError::RevisionNotFound {
            repo,
            revision: id.revision.clone(),
        },
        other => HubError::Hub {
            repo,
            source: Box::new(other),
        },
    }
}

impl HubError {
    /// Whether the Hub gave no answer of its own (a transport error, a timeout, a 5xx or a 429),
    /// as against one it gave (no such model or revision, access refused, a malformed reply):
    /// only the first lets the cache stand in for it.
    fn is_unreachable(&self) -> bool {
        match self {
            HubError::Hub { source, .. } => match source.as_ref() {
                HFError::Http { context } => {
                    context.status.is_server_error() || context.status.as_u16() == 429
                }
                HFError::Request { .. } | HFError::RateLimited { .. } => true,
                _ => false,
            },
            HubError::CutOff { .. } => true,
            _ => false,
        }
    }
}

/// Whether `HF_HUB_OFFLINE` asks for no Hub request at all (`1`, `true`, `yes`, `on`, as
/// huggingface_hub reads it).
fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

/// The client's name in its requests.
const USER_AGENT: &str = concat!("spotinfer/", env!("CARGO_PKG_VERSION"));
/// The longest a connection to the Hub may take to open.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// The longest any read from the Hub may wait for bytes (a download is not bounded as a whole,
/// only its stalls).
pub const READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The longest the Hub is waited for to name a revision's commit before the cache is used:
/// `HF_HUB_ETAG_TIMEOUT` seconds, huggingface_hub's setting for its metadata requests, else 10.
fn ask_timeout() -> std::time::Duration {
    let seconds = std::env::var("HF_HUB_ETAG_TIMEOUT")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(10.0);
    std::time::Duration::from_secs_f64(seconds)
}

/// hf-hub's error for a file's download, in this layer's words.
fn file_error(id: &HubId, file: &str, e: HFError) -> HubError {
    match e {
        HFError::Request { source, .. } if source.is_body() || source.is_decode() => {
            HubError::CutOff {
                repo: id.repo(),
                file: file.to_string(),
                detail: error_chain(&source),
            }
        }
        other => hub_error(id, other),
    }
}

/// An error and its sources, `: `-separated.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        s.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    s
}
