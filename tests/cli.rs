//! The command-line surface: publish, embed, bench and status as a user runs them.

mod common;

use common::*;
use std::path::Path;
use std::process::Command;

fn spotinfer() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_spotinfer"));
    c.env("SPOTINFER_MODEL", model_dir())
        .env("RUST_LOG", "warn");
    c
}

#[test]
fn publish_reports_bad_lines_by_number_and_counts_the_rest() {
    let name = unique("cli-pub");
    let args = pubsub_args(&name);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("in.jsonl");
    std::fs::write(
        &file,
        b"{\"id\":\"a\",\"text\":\"first\"}\nnot json\n\n{\"id\":\"b\"}\n{\"id\":\"c\",\"text\":\"third\"}\n{\"id\":\"d\",\"text\":\"\xff\"}\n",
    )
    .unwrap();
    let setup = pubsub_env(&mut spotinfer(), &args)
        .args(["setup", "--skip-db"])
        .output()
        .unwrap();
    assert!(setup.status.success(), "{setup:?}");
    let out = pubsub_env(&mut spotinfer(), &args)
        .arg("publish")
        .arg(&file)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("line 2: payload is not JSON"), "{stderr}");
    assert!(
        stderr.contains("line 4: field \"text\" is missing"),
        "{stderr}"
    );
    assert!(stdout.contains("published 2 records"), "{stdout}");
    assert!(
        stderr.contains("line 6: payload is not valid UTF-8"),
        "{stderr}"
    );
    assert!(stdout.contains("3 lines skipped"), "{stdout}");
}

/// Issue 40: publish held lines by count (a chunk of 1,000 lines, 2,000 publishes in flight),
/// so 9 MB lines could pin tens of GB. 48 lines of 1.5 MB (72 MB) published under the smallest
/// bound (16 MiB): what publish holds (read ahead plus in flight) never passes the bound, while
/// a count-based bound would have held them all; every record still goes out.
#[tokio::test]
async fn publish_holds_at_most_its_byte_bound_whatever_the_lines_sizes() {
    const LINES: usize = 48;
    const TEXT: usize = 1_500_000;
    const BOUND: usize = 16 << 20;
    let name = unique("cli-pub-bytes");
    let (_args, cfg) = fresh_pubsub(&name).await;
    let mut input = Vec::with_capacity(LINES * (TEXT + 40));
    for i in 0..LINES {
        let text = "x".repeat(TEXT);
        input.extend_from_slice(
            serde_json::json!({"id": format!("big-{i}"), "text": text})
                .to_string()
                .as_bytes(),
        );
        input.push(b'\n');
    }
    assert!(input.len() > 4 * BOUND, "the input must dwarf the bound");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.jsonl");
    std::fs::write(&path, &input).unwrap();
    let input = spotinfer::jobs::input::list(path.to_str().unwrap(), None, None)
        .await
        .unwrap();
    let publisher = cfg.publisher().await.unwrap();
    let publish = spotinfer::jobs::publish::Publish {
        publisher: &publisher,
        gcs: None,
        columns: None,
        job: None,
        response_format: None,
        target: None,
        republish: false,
        max_held_bytes: BOUND,
        progress: &indicatif::ProgressBar::hidden(),
    };
    let summary = publish.run(&input).await.unwrap();
    assert_eq!(summary.published, LINES as u64, "{summary:?}");
    assert!(
        summary.held_bytes_peak > TEXT as u64,
        "the counter counts: {summary:?}"
    );
    assert!(
        summary.held_bytes_peak <= BOUND as u64,
        "held {} bytes, over the {BOUND}-byte bound",
        summary.held_bytes_peak
    );
}

