//! Models by Hugging Face Hub id, against a stand-in for the Hub's HTTP API
//! (tests/fixtures/hub/fake_hub.py, started here on a free port) serving the all-MiniLM-L6-v2
//! folder: the Hub's cache layout, a model equal to the local folder's, one download per file
//! however many fetch at once, and the failures a user meets (unknown repo or revision, a gated
//! model without HF_TOKEN, a missing file, a cut-off download, a wrong hash).

mod common;

use common::*;
use spotinfer::external::gcs::FileList;
use spotinfer::external::hub::{Hub, HubError, HubId, HubSettings};
use spotinfer::model::{DeviceChoice, TextModel};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The commit the fake Hub gives every revision (`sha1(b"fake hub commit")`).
const COMMIT: &str = "fb57058b033f9569deb3462b1f229cc1d644c997";
const MINILM: &str = "sentence-transformers/all-MiniLM-L6-v2";
const TOKEN: &str = "hf_test_token_never_printed";

/// The fake Hub, killed when dropped.
struct FakeHub {
    child: Child,
    endpoint: String,
    _config: tempfile::TempDir,
}

impl FakeHub {
    /// Serves the model folder as MINILM, `acme/gated` (needs TOKEN), `acme/lean` (without its
    /// optional files) and `acme/broken` (without config.json), with `faults` added to the
    /// config (`cut_once`, `corrupt`).
    fn start(faults: serde_json::Value) -> Self {
        let dir = model_dir();
        let mut config = serde_json::json!({ "repos": {
            MINILM: { "dir": dir },
            "acme/gated": { "dir": dir, "token": TOKEN },
            "acme/lean": { "dir": dir, "missing": ["tokenizer_config.json", "config_sentence_transformers.json"] },
            "acme/broken": { "dir": dir, "missing": ["config.json"] },
            "acme/clip": { "dir": fixture("images/models/clip") },
            "acme/llama": { "dir": fixture("llm/models/llama") },
        }});
        if let (Some(c), Some(f)) = (config.as_object_mut(), faults.as_object()) {
            c.extend(f.clone());
        }
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("hub.json");
        std::fs::write(&path, config.to_string()).unwrap();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hub/fake_hub.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg(&path)
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 runs the fake Hub");
        let mut port = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut port)
            .unwrap();
        Self {
            child,
            endpoint: format!("http://127.0.0.1:{}", port.trim()),
            _config: tmp,
        }
    }

    /// How many times each file's bytes were sent (whole or cut off).
    fn counts(&self) -> HashMap<String, u64> {
        self.ask("/_counts")
    }

    /// The byte each send of a file's bytes started at.
    fn starts(&self) -> HashMap<String, Vec<u64>> {
        self.ask("/_starts")
    }

    /// The fake's own JSON answer at `path`.
    fn ask<T: serde::de::DeserializeOwned>(&self, path: &str) -> T {
        let addr = self.endpoint.trim_start_matches("http://");
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
        let mut reply = String::new();
        s.read_to_string(&mut reply).unwrap();
        let body = reply.split("\r\n\r\n").nth(1).unwrap();
        serde_json::from_str(body).unwrap()
    }

    fn hub(&self, cache: &Path) -> Hub {
        Hub::new(&HubSettings {
            endpoint: Some(self.endpoint.clone()),
            token: None,
            cache_dir: Some(cache.to_path_buf()),
        })
        .unwrap()
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn model_files(dir: &Path) -> FileList {
    let files = spotinfer::model::spec::model_files(dir);
    FileList {
        required: files.required,
        optional: files.optional,
    }
}

async fn fetch(hub: &Hub, id: &str) -> Result<spotinfer::external::gcs::FetchedModel, HubError> {
    let id = HubId::parse(id).unwrap();
    hub.fetch_model(&id, "modules.json", model_files).await
}

/// `spotinfer models check MODEL` run in an empty directory (so the id is no local path), with
/// the Hub at `hub`, the cache at `cache` and no token.
fn models_check_command(hub: &FakeHub, cache: &Path, model: &str) -> Command {
    let cwd = cache.join("empty-cwd");
    std::fs::create_dir_all(&cwd).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_spotinfer"));
    cmd.args(["models", "check", model])
        .current_dir(&cwd)
        .env("HF_ENDPOINT", &hub.endpoint)
        .env("HF_HUB_CACHE", cache)
        .env("HF_HOME", cache.join("no-hf-home"))
        .env_remove("HF_TOKEN")
        .env_remove("SPOTINFER_MODEL")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// A "Hub" that takes connections and never answers, for as long as the test runs.
fn silent_hub() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    });
    endpoint
}

