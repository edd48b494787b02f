//! The fleet dashboards (dashboards/) against the worker's real metrics: every query's metric
//! must be one the worker's registry renders today (or one of Google's), and the checker must
//! fail on a misspelt one. The checker is scripts/dashboards.py (CI also runs it from
//! scripts/lint-deploy.sh against dashboards/worker-metrics.txt, a saved scrape); these tests
//! hold that scrape to the code.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Sample names of a text exposition.
fn sample_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

/// What a worker's /metrics serves: the same registry, rendered by the same function.
fn rendered() -> String {
    spotinfer::external::telemetry::Metrics::new().render()
}

fn check(args: &[&Path], flags: &[&str]) -> Output {
    let mut cmd = Command::new("python3");
    cmd.arg(root().join("scripts/dashboards.py")).arg("check");
    for (flag, path) in flags.iter().zip(args) {
        cmd.arg(flag).arg(path);
    }
    cmd.output().expect("python3")
}

#[test]
fn every_dashboard_query_names_a_metric_the_worker_exposes_today() {
    let dir = tempfile::tempdir().unwrap();
    let exposed = dir.path().join("metrics.txt");
    std::fs::write(&exposed, rendered()).unwrap();
    let out = check(&[&exposed], &["--exposed"]);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The saved scrape the CI lint reads must not name a metric the worker no longer has (a new
/// metric may be missing from it: the dashboards cannot use it until it is refreshed).
#[test]
fn the_saved_scrape_is_still_what_the_worker_serves() {
    let saved = std::fs::read_to_string(root().join("dashboards/worker-metrics.txt")).unwrap();
    let now = sample_names(&rendered());
    let gone: Vec<_> = sample_names(&saved).difference(&now).cloned().collect();
    assert!(
        gone.is_empty(),
        "dashboards/worker-metrics.txt names metrics the worker no longer exposes: {gone:?}; \
         refresh it from a load test's work directory (worker-metrics.txt) and fix the dashboards"
    );
}

#[test]
fn a_misspelt_metric_fails_the_check() {
    let dir = tempfile::tempdir().unwrap();
    let grafana = std::fs::read_to_string(root().join("dashboards/grafana/spotinfer.json"))
        .unwrap()
        .replacen(
            "spotinfer_commit_seconds_bucket",
            "spotinfer_comit_seconds_bucket",
            1,
        );
    let cloud = std::fs::read_to_string(root().join("dashboards/cloud-monitoring/spotinfer.json"))
        .unwrap()
        .replacen(
            "subscription_num_undelivered_messages",
            "subscription_num_undelivered_message",
            1,
        );
    let (g, c) = (dir.path().join("g.json"), dir.path().join("c.json"));
    std::fs::write(&g, grafana).unwrap();
    std::fs::write(&c, cloud).unwrap();
    let out = check(&[&g, &c], &["--grafana", "--cloud-monitoring"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "unknown metric spotinfer_comit_seconds_bucket (did you mean spotinfer_commit_seconds_bucket?)"
        ),
        "{stderr}"
    );
    assert!(
        stderr
            .contains("unknown metric pubsub_googleapis_com:subscription_num_undelivered_message"),
        "{stderr}"
    );
}