/// Finding 6 of the semantics review: `publish` read its whole input into memory. A 100 MB line
/// (over Pub/Sub's 10 MB message limit) between two valid ones is skipped with its number, and
/// the process never holds the input: peak RSS stays far under the file's size.
#[test]
fn publish_streams_its_input_and_skips_an_oversized_line() {
    let name = unique("cli-pub-big");
    let args = pubsub_args(&name);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("in.jsonl");
    {
        use std::io::Write;
        let mut f = std::io::BufWriter::new(std::fs::File::create(&file).unwrap());
        writeln!(f, "{{\"id\":\"a\",\"text\":\"first\"}}").unwrap();
        let block = vec![b'x'; 1 << 20];
        for _ in 0..100 {
            f.write_all(&block).unwrap();
        }
        writeln!(f).unwrap();
        writeln!(f, "{{\"id\":\"b\",\"text\":\"last\"}}").unwrap();
    }
    let setup = pubsub_env(&mut spotinfer(), &args)
        .args(["setup", "--skip-db"])
        .output()
        .unwrap();
    assert!(setup.status.success(), "{setup:?}");
    let (out, peak_mib) = output_with_peak_rss(
        pubsub_env(&mut spotinfer(), &args)
            .arg("publish")
            .arg(&file),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("publish of a 100 MiB file: peak RSS {peak_mib:.1} MiB");
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("line 2: longer than 10000000 bytes"),
        "{stderr}"
    );
    assert!(stdout.contains("published 2 records"), "{stdout}");
    assert!(
        peak_mib < 60.0,
        "peak RSS {peak_mib:.1} MiB for a 100 MiB input"
    );
}

#[test]
fn embed_and_bench_run_offline() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    let output = dir.path().join("out.jsonl");
    let mut lines = record_lines("cli-embed", 20);
    lines.insert(3, "{\"id\":\"\",\"text\":\"empty id\"}".into());
    std::fs::write(&input, lines.join("\n")).unwrap();

    let out = spotinfer()
        .args(["embed", "--batch-size", "8", "--input"])
        .arg(&input)
        .arg("--output")
        .arg(&output)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains(":4: field \"id\" is empty"), "{stderr}");
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&output)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 20);
    assert_eq!(rows[0]["id"], "cli-embed-00000");
    assert_eq!(rows[0]["embedding"].as_array().unwrap().len(), 384);

    let out = spotinfer()
        .args(["bench", "--input"])
        .arg(&input)
        .output()
        .unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(last["records"], 20);
    assert!(last["seconds"].as_f64().unwrap() > 0.0);
    assert!(last["records_per_s"].as_f64().unwrap() > 0.0);
    assert!(last["tokens_per_s"].as_f64().unwrap() > last["records_per_s"].as_f64().unwrap());
    // The model's share of the run and the tokenizing beside it; no device stages unasked.
    let busy = last["model_busy"].as_f64().unwrap();
    assert!(busy > 0.0 && busy <= 1.0, "{last}");
    assert!(last["tokenize_seconds"].as_f64().unwrap() > 0.0, "{last}");
    // The precision that ran and the accuracy it was checked at, beside the speed.
    let precision = last["precision"]["precision"].as_str().unwrap();
    let device = last["device"].as_str().unwrap();
    assert!(
        device.starts_with(&format!("Cpu (fused, {precision} on ")),
        "{last}"
    );
    match last["precision"]["worst_probe_cosine"].as_f64() {
        Some(worst) => assert!(worst >= 0.99985, "{last}"),
        None => assert_eq!(precision, "f32", "{last}"),
    }
    assert!(stdout.contains("\nprecision: "), "{stdout}");
    assert!(last.get("device_stages").is_none(), "{last}");
}

