//! Early drain: stop pulling when a preemption is announced, before SIGTERM arrives.
//!
//! Two optional watchers (`SPOTINFER_EARLY_DRAIN=taint,metadata`):
//! * `metadata`: long-polls the Compute Engine metadata server's `instance/preempted` and
//!   `instance/maintenance-event` (`?wait_for_change=true`). Note the GKE metadata server that
//!   Workload Identity puts in front of pods does not expose `preempted`; the watcher then says so
//!   once and keeps watching `maintenance-event`.
//! * `taint`: polls this pod's Node (`NODE_NAME`, from the downward API) through the Kubernetes
//!   API for the `cloud.google.com/impending-node-termination` taint GKE adds to a Spot node that
//!   is about to go away (needs `get` on nodes: k8s/base/rbac.yaml).
//!
//! When one fires, the worker shuts its pipeline down exactly as on SIGTERM (NACKing everything
//! uncommitted) but the process stays up, not ready, until the signal comes: exiting early would
//! only have the container restarted on the dying node.

use crate::shutdown::Shutdown;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The taint GKE puts on a node about to be preempted.
pub const TERMINATION_TAINT: &str = "cloud.google.com/impending-node-termination";

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
    /// Taint polling period.
    pub poll: Duration,
}

/// Starts the enabled watchers. When one fires it cancels `drained` and then `shutdown`.
pub fn spawn(cfg: DrainConfig, shutdown: Shutdown, drained: CancellationToken) {
    for w in &cfg.watches {
        let (cfg, shutdown, drained) = (cfg.clone(), shutdown.clone(), drained.clone());
        match w {
            Watch::Metadata => {
                tokio::spawn(async move {
                    let host = cfg.metadata_host.clone();
                    let reason = tokio::select! {
                        _ = shutdown.cancelled() => return,
                        r = watch_metadata(&host, "instance/preempted", |v| v.trim() == "TRUE") => r,
                        r = watch_metadata(&host, "instance/maintenance-event", |v| v.trim() != "NONE") => r,
                    };
                    fire(&reason, &shutdown, &drained);
                });
            }
            Watch::Taint => {
                tokio::spawn(async move {
                    let reason = tokio::select! {
                        _ = shutdown.cancelled() => return,
                        r = watch_taint(&cfg) => r,
                    };
                    if let Some(reason) = reason {
                        fire(&reason, &shutdown, &drained);
                    }
                });
            }
        }
    }
}

fn fire(reason: &str, shutdown: &Shutdown, drained: &CancellationToken) {
    tracing::warn!(
        reason,
        "preemption announced: draining early (stop pulling, nack uncommitted)"
    );
    drained.cancel();
    shutdown.cancel();
}

/// Long-polls one metadata value until `fires` accepts it; returns the reason. Endpoints the
/// server does not have (404) are reported once and then never resolve.
async fn watch_metadata(host: &str, key: &str, fires: impl Fn(&str) -> bool) -> String {
    let client = reqwest::Client::new();
    let base = format!("http://{host}/computeMetadata/v1/{key}");
    let mut etag = String::new();
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
                if fires(&body) {
                    return format!("metadata {key} = {}", body.trim());
                }
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

/// Polls the node until it carries [`TERMINATION_TAINT`]. Returns None when it cannot watch at
/// all (no node name).
async fn watch_taint(cfg: &DrainConfig) -> Option<String> {
    let Some(node) = cfg.node_name.clone() else {
        tracing::warn!("early drain on the node taint needs NODE_NAME (downward API spec.nodeName); not watching");
        return None;
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
            return None;
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
                if tainted {
                    return Some(format!(
                        "node {node_name} has the {TERMINATION_TAINT} taint",
                        node_name = node["metadata"]["name"].as_str().unwrap_or("?")
                    ));
                }
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
        tokio::time::sleep(cfg.poll).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
