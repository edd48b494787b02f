//! Early drain: stop pulling while the VM is announced to end, before SIGTERM arrives.
//!
//! Two optional watchers (`SPOTINFER_EARLY_DRAIN=taint,metadata`):
//! * `metadata`: long-polls the Compute Engine metadata server's `instance/preempted` and
//!   `instance/maintenance-event` (`?wait_for_change=true`). Only notices that end the VM count:
//!   `preempted` = `TRUE`, and `TERMINATE_ON_HOST_MAINTENANCE`. A live migration
//!   (`MIGRATE_ON_HOST_MAINTENANCE`) pauses the VM for a moment and keeps it, its disks and its
//!   pods: draining for it would only hand work back. Note the GKE metadata server that Workload
//!   Identity puts in front of pods does not expose `preempted`; the watcher then says so once
//!   and keeps watching `maintenance-event`.
//! * `taint`: polls this pod's Node (`NODE_NAME`, from the downward API) through the Kubernetes
//!   API for the `cloud.google.com/impending-node-termination` taint GKE adds to a Spot node that
//!   is about to go away (needs `get` on nodes: k8s/base/rbac.yaml).
//!
//! The watchers keep watching after a notice: [`spawn`] returns a [`Notice`] that is active
//! while any of them reports one and clears when they all stop. While it is active the worker
//! shuts its pipeline down exactly as on SIGTERM (finishing the commit in flight and handing the rest back) but the
//! process stays up, not ready (exiting early would only have the container restarted on the
//! dying node); if the notice clears without a SIGTERM (a maintenance window that was called
//! off, a taint removed), the worker starts pulling again.

use crate::shutdown::Shutdown;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// The taint GKE puts on a node about to be preempted.
pub const TERMINATION_TAINT: &str = "cloud.google.com/impending-node-termination";

/// The maintenance event that ends the VM (a Spot VM cannot live-migrate).
pub const TERMINATING_MAINTENANCE: &str = "TERMINATE_ON_HOST_MAINTENANCE";

/// The shortest pause between two reads of the node, whatever [`DrainConfig::poll`] says:
/// `--drain-poll` refuses less, and a zero period would be a busy loop against the API server.
pub const MIN_POLL: Duration = Duration::from_millis(100);

/// What to watch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Watch {
    /// The metadata server's preemption and maintenance notices.
    Metadata,
    /// The node's impending-termination taint.
    Taint,
}

/// Parses `off`, `metadata`, `taint` or a comma-separated list.
pub fn parse_watches(s: &str) -> Result<Vec<Watch>, String> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part {
            "off" | "none" => {}
            "metadata" => out.push(Watch::Metadata),
            "taint" => out.push(Watch::Taint),
            other => {
                return Err(format!(
                    "unknown early-drain watch {other:?}: use off, metadata, taint"
                ))
            }
        }
    }
    Ok(out)
}

/// Where the watchers look.
#[derive(Debug, Clone)]
pub struct DrainConfig {
    /// Enabled watchers.
    pub watches: Vec<Watch>,
    /// Metadata server host[:port] (`GCE_METADATA_HOST`).
    pub metadata_host: String,
    /// Kubernetes API base URL.
    pub kube_api: String,
    /// This pod's node.
    pub node_name: Option<String>,
    /// Taint polling period (at least [`MIN_POLL`]).
    pub poll: Duration,
}

/// The sources a notice can come from, one slot each.
const SOURCES: usize = 3;
const PREEMPTED: usize = 0;
const MAINTENANCE: usize = 1;
const TAINT: usize = 2;

/// Whether the VM is announced to end, and why: the combined state of every watcher.
#[derive(Debug, Clone)]
pub struct Notice {
    rx: watch::Receiver<[Option<String>; SOURCES]>,
}

impl Notice {
    /// The reason, while a notice is active.
    pub fn active(&self) -> Option<String> {
        self.rx.borrow().iter().flatten().next().cloned()
    }