#[test]
fn bench_profiles_the_candle_encoder_s_stages_and_refuses_to_for_the_fused_one() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    std::fs::write(&input, record_lines("cli-profile", 40).join("\n")).unwrap();
    let bench = |extra: &[&str]| {
        spotinfer()
            .args([
                "bench",
                "--batch-size",
                "16",
                "--warmup",
                "1",
                "--profile-device",
            ])
            .args(extra)
            .arg("--input")
            .arg(&input)
            .output()
            .unwrap()
    };
    let out = bench(&["--backend", "candle"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let stages = &last["device_stages"];
    // Three batches of 16, 16 and 8 texts, the warm-up's left out; each within the token
    // budget, so one encoder batch each.
    assert_eq!(stages["batches"], 3, "{last}");
    let f = |k: &str| stages[k].as_f64().unwrap();
    assert!(
        f("encoder_s") > 0.0 && f("inputs_s") > 0.0 && f("outputs_s") > 0.0,
        "{last}"
    );
    let model = last["model_seconds"].as_f64().unwrap();
    assert!(
        f("inputs_s") + f("encoder_s") + f("outputs_s") <= model,
        "{last}"
    );
    assert!(
        stdout.contains("device stages over 3 encoder batches"),
        "{stdout}"
    );

    let out = bench(&["--backend", "fused"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("add --backend candle"), "{stderr}");
}

#[test]
fn status_counts_and_unreachable_database_is_a_clear_error() {
    let (_dir, db) = fresh_sqlite();
    let out = spotinfer()
        .args(["status", "--job", "nothing"])
        .env("DATABASE_URL", &db)
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "a job no publish registered is an error"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("no job \"nothing\" in this database (a job is registered by `spotinfer publish --job`); rows tagged with it: 0 done, 0 failed"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = spotinfer()
        .arg("status")
        .env("DATABASE_URL", &db)
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "0 done, 0 failed"
    );

    let out = spotinfer()
        .arg("status")
        .env(
            "DATABASE_URL",
            "postgres://someone:hunter2@127.0.0.1:1/nope",
        )
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("cannot reach the database at postgres://someone:***@127.0.0.1:1/nope"),
        "{stderr}"
    );
    assert!(!stderr.contains("hunter2"), "password leaked: {stderr}");
}

#[test]
fn worker_with_a_missing_model_fails_at_startup_with_a_clear_error() {
    let (_dir, db) = fresh_sqlite();
    let out = spotinfer()
        .args(["work", "--model", "/nonexistent/model"])
        .env("DATABASE_URL", &db)
        .env("PUBSUB_EMULATOR_HOST", emulator())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("/nonexistent/model/config.json") && stderr.contains("fetch-model.sh"),
        "{stderr}"
    );
}

/// Finding 8 of issue 25: `--drain-poll 0s` made the taint watch a busy loop against the
/// Kubernetes API, and other duration flags took any value. Each has a range now, and a value
/// outside it (from the flag or its environment variable) stops the worker before it starts,
/// with exit status 2, the flag's name and the range.
#[test]
fn out_of_range_durations_are_refused_with_the_flag_and_its_range() {
    let (_dir, db) = fresh_sqlite();
    for (flag, env, value, range) in [
        ("--drain-poll", "SPOTINFER_DRAIN_POLL", "0s", "100ms to 1m"),
        ("--job-poll", "SPOTINFER_JOB_POLL", "0s", "100ms to 10m"),
        ("--max-lease", "SPOTINFER_MAX_LEASE", "10s", "1m to 1day"),
        (
            "--stall-timeout",
            "SPOTINFER_STALL_TIMEOUT",
            "5s",
            "1m to 1day",
        ),
        (
            "--exit-when-idle",
            "SPOTINFER_EXIT_WHEN_IDLE",
            "0s",
            "1s to 7days",
        ),
        ("--batch-wait", "SPOTINFER_BATCH_WAIT", "5m", "0s to 1m"),
    ] {
        for from_env in [false, true] {
            let mut cmd = spotinfer();
            cmd.args(["work", "--model", "/nonexistent/model"])
                .env("DATABASE_URL", &db)
                .env("PUBSUB_EMULATOR_HOST", emulator());
            if from_env {
                cmd.env(env, value);
            } else {
                cmd.args([flag, value]);
            }
            let out = cmd.output().unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{flag} {value}: {stderr}");
            assert!(
                stderr.contains(flag) && stderr.contains(range),
                "{flag} {value}: {stderr}"
            );
        }
    }
}

#[test]
fn json_logs_carry_cloud_logging_severity() {
    // A worker waiting for an unreachable database logs a warning per attempt; SIGTERM ends it.
    let out = waiting_for_the_database(
        "sqlite:///nonexistent-dir/results.db",
        &[("SPOTINFER_LOG_FORMAT", "json"), ("RUST_LOG", "info")],
    );
    assert!(out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let logs: Vec<serde_json::Value> = stderr
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l}: {e}")))
        .collect();
    assert!(
        logs.iter()
            .any(|l| l["severity"] == "WARNING" && l["message"] == "database not ready"),
        "{stderr}"
    );
    for l in &logs {
        assert!(
            ["DEBUG", "INFO", "WARNING", "ERROR"].contains(&l["severity"].as_str().unwrap()),
            "{l}"
        );
        assert!(
            l["message"].is_string() && l["timestamp"].is_string(),
            "{l}"
        );
    }
}

