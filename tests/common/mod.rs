//! Shared helpers for the integration tests. They use the real Pub/Sub emulator and real
//! PostgreSQL started by `scripts/test.sh`; nothing here mocks either.
#![allow(dead_code)]

mod shared;
pub use shared::*;

use google_cloud_pubsub::model::Message;
use spotinfer::config::PubsubArgs;
use spotinfer::external::pubsub::PubsubConfig;
use spotinfer::pipeline::batcher::BatchConfig;
use spotinfer::pipeline::window::Window;
use spotinfer::pipeline::worker::WorkerConfig;
use spotinfer_chaos::Proxy;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The files of the all-MiniLM-L6-v2 folder (scripts/fetch-model.sh), as a bucket holds them.
pub const MODEL_FILES: &[&str] = &[
    "modules.json",
    "config.json",
    "tokenizer.json",
    "model.safetensors",
    "1_Pooling/config.json",
    "config_sentence_transformers.json",
    "sentence_bert_config.json",
    "tokenizer_config.json",
];

/// The local model directory.
pub fn model_dir() -> PathBuf {
    std::env::var_os("SPOTINFER_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/all-MiniLM-L6-v2")
        })
}

/// Pub/Sub args for a fresh topic and subscription.
pub fn pubsub_args(name: &str) -> PubsubArgs {
    PubsubArgs {
        project: "spotinfer-test".into(),
        emulator_host: Some(emulator()),
        topic: format!("t-{name}"),
        subscription: format!("s-{name}"),
    }
}

/// Creates a fresh topic and subscription on the emulator.
pub async fn fresh_pubsub(name: &str) -> (PubsubArgs, PubsubConfig) {
    let args = pubsub_args(name);
    let cfg = args.config();
    cfg.setup(Duration::from_secs(10)).await.expect("setup");
    (args, cfg)
}

/// A SQLite URL in a fresh temporary directory (kept alive by the returned guard).
pub fn fresh_sqlite() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("sqlite://{}", dir.path().join("results.db").display());
    (dir, url)
}

/// `n` valid record lines with short, varied texts.
pub fn record_lines(prefix: &str, n: usize) -> Vec<String> {
    const WORDS: &[&str] = &[
        "spot",
        "node",
        "worker",
        "batch",
        "commit",
        "lease",
        "message",
        "vector",
        "preempted",
        "drain",
        "queue",
        "result",
        "model",
        "token",
        "retry",
        "cluster",
    ];
    (0..n)
        .map(|i| {
            let len = 3 + (i * 7) % 17;
            let text: Vec<&str> = (0..len).map(|j| WORDS[(i * 31 + j * 7) % WORDS.len()]).collect();
            serde_json::json!({"id": format!("{prefix}-{i:05}"), "text": format!("{} {i}", text.join(" ")), "job": prefix}).to_string()
        })
        .collect()
}

/// Publishes raw payloads and waits for every publish to be confirmed.
pub async fn publish_raw(cfg: &PubsubConfig, payloads: Vec<Vec<u8>>) {
    let publisher = cfg.publisher().await.expect("publisher");
    let futs: Vec<_> = payloads
        .into_iter()
        .map(|p| publisher.publish(Message::new().set_data(p)))
        .collect();
    publisher.flush().await;
    for f in futs {
        f.await.expect("publish");
    }
}

/// Publishes lines as message data.
pub async fn publish_lines(cfg: &PubsubConfig, lines: &[String]) {
    publish_raw(cfg, lines.iter().map(|l| l.clone().into_bytes()).collect()).await;
}