    /// Waits until a notice is active; returns its reason. Never returns once every watcher
    /// has ended without one.
    pub async fn announced(&mut self) -> String {
        loop {
            if let Some(reason) = self.active() {
                return reason;
            }
            if self.rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Waits until no notice is active.
    pub async fn cleared(&mut self) {
        while self.active().is_some() {
            if self.rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}

/// Starts the enabled watchers, which run until `stop` is cancelled (SIGTERM).
pub fn spawn(cfg: DrainConfig, stop: Shutdown) -> Notice {
    let (tx, rx) = watch::channel([None, None, None]);
    let tx = Arc::new(tx);
    let set = |slot: usize| {
        let tx = tx.clone();
        move |v: Option<String>| {
            tx.send_if_modified(|state| {
                let changed = state[slot] != v;
                if changed {
                    match &v {
                        Some(reason) => tracing::warn!(reason, "the VM is announced to end: draining early (stop pulling, finish the commit in flight, hand back the rest)"),
                        None => tracing::info!(slot, "termination notice cleared"),
                    }
                    state[slot] = v;
                }
                changed
            });
        }
    };
    for w in &cfg.watches {
        let stop = stop.clone();
        match w {
            Watch::Metadata => {
                let host = cfg.metadata_host.clone();
                let (preempted, maintenance) = (set(PREEMPTED), set(MAINTENANCE));
                tokio::spawn(async move {
                    tokio::select! {
                        _ = stop.cancelled() => {}
                        _ = watch_metadata(&host, "instance/preempted", |v| v.trim() == "TRUE", preempted) => {}
                        _ = watch_metadata(&host, "instance/maintenance-event", |v| v.trim() == TERMINATING_MAINTENANCE, maintenance) => {}
                    }
                });
            }
            Watch::Taint => {
                let (cfg, taint) = (cfg.clone(), set(TAINT));
                tokio::spawn(async move {
                    tokio::select! {
                        _ = stop.cancelled() => {}
                        _ = watch_taint(&cfg, taint) => {}
                    }
                });
            }
        }
    }
    Notice { rx }
}

/// Long-polls one metadata value for ever, reporting through `report` a notice while `ends_vm`
/// accepts the value and none otherwise. Endpoints the server does not have (404) are reported
/// once and then never resolve.
async fn watch_metadata(
    host: &str,
    key: &str,
    ends_vm: impl Fn(&str) -> bool,
    report: impl Fn(Option<String>),
) {
    let client = reqwest::Client::new();
    let base = format!("http://{host}/computeMetadata/v1/{key}");
    let mut etag = String::new();
    let mut last = None;
    loop {
        let url = if etag.is_empty() {
            format!("{base}?wait_for_change=true")
        } else {
            format!("{base}?wait_for_change=true&last_etag={etag}")
        };
        let resp = client
            .get(&url)
            .header("Metadata-Flavor", "Google")
            .send()
            .await;
        match resp {
            Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => {
                tracing::warn!(key, "the metadata server does not expose this key (the GKE metadata server hides instance/preempted); not watching it");
                std::future::pending::<()>().await;
            }
            Ok(r) if r.status().is_success() => {
                if let Some(t) = r.headers().get("etag").and_then(|v| v.to_str().ok()) {
                    etag = t.to_string();
                }
                let body = r.text().await.unwrap_or_default();
                let value = body.trim();
                if !ends_vm(value) && value != "NONE" && value != "FALSE" {
                    tracing::info!(
                        key,
                        value,
                        "metadata notice that does not end the VM; not draining"
                    );
                }
                report(ends_vm(value).then(|| format!("metadata {key} = {value}")));
                // The server answers a long poll when the value changes (or its wait times out):
                // an unchanged value answered at once must not turn this into a busy loop.
                if last.as_deref() == Some(value) {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                last = Some(value.to_string());
            }
            Ok(r) => {
                tracing::debug!(key, status = %r.status(), "metadata watch");
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
            Err(e) => {
                tracing::debug!(key, error = %e, "metadata server unreachable");
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
    }
}

/// Polls the node for ever, reporting through `report` a notice while it carries
/// [`TERMINATION_TAINT`] and none otherwise. Returns at once when it cannot watch at all (no node
/// name, no client).
async fn watch_taint(cfg: &DrainConfig, report: impl Fn(Option<String>)) {
    let Some(node) = cfg.node_name.clone() else {
        tracing::warn!("early drain on the node taint needs NODE_NAME (downward API spec.nodeName); not watching");
        return;
    };
    const SA: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
    let mut builder = reqwest::Client::builder().timeout(Duration::from_secs(10));
    if let Ok(ca) = std::fs::read(format!("{SA}/ca.crt")) {
        match reqwest::Certificate::from_pem(&ca) {
            Ok(cert) => builder = builder.add_root_certificate(cert),
            Err(e) => tracing::warn!(error = %e, "cannot read the cluster CA"),
        }
    }
    let client = match builder.build() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "cannot build the Kubernetes API client; not watching the taint");
            return;
        }
    };
    let url = format!("{}/api/v1/nodes/{node}", cfg.kube_api.trim_end_matches('/'));
    let mut warned = false;
    loop {
        let mut req = client.get(&url);
        // The token rotates: read it for every request.
        if let Ok(token) = std::fs::read_to_string(format!("{SA}/token")) {
            req = req.bearer_auth(token.trim());
        }
        match req.send().await {
            Ok(r) if r.status().is_success() => {
                let node: serde_json::Value = r.json().await.unwrap_or_default();
                let tainted = node["spec"]["taints"]
                    .as_array()
                    .is_some_and(|ts| ts.iter().any(|t| t["key"] == TERMINATION_TAINT));
                report(tainted.then(|| {
                    format!(
                        "node {node_name} has the {TERMINATION_TAINT} taint",
                        node_name = node["metadata"]["name"].as_str().unwrap_or("?")
                    )
                }));
            }
            other => {
                if !warned {
                    let detail = match other {
                        Ok(r) => r.status().to_string(),
                        Err(e) => e.to_string(),
                    };
                    tracing::warn!(%url, %detail, "cannot read this pod's node; will keep trying");
                    warned = true;
                }
            }
        }
        tokio::time::sleep(cfg.poll.max(MIN_POLL)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The notice is the union of its sources and clears only when all have cleared.
    #[tokio::test]
    async fn a_notice_is_active_while_any_source_reports_one() {
        let (tx, rx) = watch::channel([None, None, None]);
        let mut notice = Notice { rx };
        assert_eq!(notice.active(), None);
        tx.send_modify(|s| s[TAINT] = Some("taint".into()));
        assert_eq!(notice.announced().await, "taint");
        tx.send_modify(|s| s[MAINTENANCE] = Some("maintenance".into()));
        tx.send_modify(|s| s[TAINT] = None);
        assert_eq!(notice.active().as_deref(), Some("maintenance"));
        let waiter = tokio::spawn(async move {
            notice.cleared().await;
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        tx.send_modify(|s| s[MAINTENANCE] = None);
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .unwrap()
            .unwrap();
    }

    /// A zero poll period (possible for a caller that builds the config itself) is not a busy
    /// loop against the API server: at most one read per [`MIN_POLL`].
    #[tokio::test]
    async fn the_taint_watch_never_polls_faster_than_the_floor() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let reads = Arc::new(AtomicUsize::new(0));
        let counted = reads.clone();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                counted.fetch_add(1, Ordering::Relaxed);
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let body = r#"{"metadata":{"name":"n"},"spec":{}}"#;
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            }
        });
        let cfg = DrainConfig {
            watches: vec![Watch::Taint],
            metadata_host: String::new(),
            kube_api: format!("http://{addr}"),
            node_name: Some("n".into()),
            poll: Duration::ZERO,
        };
        let _ = tokio::time::timeout(Duration::from_millis(550), watch_taint(&cfg, |_| {})).await;
        let n = reads.load(Ordering::Relaxed);
        assert!((1..=7).contains(&n), "{n} reads of the node in 550 ms");
    }

    #[test]
    fn parses_watch_lists() {
        assert_eq!(parse_watches("off").unwrap(), vec![]);
        assert_eq!(
            parse_watches("taint, metadata").unwrap(),
            vec![Watch::Taint, Watch::Metadata]
        );
        assert!(parse_watches("magic").is_err());
    }
}
