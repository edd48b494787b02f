//! The outside world the pipeline and the commands talk to, each behind its own error type.
//!
//! * [`pubsub`]: topic and subscription names, clients, publishers, `setup`;
//! * [`gcs`]: models and `uri` inputs from Cloud Storage;
//! * [`hub`]: models by Hugging Face Hub id, in the Hub's own cache;
//! * [`store`]: the result and failure tables in PostgreSQL or SQLite;
//! * [`drain`]: the preemption watches that start a drain before SIGTERM;
//! * [`telemetry`]: logs, metrics and the `/metrics`, `/healthz`, `/readyz` endpoints.

pub mod drain;
mod file_lock;
pub mod gcs;
pub mod hub;
pub mod pubsub;
pub mod store;
pub mod telemetry;
