//! Starts the Cloud Pub/Sub emulator with the project's fixes, for `spotinfer loadtest`.
//!
//! This is the Rust twin of `scripts/pubsub-emulator.sh`: it finds gcloud's emulator jar,
//! compiles the fixes under `scripts/emulator-fix/` against it (the stream-cancel fix and the
//! streaming-pull flow control; see docs/emulator.md), and runs the emulator's main class with
//! them ahead of the jar on the classpath.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The fixes: (path under the source root, source).
const FIXES: [(&str, &str); 4] = [
    (
        "io/grpc/InternalStatus.java",
        include_str!("../../../scripts/emulator-fix/io/grpc/InternalStatus.java"),
    ),
    (
        "com/google/cloud/pubsub/testing/v1/StreamFlowControl.java",
        include_str!(
            "../../../scripts/emulator-fix/com/google/cloud/pubsub/testing/v1/StreamFlowControl.java"
        ),
    ),
    (
        "com/google/cloud/pubsub/testing/v1/FakePubsubServerXStreamingPullPusher.java",
        include_str!("../../../scripts/emulator-fix/com/google/cloud/pubsub/testing/v1/FakePubsubServerXStreamingPullPusher.java"),
    ),
    (
        "com/google/cloud/pubsub/testing/v1/FakePubsubServerXStreamingPullRequestObserver.java",
        include_str!("../../../scripts/emulator-fix/com/google/cloud/pubsub/testing/v1/FakePubsubServerXStreamingPullRequestObserver.java"),
    ),
];

/// Classes compiled as `FakePubsubServerX…` that replace the inner classes `FakePubsubServer$…`
/// (javac cannot compile a top-level class with an inner class's binary name).
const RENAMED: [&str; 2] = ["StreamingPullPusher", "StreamingPullRequestObserver"];

/// Errors starting the emulator.
#[derive(Debug, thiserror::Error)]
pub enum EmulatorError {
    /// No jar was found.
    #[error("pubsub emulator jar not found: install gcloud's pubsub-emulator component, set PUBSUB_EMULATOR_JAR, or pass PUBSUB_EMULATOR_HOST")]
    NoJar,
    /// javac or java failed.
    #[error("{0}")]
    Start(String),
    /// I/O around the working directory.
    #[error("emulator working directory: {0}")]
    Io(#[from] std::io::Error),
}

/// A running emulator; killed on drop.
#[derive(Debug)]
pub struct Emulator {
    child: Child,
    /// host:port it listens on.
    pub host: String,
    /// Its log file.
    pub log: PathBuf,
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn find_jar() -> Option<PathBuf> {
    if let Some(j) = std::env::var_os("PUBSUB_EMULATOR_JAR") {
        return Some(PathBuf::from(j));
    }
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Ok(out) = Command::new("gcloud")
        .args(["info", "--format=value(installation.sdk_root)"])
        .stderr(Stdio::null())
        .output()
    {
        let s = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !s.is_empty() {
            roots.push(s.into());
        }
    }
    for r in [
        "/usr/lib/google-cloud-sdk",
        "/usr/share/google-cloud-sdk",
        "/opt/google-cloud-sdk",
    ] {
        roots.push(r.into());
    }
    roots.iter().find_map(|r| {
        let lib = r.join("platform/pubsub-emulator/lib");
        std::fs::read_dir(lib)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("cloud-pubsub-emulator-") && n.ends_with(".jar"))
            })
    })
}

/// Compiles [`FIXES`] into `classes` and gives the [`RENAMED`] classes their inner-class names.
fn compile_fixes(jar: &Path, src: &Path, classes: &Path) -> Result<(), EmulatorError> {
    let mut javac = Command::new("javac");
    javac
        .arg("-nowarn")
        .arg("-d")
        .arg(classes)
        .arg("-cp")
        .arg(jar);
    for (path, source) in FIXES {
        let file = src.join(path);
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(&file, source)?;
        javac.arg(file);
    }
    let out = javac
        .output()
        .map_err(|e| EmulatorError::Start(format!("cannot run javac: {e}")))?;
    if !out.status.success() {
        return Err(EmulatorError::Start(format!(
            "javac failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let dir = classes.join("com/google/cloud/pubsub/testing/v1");
    for name in RENAMED {
        let (from, to) = (
            format!("FakePubsubServerX{name}"),
            format!("FakePubsubServer${name}"),
        );
        for entry in std::fs::read_dir(&dir)?.flatten() {
            let path = entry.path();
            let mut data = std::fs::read(&path)?;
            replace_same_length(&mut data, from.as_bytes(), to.as_bytes());
            std::fs::write(&path, data)?;
        }
        std::fs::rename(
            dir.join(format!("{from}.class")),
            dir.join(format!("{to}.class")),
        )?;
    }
    Ok(())
}

/// Replaces every `from` in `data` by `to`, of the same length (a class file's constant pool
/// keeps its layout).
fn replace_same_length(data: &mut [u8], from: &[u8], to: &[u8]) {
    debug_assert_eq!(from.len(), to.len());
    let mut i = 0;
    while i + from.len() <= data.len() {
        if &data[i..i + from.len()] == from {
            data[i..i + from.len()].copy_from_slice(to);
            i += from.len();
        } else {
            i += 1;
        }
    }
}

/// Starts an emulator on a free loopback port and waits until it accepts connections.
pub fn start(workdir: &Path) -> Result<Emulator, EmulatorError> {
    let jar = find_jar().ok_or(EmulatorError::NoJar)?;
    let classes = workdir.join("classes");
    compile_fixes(&jar, &workdir.join("src"), &classes)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let log = workdir.join("emulator.log");
    let out = std::fs::File::create(&log)?;
    let classpath = format!("{}:{}", classes.display(), jar.display());
    let child = Command::new("java")
        .arg("-cp")
        .arg(classpath)
        .arg("com.google.cloud.pubsub.testing.v1.Main")
        .arg("--host=127.0.0.1")
        .arg(format!("--port={port}"))
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .map_err(|e| EmulatorError::Start(format!("cannot run java: {e}")))?;
    let host = format!("127.0.0.1:{port}");
    let emulator = Emulator { child, host, log };
    let started = Instant::now();
    while std::net::TcpStream::connect(&emulator.host).is_err() {
        if started.elapsed() > Duration::from_secs(60) {
            return Err(EmulatorError::Start(format!(
                "emulator did not open {} within 60 s; see {}",
                emulator.host,
                emulator.log.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(emulator)
}