/// `models check MODEL` with the Hub at `endpoint` (and `extra` variables): whether it
/// succeeded, its output, and how long it took.
fn models_check_at(
    endpoint: &str,
    cache: &Path,
    model: &str,
    extra: &[(&str, &str)],
) -> (bool, String, std::time::Duration) {
    let cwd = cache.join("empty-cwd");
    std::fs::create_dir_all(&cwd).unwrap();
    let started = std::time::Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_spotinfer"))
        .args(["models", "check", model])
        .current_dir(&cwd)
        .env("HF_ENDPOINT", endpoint)
        .env("HF_HUB_CACHE", cache)
        .env("HF_HOME", cache.join("no-hf-home"))
        .env_remove("HF_TOKEN")
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("SPOTINFER_MODEL")
        // huggingface_hub's metadata timeout, which spotinfer takes too (10 s unset).
        .env("HF_HUB_ETAG_TIMEOUT", "3")
        .envs(extra.iter().copied())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text, started.elapsed())
}

/// A node with a complete cache starts while the Hub is out: with `HF_HUB_OFFLINE=1` it asks
/// nothing; with a Hub that takes the connection and never answers, it gives up on it within
/// the bound and takes the cache, saying so; with an empty cache both fail within the bound,
/// naming the cache. A revision pinned to a commit starts from the cache the same way.
#[test]
fn a_node_with_a_complete_cache_starts_while_the_hub_is_out() {
    let cache = tempfile::tempdir().unwrap();
    {
        let hub = FakeHub::start(serde_json::json!({}));
        let (ok, out) = models_check(&hub, cache.path(), MINILM, None);
        assert!(ok, "{out}");
    }
    let silent = silent_hub();
    let pinned = format!("{MINILM}@{COMMIT}");
    for model in [MINILM, pinned.as_str()] {
        let (ok, out, took) = models_check_at(&silent, cache.path(), model, &[]);
        assert!(ok, "{model}: {out}");
        assert!(out.contains("without asking the Hub"), "{model}: {out}");
        assert!(
            took < std::time::Duration::from_secs(45),
            "{model}: {took:?}"
        );
        let (ok, out, took) =
            models_check_at(&silent, cache.path(), model, &[("HF_HUB_OFFLINE", "1")]);
        assert!(
            ok && out.contains("HF_HUB_OFFLINE is set"),
            "{model}: {out}"
        );
        assert!(
            took < std::time::Duration::from_secs(30),
            "{model}: {took:?}"
        );
    }
    let empty = tempfile::tempdir().unwrap();
    let (ok, out, took) = models_check_at(&silent, empty.path(), MINILM, &[]);
    assert!(!ok && out.contains("did not answer within 3s"), "{out}");
    assert!(out.contains("has no complete copy"), "{out}");
    assert!(took < std::time::Duration::from_secs(30), "{took:?}");
    let (ok, out, _) = models_check_at(&silent, empty.path(), MINILM, &[("HF_HUB_OFFLINE", "1")]);
    assert!(!ok && out.contains("has no complete copy"), "{out}");
}

/// [`models_check_command`] run, with `HF_TOKEN` set to `token` if given: whether it succeeded,
/// and its output.
fn models_check(hub: &FakeHub, cache: &Path, model: &str, token: Option<&str>) -> (bool, String) {
    let mut cmd = models_check_command(hub, cache, model);
    if let Some(t) = token {
        cmd.env("HF_TOKEN", t);
    }
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The line of `models check` output that starts with `key`.
fn line<'a>(out: &'a str, key: &str) -> &'a str {
    out.lines()
        .find(|l| l.starts_with(key))
        .unwrap_or_else(|| panic!("no {key:?} in {out}"))
}