/// What `spotinfer work` printed while it waited 1.5 s for the database at `url` (which it cannot
/// reach), with `env`, then took a SIGTERM.
fn waiting_for_the_database(url: &str, env: &[(&str, &str)]) -> std::process::Output {
    let child = spotinfer()
        .arg("work")
        .env("DATABASE_URL", url)
        .env("PUBSUB_EMULATOR_HOST", emulator())
        .envs(env.iter().copied())
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    child.wait_with_output().unwrap()
}

/// Issue 40: a password holding `?` or `#` defeated the redaction and was logged on every
/// connect retry of a worker waiting for its database.
#[test]
fn connect_retries_never_log_a_password_with_url_delimiters() {
    let out = waiting_for_the_database(
        "postgres://someone:hun?ter#2@127.0.0.1:1/nope",
        &[("RUST_LOG", "warn")],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("database not ready"), "{stderr}");
    assert!(stderr.contains("someone:***@"), "{stderr}");
    assert!(
        !stderr.contains("hun?ter") && !stderr.contains("ter#2"),
        "password leaked: {stderr}"
    );
}

/// Issue 40: `work` says at start which buckets a record's `uri` may name, and warns loudly
/// when that is any bucket its service account can read.
#[test]
fn work_names_the_allowed_buckets_at_start() {
    for (allowed, want) in [
        (
            Some("inputs,more-inputs"),
            "allowed_buckets=inputs,more-inputs",
        ),
        (None, "any bucket the service account can read"),
    ] {
        let mut cmd = spotinfer();
        cmd.arg("work")
            .env("DATABASE_URL", "sqlite:///nonexistent-dir/results.db")
            .env("PUBSUB_EMULATOR_HOST", emulator())
            .env("RUST_LOG", "info")
            .env_remove("SPOTINFER_ALLOWED_BUCKETS")
            .stderr(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped());
        if let Some(list) = allowed {
            cmd.env("SPOTINFER_ALLOWED_BUCKETS", list);
        }
        let child = cmd.spawn().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1000));
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let line = stderr
            .lines()
            .find(|l| l.contains(want))
            .unwrap_or_else(|| panic!("{allowed:?}: no start message naming {want:?}: {stderr}"));
        let level = if allowed.is_some() { "INFO" } else { "WARN" };
        assert!(line.contains(level), "{line}");
    }
}

/// `--help` shows which variable sets the database URL, never its value (a password).
#[test]
fn help_never_prints_the_database_password() {
    let out = spotinfer()
        .args(["help", "work"])
        .env(
            "DATABASE_URL",
            "postgres://u:hunter2@db:5432/x?password=hunter3",
        )
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(help.contains("DATABASE_URL"), "{help}");
    assert!(
        !help.contains("hunter"),
        "the URL leaked into --help:\n{help}"
    );
}

/// Scripts find the binary where cargo puts it, CARGO_TARGET_DIR included.
#[test]
fn scripts_find_the_binary_in_cargo_target_dir() {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new(format!("{root}/scripts/cargo-bin.sh"))
        .args(["spotinfer", "release"])
        .env("CARGO_TARGET_DIR", "/tmp/elsewhere")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "/tmp/elsewhere/release/spotinfer"
    );
}

