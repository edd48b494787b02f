//! Telemetry: logs through `tracing`, counters for Prometheus, and the worker's HTTP port.
//!
//! The metrics live in a `prometheus-client` registry (atomic counters, gauges and histograms,
//! rendered in the OpenMetrics text format); axum serves them with the health and readiness
//! probes, only when `SPOTINFER_METRICS_ADDR` is set.
//!
//! Liveness is about progress, not only about the process answering: `/healthz` fails once the
//! worker has held messages continuously for longer than its stall threshold without committing
//! any (see [`Metrics::liveness`] and [`stall_threshold`]), so Kubernetes restarts a wedged
//! worker (a hung model thread or device, a deadlocked stage) instead of leaving it to sit on its
//! leases.
//!
//! One job a file:
//!
//! * `logging`: [`LogFormat`] and [`init_logging`] (text, or JSON with Cloud Logging's fields);
//! * `metrics`: [`Metrics`], the registry and the counters every stage updates;
//! * `health`: the readiness conditions and the liveness (stall) rule, with its threshold;
//!   `progress`: the liveness clock it reads;
//! * `server`: [`serve`], the `/metrics`, `/healthz` and `/readyz` endpoints.

mod health;
mod logging;
mod metrics;
mod progress;
mod server;

pub use health::{longest_batch, stall_threshold};
pub use logging::{init_logging, LogFormat};
pub use metrics::{Counts, Metrics};
pub use server::serve;