/// Polls `f` every 100 ms until it returns true; panics with `what` after `timeout`.
pub async fn wait_until<F, Fut>(timeout: Duration, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !f().await {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Asserts that nothing can be pulled from the subscription for `window`.
pub async fn assert_subscription_empty(cfg: &PubsubConfig, window: Duration) {
    let sub = cfg.subscriber(1).await.expect("subscriber");
    let mut stream = sub
        .subscribe(&cfg.subscription)
        .set_shutdown_behavior(google_cloud_pubsub::subscriber::ShutdownBehavior::NackImmediately)
        .build();
    let token = stream.shutdown_token();
    let got = tokio::time::timeout(window, stream.next()).await;
    token.shutdown().await;
    if let Ok(Some(Ok((m, h)))) = got {
        h.nack();
        panic!(
            "subscription not empty: message {} {:?}",
            m.message_id,
            String::from_utf8_lossy(&m.data)
        );
    }
}

/// Points a `spotinfer` command at the emulator and at `args`' project, topic and subscription.
pub fn pubsub_env<'a>(cmd: &'a mut Command, args: &PubsubArgs) -> &'a mut Command {
    cmd.env("PUBSUB_EMULATOR_HOST", emulator())
        .env("GOOGLE_CLOUD_PROJECT", &args.project)
        .env("SPOTINFER_TOPIC", &args.topic)
        .env("SPOTINFER_SUBSCRIPTION", &args.subscription)
}

/// A `spotinfer work` child process.
pub struct WorkerProcess {
    /// The child.
    pub child: Child,
    /// Its metrics address.
    pub metrics_addr: String,
}

/// A loopback address no other test takes: a port below the kernel's ephemeral range on a
/// loopback address of this process's own. Binding port 0 and releasing it raced: a worker
/// started by a test running beside this one could take the same port first ("Address already
/// in use"), and nothing but these addresses is bound in `127.81.0.0/16`.
pub fn free_addr() -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let pid = std::process::id() % 62_500;
    format!(
        "127.81.{}.{}:{}",
        pid / 250,
        pid % 250 + 1,
        20_000 + n % 12_000
    )
}

impl WorkerProcess {
    /// Starts `spotinfer work` against `args` and `db_url` with extra flags.
    pub fn start(args: &PubsubArgs, db_url: &str, extra: &[&str]) -> Self {
        Self::start_with_env(args, db_url, extra, &[])
    }

    /// Like [`WorkerProcess::start`], with extra environment variables (they win over the defaults).
    pub fn start_with_env(
        args: &PubsubArgs,
        db_url: &str,
        extra: &[&str],
        env: &[(&str, String)],
    ) -> Self {
        let metrics_addr = free_addr();
        let child = pubsub_env(&mut Command::new(env!("CARGO_BIN_EXE_spotinfer")), args)
            .arg("work")
            .args(extra)
            .env("DATABASE_URL", db_url)
            .env("SPOTINFER_MODEL", model_dir())
            .env("SPOTINFER_METRICS_ADDR", &metrics_addr)
            .env("RUST_LOG", "info")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn spotinfer work");
        Self {
            child,
            metrics_addr,
        }
    }

    /// Sends a signal.
    pub fn signal(&self, sig: i32) {
        // SAFETY-free: libc::kill on our own child's pid.
        let rc = unsafe { libc::kill(self.child.id() as i32, sig) };
        assert_eq!(rc, 0, "kill failed");
    }

