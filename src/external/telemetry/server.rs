//! The worker's HTTP port: `/metrics` for Prometheus, `/healthz` and `/readyz` for Kubernetes'
//! probes, served by axum with a cap on concurrent requests.

use super::metrics::Metrics;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use std::sync::Arc;
use tokio::net::TcpListener;
use tower::limit::GlobalConcurrencyLimitLayer;

/// Requests the endpoint serves at once; more wait their turn.
const MAX_CONCURRENT_REQUESTS: usize = 32;

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` until the process ends.
///
/// `/healthz` answers 200 while [`Metrics::liveness`] holds (the worker is not stalled), 503
/// otherwise; `/readyz` answers 200 only when [`Metrics::ready`] holds, 503 otherwise.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    let app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(health))
        .route("/readyz", get(readiness))
        .layer(GlobalConcurrencyLimitLayer::new(MAX_CONCURRENT_REQUESTS))
        .with_state(metrics);
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!(error = %e, "metrics endpoint stopped");
    }
}

async fn render_metrics(State(metrics): State<Arc<Metrics>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        metrics.render(),
    )
}

async fn health(State(metrics): State<Arc<Metrics>>) -> (StatusCode, String) {
    match metrics.liveness() {
        Ok(()) => (StatusCode::OK, "ok\n".into()),
        Err(why) => {
            tracing::error!(reason = %why, "liveness check failed: the worker makes no progress");
            (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n"))
        }
    }
}

async fn readiness(State(metrics): State<Arc<Metrics>>) -> (StatusCode, &'static str) {
    if metrics.ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

#[cfg(test)]
mod tests {
    use super::super::metrics::on_fake_clock;
    use super::*;
    use std::time::Duration;

    /// The probe itself: 200 while alive, 503 with the reason once stalled.
    #[tokio::test]
    async fn healthz_answers_503_when_stalled() {
        let (m, at) = on_fake_clock();
        let m = Arc::new(m);
        m.set_stall_threshold(Duration::from_secs(60));
        m.in_flight_add(1);
        at(60);
        assert_eq!(health(State(m.clone())).await.0, StatusCode::OK);
        at(61);
        let (code, body) = health(State(m.clone())).await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("without a commit"), "{body}");
    }
}