/// `models check` says what it understood of a model, or exactly why it refuses it.
#[test]
fn models_check_prints_what_it_understood_or_why_it_refuses() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models");
    let out = spotinfer()
        .args(["models", "check"])
        .arg(fixtures.join("bert-max-dense-bf16"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for line in [
        "architecture:   bert",
        "weights:        BF16",
        "pooling:        max",
        "dense:          32 -> 16, bias true, Tanh",
        "normalize:      true",
        "dimension:      16",
        "name:           bert-max-dense-bf16",
        "ok",
    ] {
        assert!(stdout.contains(line), "missing {line:?} in:\n{stdout}");
    }
    // Which precision ran, as the load-time check settled it, beside the kernels that ran it.
    let precision = stdout
        .lines()
        .find_map(|l| l.strip_prefix("precision:      "))
        .unwrap_or_else(|| panic!("no precision line in:\n{stdout}"));
    let name = precision.split([',', ' ']).next().unwrap();
    assert!(
        stdout.contains(&format!("loaded on:      Cpu (fused, {name} on ")),
        "{stdout}"
    );
    assert!(
        precision.contains("checked at load: worst cosine") || name == "f32",
        "{stdout}"
    );
    // The default model (SPOTINFER_MODEL) when no folder is given.
    let out = spotinfer().args(["models", "check"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("pooling:        mean (prompt pooled)"),
        "{stdout}"
    );
    assert!(stdout.contains("max tokens:     256"), "{stdout}");
    let out = spotinfer()
        .args(["models", "check"])
        .arg(fixtures.join("refused/pooling-lasttoken"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("unsupported model") && stderr.contains("\"lasttoken\""),
        "{stderr}"
    );
}

/// `models check` on a GGUF generation model says which engine ran it: the file's own blocks by
/// default (and with `--precision gguf`), widened to f32 with `--precision f32` (issue 55).
#[test]
fn models_check_says_which_engine_a_gguf_answered_on() {
    let gguf = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    let blocks = "loaded on:      Cpu (decoder, GGUF blocks from GGUF";
    for (precision, engine) in [
        ("auto", blocks),
        ("gguf", blocks),
        ("f32", "loaded on:      Cpu (decoder, f32 from GGUF"),
    ] {
        let out = spotinfer()
            .args(["models", "check", "--precision", precision])
            .arg(&gguf)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains(engine) && stdout.contains("computed:"),
            "{precision}: {stdout} {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// `bench` on a generation model runs prompt records through the worker's decode loop at each
/// batch size asked: every record's prompt and generated tokens counted (a record's
/// `max_new_tokens` honoured), a first-token time, and the same totals at every batch size.
#[test]
fn bench_measures_a_generation_model_at_each_batch_size() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("prompts.jsonl");
    let lines: Vec<String> = (0..5)
        .map(|i| {
            serde_json::json!({
                "id": format!("p{i}"),
                "messages": [{"role": "user", "content": format!("question number {i}")}],
                "max_new_tokens": 3 + i,
            })
            .to_string()
        })
        .chain(["{\"id\":\"t\",\"text\":\"not a prompt\"}".to_string()])
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llm/models/qwen3");
    let out = spotinfer()
        .args(["bench", "--batch-sizes", "1,4", "--model"])
        .arg(&model)
        .arg("--input")
        .arg(&input)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Vec<serde_json::Value> =
        serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(report.len(), 2, "{stdout}");
    for (row, size) in report.iter().zip([1, 4]) {
        let b = &row["bench"];
        assert_eq!(b["batch_size"], size, "{row}");
        assert_eq!(b["records"], 5, "{row}");
        assert_eq!(b["refused"], 0, "{row}");
        // A random-weight model rarely ends early; at most 3 + 4 + 5 + 6 + 7 tokens.
        let generated = b["generated_tokens"].as_u64().unwrap();
        assert!((5..=25).contains(&generated), "{row}");
        assert!(b["prompt_tokens"].as_u64().unwrap() >= 5 * 4, "{row}");
        assert!(b["first_token_s"].as_f64().unwrap() > 0.0, "{row}");
        assert!(b["generated_tokens_per_s"].as_f64().unwrap() > 0.0, "{row}");
        assert!(
            row["device"].as_str().unwrap().starts_with("Cpu (decoder"),
            "{row}"
        );
    }
    // Greedy: the same prompts give the same tokens at either batch size.
    assert_eq!(
        report[0]["bench"]["generated_tokens"],
        report[1]["bench"]["generated_tokens"]
    );
    assert_eq!(
        report[0]["bench"]["prompt_tokens"],
        report[1]["bench"]["prompt_tokens"]
    );
    assert!(
        stdout.contains("batch 4: 5 records (0 refused)"),
        "{stdout}"
    );
}