    /// Waits for exit up to `timeout`; returns the status and how long it took.
    pub fn wait(&mut self, timeout: Duration) -> (std::process::ExitStatus, Duration) {
        let start = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                return (s, start.elapsed());
            }
            if start.elapsed() > timeout {
                let _ = self.child.kill();
                panic!("worker did not exit within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Reads one counter from /metrics (None while the endpoint is not up).
    pub async fn metric(&self, name: &str) -> Option<f64> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(&self.metrics_addr)
            .await
            .ok()?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut body = String::new();
        s.read_to_string(&mut body).await.ok()?;
        body.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
    }

    /// Whether /readyz answers 200.
    pub async fn ready(&self) -> bool {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let Ok(mut s) = tokio::net::TcpStream::connect(&self.metrics_addr).await else {
            return false;
        };
        if s.write_all(b"GET /readyz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .is_err()
        {
            return false;
        }
        let mut body = String::new();
        let _ = s.read_to_string(&mut body).await;
        body.starts_with("HTTP/1.1 200")
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A real Cloud Storage emulator (fake-gcs-server, installed by scripts/fake-gcs.sh), serving the
/// objects under a data directory (`DIR/BUCKET/OBJECT`). Killed on drop.
pub struct FakeGcs {
    child: Option<Child>,
    /// host:port it listens on.
    pub host: String,
    data: PathBuf,
}

impl FakeGcs {
    /// Starts a server on a free port with the objects under `data`.
    pub fn start(data: &std::path::Path) -> Self {
        let mut s = Self {
            child: None,
            host: free_addr(),
            data: data.to_path_buf(),
        };
        s.restart();
        s
    }

    /// Starts a server that uploads work against: on port 80 of a loopback address of its own.
    /// The Rust SDK leaves the port out of the `Host` header and fake-gcs-server builds a
    /// resumable upload's session URL from that header, so on any other port the upload's
    /// data goes to port 80 (real Cloud Storage answers with an absolute URL). Needs root, as
    /// the suite does for its databases.
    pub fn start_for_uploads(data: &std::path::Path) -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n =
            std::process::id() % 200 + 200 * N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut s = Self {
            child: None,
            host: format!("127.80.{}.{}:80", n / 250 % 250, n % 250 + 1),
            data: data.to_path_buf(),
        };
        s.restart();
        s
    }

    /// Starts (again) on the same port with the same data.
    pub fn restart(&mut self) {
        self.stop();
        let bin = std::env::var("SPOTINFER_FAKE_GCS_BIN")
            .expect("SPOTINFER_FAKE_GCS_BIN is not set: run the suite with scripts/test.sh");
        let (host, port) = self.host.split_once(':').unwrap();
        let child = Command::new(bin)
            .args([
                "-scheme",
                "http",
                "-backend",
                "memory",
                "-log-level",
                "warn",
            ])
            .args(["-host", host, "-port", port])
            .arg("-data")
            .arg(&self.data)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start fake-gcs-server");
        self.child = Some(child);
        let start = Instant::now();
        while std::net::TcpStream::connect(&self.host).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "fake-gcs-server did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the server (the port then refuses connections).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for FakeGcs {
    fn drop(&mut self) {
        self.stop();
    }
}

/// An in-process worker configuration for tests: one stream, 32-record batches, 10 s leases, no
/// idle exit, no Cloud Storage. Tests override fields with struct update syntax.
pub fn worker_config(pubsub: PubsubConfig) -> WorkerConfig {
    WorkerConfig {
        pubsub,
        window: Window::fixed(256, 1),
        max_outstanding_bytes: 32 << 20,
        lease_extension: Duration::from_secs(10),
        max_lease: Duration::from_secs(3600),
        batch: BatchConfig {
            max_records: 32,
            max_wait: Duration::from_millis(20),
            window: 256,
        },
        max_text_bytes: 4096,
        commit_timeout: Duration::from_secs(10),
        shutdown_timeout: Duration::from_secs(8),
        exit_when_idle: None,
        exactly_once: false,
        storage_emulator_host: None,
        max_object_bytes: 1 << 20,
        allowed_buckets: Vec::new(),
    }
}

/// A cutting proxy in front of the PostgreSQL database at `db`, and the URL that goes through it.
pub async fn proxied_pg(db: &str) -> (Proxy, String) {
    let hostport = db.split_once('@').unwrap().1.split_once('/').unwrap().0;
    let proxy = Proxy::start(hostport.to_string()).await.unwrap();
    let url = db.replacen(hostport, proxy.addr(), 1);
    (proxy, url)
}

/// Runs `cmd` to its end, polling its peak resident memory (VmHWM) every 10 ms; returns its
/// output and that peak in MiB.
pub fn output_with_peak_rss(cmd: &mut Command) -> (std::process::Output, f64) {
    use std::io::Read;
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut o = Vec::new();
        out.read_to_end(&mut o).unwrap();
        o
    });
    let err_reader = std::thread::spawn(move || {
        let mut e = Vec::new();
        err.read_to_end(&mut e).unwrap();
        e
    });
    let status_file = format!("/proc/{}/status", child.id());
    let mut peak_kib = 0u64;
    let status = loop {
        if let Ok(s) = std::fs::read_to_string(&status_file) {
            if let Some(kib) = s
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            {
                peak_kib = peak_kib.max(kib);
            }
        }
        if let Some(s) = child.try_wait().expect("try_wait") {
            break s;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let output = std::process::Output {
        status,
        stdout: reader.join().unwrap(),
        stderr: err_reader.join().unwrap(),
    };
    (output, peak_kib as f64 / 1024.0)
}

/// Texts that exercise every rule of the WordPiece fast path (src/model/text/wordpiece.rs) and every
/// reason to leave it: words in and out of a BERT vocabulary, case, digits, each ASCII
/// punctuation character, every whitespace byte, words around `max_input_chars_per_word`,
/// texts past the token limit, added tokens written in the text, and (in every other text)
/// accents, CJK, emoji and control characters. Seeded, so a failure names the same text again.
#[allow(dead_code)]
pub fn tokenizer_texts(n: usize) -> Vec<String> {
    const ASCII: &[&str] = &[
        "the",
        "worker",
        "embeds",
        "records",
        "unaffable",
        "Preemptible",
        "GPU",
        "HELLO",
        "xyzzyqq",
        "e-mail",
        "don't",
        "U.S.A.",
        "12345",
        "3.14",
        "$9.99",
        "C++",
        "foo_bar",
        "a/b\\c",
        "(x)",
        "[y]",
        "{z}",
        "<tag>",
        "#hash",
        "@user",
        "100%",
        "~tilde`",
        "^caret|",
        "\"quoted\"",
        "semi;colon:",
        "what?!",
        "well...",
        "a=b+c*d",
        "'single'",
    ];
    const ODD: &[&str] = &[
        "[CLS]",
        "[mask]",
        "[SEP] after",
        "[UNK]x",
        "café",
        "naïve",
        "東京",
        "🙂",
        "Ωmega",
        "tab\u{0007}bell",
        "vertical\u{000b}tab",
        "nbsp\u{00a0}here",
        "zero\u{200b}width",
    ];
    const SPACE: &[&str] = &[" ", " ", " ", "  ", "\t", "\n", "\r\n", " \r "];
    let mut seed = 0x5eed_u64;
    let mut next = move |m: usize| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((seed >> 33) as usize) % m
    };
    (0..n)
        .map(|i| {
            let words = match i % 10 {
                0 => 200 + next(300), // past 256 tokens: truncation
                _ => 1 + next(40),
            };
            let mut t = String::new();
            for w in 0..words {
                if w > 0 || next(4) == 0 {
                    t.push_str(SPACE[next(SPACE.len())]);
                }
                match next(20) {
                    0 => t.push_str(&"a".repeat(95 + next(10))), // around 100 characters
                    1 => t.push_str(&"long".repeat(30)),
                    2 if i % 2 == 1 => t.push_str(ODD[next(ODD.len())]),
                    _ => t.push_str(ASCII[next(ASCII.len())]),
                }
            }
            t
        })
        .collect()
}

/// Where one test's commands point: the emulator topic, the database, the model.
pub struct Env {
    /// The emulator topic and subscription.
    pub args: PubsubArgs,
    /// The database URL.
    pub db: String,
    /// The model folder.
    pub model: PathBuf,
}

impl Env {
    /// `spotinfer SUB …` with this environment.
    pub fn cmd(&self, sub: &str) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_spotinfer"));
        pubsub_env(&mut c, &self.args)
            .arg(sub)
            .env("DATABASE_URL", &self.db)
            .env("SPOTINFER_MODEL", &self.model)
            .env("RUST_LOG", "warn");
        c
    }

    /// Runs `spotinfer SUB ARGS…` and returns its output (any exit status).
    pub fn run(&self, sub: &str, args: &[&str]) -> std::process::Output {
        self.cmd(sub).args(args).output().expect("run spotinfer")
    }

    /// Runs it and insists on success.
    pub fn ok(&self, sub: &str, args: &[&str]) -> String {
        let out = self.run(sub, args);
        assert!(
            out.status.success(),
            "spotinfer {sub} {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `status --job J --json`, parsed.
    pub fn status(&self, job: &str) -> serde_json::Value {
        let out = self.ok("status", &["--job", job, "--json"]);
        serde_json::from_str(out.trim()).expect("status --json prints one JSON object")
    }

    /// `export --failed` of `job` into `dir`: each failure's reason by record id.
    pub fn failure_reasons(
        &self,
        job: &str,
        dir: &std::path::Path,
    ) -> std::collections::HashMap<String, String> {
        let failed = dir.join("failed.jsonl");
        let out = failed.display().to_string();
        self.ok("export", &["--job", job, "--failed", "--output", &out]);
        read_jsonl(&failed)
            .into_iter()
            .map(|f| {
                let id = f["record_id"].as_str().unwrap_or("").to_string();
                (id, f["error"].as_str().unwrap_or("").to_string())
            })
            .collect()
    }

    /// A worker process on this environment's model.
    pub fn worker(&self, extra: &[&str]) -> WorkerProcess {
        let model = self.model.display().to_string();
        WorkerProcess::start_with_env(&self.args, &self.db, extra, &[("SPOTINFER_MODEL", model)])
    }
}

/// What `script` prints as JSON when pyarrow's Python (`SPOTINFER_TEST_PYTHON`, which
/// scripts/test.sh sets up) runs it on `path` (its `sys.argv[1]`): how the tests read a Parquet
/// export as its users' tools do.
pub fn pyarrow_json(script: &str, path: &std::path::Path) -> serde_json::Value {
    let python = std::env::var("SPOTINFER_TEST_PYTHON")
        .expect("SPOTINFER_TEST_PYTHON (a python with pyarrow) is not set: run scripts/test.sh");
    let out = Command::new(python)
        .args(["-c", script])
        .arg(path)
        .output()
        .expect("run the python with pyarrow");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the script prints one JSON value")
}

/// The completions the generation model at `model` writes for `records` (generation records
/// as published) uninterrupted, in this process, in order: the worker's defaults for what a
/// record leaves out, the seed `record::parse` derives. What a worker's answers, resumed or
/// not, must equal.
pub fn uninterrupted_completions(
    model: &std::path::Path,
    records: &[serde_json::Value],
) -> Vec<spotinfer::model::engines::decoder::Completion> {
    use spotinfer::model::engines::decoder::{Generated, Interrupt, LanguageModel};
    // In the precision a worker's `--precision auto` computes in (a GGUF's blocks).
    let auto = spotinfer::model::decoder_precision(spotinfer::model::Precision::Auto).unwrap();
    let generator = LanguageModel::open_in(model, auto).expect("the generation model loads");
    let requests: Vec<_> = records
        .iter()
        .map(|r| {
            let parsed = spotinfer::record::parse(r.to_string().as_bytes(), 1 << 20).unwrap();
            let input = parsed.generation.expect("a generation record");
            spotinfer::model::GenerationDefaults::default().request(&input, &[])
        })
        .collect();
    generator
        .generate(&requests, 0, &Interrupt::new(), None)
        .into_iter()
        .zip(records)
        .map(|(g, r)| match g {
            Generated::Done(c) => c,
            other => panic!("{r}: {other:?}"),
        })
        .collect()
}

/// The objects of a JSON lines file (an export, `spotinfer embed`'s output), one per line.
pub fn read_jsonl(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

/// A reference file's JSON array of numbers as f32s.
pub fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .expect("a JSON array")
        .iter()
        .map(|x| x.as_f64().expect("a number") as f32)
        .collect()
}

/// The worst picture for decoding's memory: a 16-bit RGBA PNG of `side` × `side` (8 bytes a
/// pixel decoded) whose rows repeat, so it compresses to a few hundred kB.
pub fn worst_png(side: u32) -> Vec<u8> {
    let img = image::ImageBuffer::from_fn(side, side, |x, _| {
        let v = (x * 97 % 65536) as u16;
        image::Rgba([v, v / 2, 65535 - v, 40000])
    });
    let mut png = Vec::new();
    image::DynamicImage::ImageRgba16(img)
        .write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
        .unwrap();
    png
}

/// A 1×1 PNG whose `iCCP` chunk holds a profile of `icc_bytes` zeros, deflated (an ICC bomb when
/// large: 200 MiB deflate to about 200 KB).
pub fn png_with_icc(icc_bytes: usize) -> Vec<u8> {
    use std::io::Write;
    let mut plain = Vec::new();
    image::DynamicImage::ImageRgb8(image::RgbImage::from_pixel(1, 1, image::Rgb([9, 99, 199])))
        .write_to(
            &mut std::io::Cursor::new(&mut plain),
            image::ImageFormat::Png,
        )
        .unwrap();
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..icc_bytes >> 20 {
        z.write_all(&zeros).unwrap();
    }
    z.write_all(&zeros[..icc_bytes & ((1 << 20) - 1)]).unwrap();
    let mut iccp = b"icc\0\0".to_vec();
    iccp.extend(z.finish().unwrap());
    // Signature (8) and IHDR (25), then the profile, then the rest as written.
    let mut out = plain[..33].to_vec();
    png_chunk(&mut out, b"iCCP", &iccp);
    out.extend(&plain[33..]);
    out
}

/// Appends a PNG chunk (length, type, data, CRC-32).
fn png_chunk(out: &mut Vec<u8>, kind: &[u8], data: &[u8]) {
    out.extend((data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend(kind);
    out.extend(data);
    let crc = png_crc32(&out[start..]);
    out.extend(crc.to_be_bytes());
}

/// PNG's CRC-32 (the zlib polynomial), bit by bit: a test's chunks are small.
fn png_crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 == 1 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// A tiny PNG whose header declares `width` × `height` pixels, with a few bytes of image data.
pub fn png_declaring(width: u32, height: u32) -> Vec<u8> {
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = width.to_be_bytes().to_vec();
    ihdr.extend(height.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]);
    png_chunk(&mut out, b"IHDR", &ihdr);
    // A zlib stream of zeros: what a bomb's data looks like, cut short.
    png_chunk(
        &mut out,
        b"IDAT",
        &[0x78, 0x9c, 0x63, 0x60, 0x18, 0x05, 0x00, 0x00],
    );
    png_chunk(&mut out, b"IEND", &[]);
    out
}

/// A text model's thread beside its task, served as the worker serves it (no checkpoint store).
pub fn served(handle: spotinfer::model::ModelHandle) -> spotinfer::model::Served {
    use spotinfer::model::load::{serve, ModelKind, Running, Serving};
    let serving = Serving {
        max_image_pixels: 50_000_000,
        checkpoints: None,
    };
    serve(Running::without_interrupt(ModelKind::Text, handle), serving).unwrap()
}

/// A 1-layer, 32-wide BERT with random weights in all-MiniLM-L6-v2's layout and vocabulary
/// (`bench/make_shape.py`), made under the target's temporary folder as `name` (one name per
/// test file: files run at once): the model costs almost nothing, so the pipeline is what runs.
pub fn tiny_bert(name: &str) -> PathBuf {
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let status = Command::new("python3")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/bench/make_shape.py"))
        .arg("--from")
        .arg(model_dir())
        .arg("--out")
        .arg(&out)
        .args(["--layers", "1", "--hidden", "32", "--heads", "2"])
        .args(["--intermediate", "64"])
        .stdout(std::process::Stdio::null())
        .status()
        .expect("python3 bench/make_shape.py");
    assert!(status.success(), "make_shape.py failed");
    out
}

/// A SQLite environment on a fresh topic with `model`: the environment, its unique name (the
/// topic's and the job's) and the folder that holds the database.
pub async fn sqlite_env(prefix: &str, model: PathBuf) -> (Env, String, tempfile::TempDir) {
    let name = unique(prefix);
    let (args, _) = fresh_pubsub(&name).await;
    let (dir, db) = fresh_sqlite();
    let env = Env { args, db, model };
    (env, name, dir)
}