fn snapshot(cache: &Path, repo: &str) -> PathBuf {
    let folder = format!("models--{}", repo.replace('/', "--"));
    cache.join(folder).join("snapshots").join(COMMIT)
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

/// The git blob sha1 of `bytes`: what the Hub names a small file by.
fn git_sha1_hex(bytes: &[u8]) -> String {
    use sha1::Digest;
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {}\0", bytes.len()).as_bytes());
    h.update(bytes);
    hex::encode(h.finalize())
}

#[test]
fn a_model_by_hub_id_lands_in_the_hub_cache_and_is_the_local_model() {
    let hub = FakeHub::start(serde_json::json!({}));
    let cache = tempfile::tempdir().unwrap();
    let (ok, out) = models_check(&hub, cache.path(), MINILM, None);
    assert!(ok, "{out}");
    let (ok, local) = models_check(&hub, cache.path(), model_dir().to_str().unwrap(), None);
    assert!(ok, "{local}");
    assert_eq!(line(&out, "weights hash:"), line(&local, "weights hash:"));
    assert_eq!(line(&out, "computed:"), line(&local, "computed:"));

    // The Hub's layout: refs/main names the commit, each snapshot file links to its blob,
    // the LFS file's blob is named by its sha256; every file is the local folder's.
    let root = cache
        .path()
        .join("models--sentence-transformers--all-MiniLM-L6-v2");
    assert_eq!(
        std::fs::read_to_string(root.join("refs/main")).unwrap(),
        COMMIT
    );
    let snap = snapshot(cache.path(), MINILM);
    for f in MODEL_FILES {
        let link = std::fs::read_link(snap.join(f)).unwrap();
        assert!(
            link.starts_with("../..") && link.to_str().unwrap().contains("blobs/"),
            "{f}: {link:?}"
        );
        assert_eq!(
            std::fs::read(snap.join(f)).unwrap(),
            std::fs::read(model_dir().join(f)).unwrap(),
            "{f} differs"
        );
    }
    let weights = std::fs::read(model_dir().join("model.safetensors")).unwrap();
    assert!(root.join("blobs").join(sha256_hex(&weights)).is_file());

    // Its embedding of a text is the local folder's, exactly.
    let text = ["a model from the Hub"];
    let cached = TextModel::load(&snap, DeviceChoice::Cpu).unwrap();
    let local = TextModel::load(&model_dir(), DeviceChoice::Cpu).unwrap();
    assert_eq!(
        cached.embed(&text).unwrap().vectors,
        local.embed(&text).unwrap().vectors
    );

    // Each file was sent once; a second run downloads nothing.
    let sent = hub.counts();
    assert!(
        MODEL_FILES.iter().all(|f| sent.get(*f) == Some(&1)),
        "{sent:?}"
    );
    let (ok, again) = models_check(&hub, cache.path(), MINILM, None);
    assert!(ok, "{again}");
    assert_eq!(hub.counts(), sent);
}

/// A fixture folder under tests/fixtures.
fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

/// Image and generation models by Hub id bring what their loaders read beside the encoder's
/// files: the image processor, the generation defaults and the chat template.
#[test]
fn image_and_generation_models_by_hub_id_bring_their_other_files() {
    let hub = FakeHub::start(serde_json::json!({}));
    let cache = tempfile::tempdir().unwrap();
    for (repo, dir, files) in [
        (
            "acme/clip",
            "images/models/clip",
            &["preprocessor_config.json"][..],
        ),
        (
            "acme/llama",
            "llm/models/llama",
            &["generation_config.json", "chat_template.jinja"][..],
        ),
    ] {
        let (ok, out) = models_check(&hub, cache.path(), repo, None);
        assert!(ok, "{repo}: {out}");
        let snap = snapshot(cache.path(), repo);
        for f in files {
            assert_eq!(
                std::fs::read(snap.join(f)).ok(),
                std::fs::read(fixture(dir).join(f)).ok(),
                "{repo}: {f}"
            );
        }
    }
}

#[test]
fn a_gated_model_needs_hf_token_and_the_token_is_never_printed() {
    let hub = FakeHub::start(serde_json::json!({}));
    let cache = tempfile::tempdir().unwrap();
    let (ok, out) = models_check(&hub, cache.path(), "acme/gated", None);
    assert!(!ok, "{out}");
    assert!(
        out.contains("refused access") && out.contains("set HF_TOKEN"),
        "{out}"
    );
    // A token that is no account's is rejected as such, on a gated model and on a public one,
    // with the Hub's own words, and is never printed.
    let wrong = "hf_wrong_token_never_printed";
    for model in ["acme/gated", MINILM] {
        let (ok, out) = models_check(&hub, cache.path(), model, Some(wrong));
        assert!(
            !ok && out.contains("rejected the token in HF_TOKEN")
                && out.contains("Invalid credentials in Authorization header")
                && !out.contains("set HF_TOKEN to a token of an account")
                && !out.contains(wrong),
            "{out}"
        );
    }
    let (ok, out) = models_check(&hub, cache.path(), "acme/gated", Some(TOKEN));
    assert!(ok && !out.contains(TOKEN), "{out}");
    let help = Command::new(env!("CARGO_BIN_EXE_spotinfer"))
        .args(["help", "work"])
        .env("HF_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&help.stdout).contains(TOKEN));
}

/// `owner/name` where `owner/` is a local folder without `name` (a volume not mounted) is
/// refused without a request to the Hub; `hf://owner/name` fetches the Hub's model all the same.
#[test]
fn a_missing_folder_inside_a_local_one_is_refused_not_fetched() {
    let hub = FakeHub::start(serde_json::json!({}));
    let cache = tempfile::tempdir().unwrap();
    let owner = MINILM.split('/').next().unwrap();
    std::fs::create_dir_all(cache.path().join("empty-cwd").join(owner)).unwrap();
    let (ok, out) = models_check(&hub, cache.path(), MINILM, None);
    assert!(
        !ok && out.contains(&format!("{owner}/ is a local folder"))
            && out.contains(&format!("hf://{MINILM}")),
        "{out}"
    );
    assert!(
        hub.counts().is_empty(),
        "the Hub was asked: {:?}",
        hub.counts()
    );
    let (ok, out) = models_check(&hub, cache.path(), &format!("hf://{MINILM}"), None);
    assert!(ok, "{out}");
    assert!(
        hub.counts().contains_key("model.safetensors"),
        "{:?}",
        hub.counts()
    );
}

#[test]
fn workers_starting_at_once_download_each_file_once() {
    // Each file takes half a second to send, so the three workers' downloads overlap.
    let hub = FakeHub::start(serde_json::json!({ "slow_seconds": 0.5 }));
    let cache = tempfile::tempdir().unwrap();
    let workers: Vec<_> = (0..3)
        .map(|_| {
            models_check_command(&hub, cache.path(), MINILM)
                .spawn()
                .unwrap()
        })
        .collect();
    for w in workers {
        let out = w.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let sent = hub.counts();
    assert!(
        MODEL_FILES.iter().all(|f| sent.get(*f) == Some(&1)),
        "{sent:?}"
    );
}

/// Two revisions of one repository (two commits, the same files) fetched at once share their
/// blobs: each blob is downloaded once, and both snapshots are whole.
#[test]
fn two_revisions_at_once_download_each_shared_blob_once() {
    let hub = FakeHub::start(serde_json::json!({ "slow_seconds": 0.5 }));
    let cache = tempfile::tempdir().unwrap();
    let workers: Vec<_> = ["main", "v2"]
        .iter()
        .map(|rev| {
            models_check_command(&hub, cache.path(), &format!("{MINILM}@{rev}"))
                .spawn()
                .unwrap()
        })
        .collect();
    for w in workers {
        let out = w.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
    }
    let sent = hub.counts();
    assert!(
        MODEL_FILES.iter().all(|f| sent.get(*f) == Some(&1)),
        "{sent:?}"
    );
    let snapshots = cache
        .path()
        .join("models--sentence-transformers--all-MiniLM-L6-v2/snapshots");
    assert_eq!(std::fs::read_dir(&snapshots).unwrap().count(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revisions_missing_files_and_unknown_models() {
    let fake = FakeHub::start(serde_json::json!({}));
    let cache = tempfile::tempdir().unwrap();
    let hub = fake.hub(cache.path());

    // A tag and a commit sha: the tag's ref is recorded, the same snapshot serves both.
    let tagged = fetch(&hub, &format!("{MINILM}@v1.0")).await.unwrap();
    assert_eq!(tagged.dir, snapshot(cache.path(), MINILM));
    let root = cache
        .path()
        .join("models--sentence-transformers--all-MiniLM-L6-v2");
    assert_eq!(
        std::fs::read_to_string(root.join("refs/v1.0")).unwrap(),
        COMMIT
    );
    let pinned = fetch(&hub, &format!("{MINILM}@{COMMIT}")).await.unwrap();
    assert!(pinned.downloaded.is_empty(), "{pinned:?}");

    // Optional files the repo lacks are skipped (and remembered: not asked for again).
    let lean = fetch(&hub, "acme/lean").await.unwrap();
    assert!(!lean.dir.join("tokenizer_config.json").exists());
    assert!(TextModel::load(&lean.dir, DeviceChoice::Cpu).is_ok());
    let sent = fake.counts();
    let again = fetch(&hub, "acme/lean").await.unwrap();
    assert!(again.downloaded.is_empty(), "{again:?}");
    assert_eq!(fake.counts(), sent);

    let err = fetch(&hub, "acme/broken").await.unwrap_err();
    assert!(
        matches!(&err, HubError::MissingFile { file, .. } if file == "config.json"),
        "{err}"
    );
    let err = fetch(&hub, "nobody/nothing").await.unwrap_err();
    assert!(matches!(err, HubError::RepoNotFound { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("the Hub has no model \"nobody/nothing\""),
        "{err}"
    );
    let err = fetch(&hub, &format!("{MINILM}@no-such-branch"))
        .await
        .unwrap_err();
    assert!(matches!(err, HubError::RevisionNotFound { .. }), "{err}");
}

/// A download cut off halfway is an error with nothing in place; the next fetch asks for the
/// second half alone and ends with the file byte-identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_download_leaves_nothing_in_place_and_the_next_run_resumes_it() {
    let fake = FakeHub::start(serde_json::json!({ "cut_once": ["model.safetensors"] }));
    let cache = tempfile::tempdir().unwrap();
    let hub = fake.hub(cache.path());
    let err = fetch(&hub, MINILM).await.unwrap_err();
    assert!(
        matches!(&err, HubError::CutOff { file, .. } if file == "model.safetensors"),
        "{err}"
    );
    let snap = snapshot(cache.path(), MINILM);
    let weights = std::fs::read(model_dir().join("model.safetensors")).unwrap();
    let blob = cache
        .path()
        .join("models--sentence-transformers--all-MiniLM-L6-v2/blobs")
        .join(sha256_hex(&weights));
    assert!(!snap.join("model.safetensors").exists() && !blob.exists());

    let fetched = fetch(&hub, MINILM).await.unwrap();
    let downloaded = &fetched.downloaded;
    assert!(
        downloaded.contains(&"model.safetensors".to_string()),
        "{downloaded:?}"
    );
    assert!(
        !downloaded.contains(&"config.json".to_string()),
        "{downloaded:?}"
    );
    assert_eq!(
        std::fs::read(snap.join("model.safetensors")).unwrap(),
        weights
    );
    assert_eq!(fake.counts()["model.safetensors"], 2);
    // Resumed: the second send is the second half alone.
    let half = weights.len() as u64 / 2;
    assert_eq!(fake.starts()["model.safetensors"], vec![0, half]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_hash_is_an_error_and_the_bad_file_is_removed() {
    let fake = FakeHub::start(serde_json::json!({ "corrupt": ["tokenizer.json"] }));
    let cache = tempfile::tempdir().unwrap();
    let hub = fake.hub(cache.path());
    let err = fetch(&hub, MINILM).await.unwrap_err();
    assert!(
        matches!(&err, HubError::HashMismatch { file, .. } if file == "tokenizer.json"),
        "{err}"
    );
    assert!(err.to_string().contains("git sha1"), "{err}");
    let snap = snapshot(cache.path(), MINILM);
    assert!(
        !snap.join("tokenizer.json").exists(),
        "the bad file is not in the snapshot"
    );
    let blobs = cache
        .path()
        .join("models--sentence-transformers--all-MiniLM-L6-v2/blobs");
    let tokenizer = std::fs::read(model_dir().join("tokenizer.json")).unwrap();
    assert!(!blobs.join(git_sha1_hex(&tokenizer)).exists());
    let mut served = tokenizer.clone();
    served[0] ^= 0xFF; // what the fake Hub sent
    assert!(std::fs::read_dir(&blobs)
        .unwrap()
        .all(|b| std::fs::read(b.unwrap().path()).unwrap() != served));
}
