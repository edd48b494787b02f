//! spotinfer: batch inference on preemptible capacity without losing or duplicating a result.
//!
//! The worker is a pipeline whose stages each live in their own module:
//!
//! ```text
//!  source (Pub/Sub streaming pull)  ->  batcher  ->  model (own thread)  ->  sink (store)
//!        every message carries an `Ack`; only the sink resolves it, after its commit
//! ```
//!
//! * [`source`] pulls messages and parses them into [`record::Record`]s; each carries an [`ack::Ack`].
//! * [`batcher`] groups records into bounded batches.
//! * [`model`] runs the embedding model on a dedicated thread behind a channel; its fast CPU
//!   encoder is the `spotinfer-bert-cpu` crate (`crates/bert-cpu`).
//! * [`sink`] writes a batch and its failures in one transaction through [`store`], then acks.
//! * [`shutdown`] turns SIGTERM/SIGINT into a cancellation every stage watches.
//! * [`worker`] wires the stages together and runs the shutdown sequence.
//! * [`config`] holds every setting (flags with environment fallbacks), [`telemetry`] logs and metrics.

pub mod ack;
pub mod batcher;
pub mod chaos;
pub mod config;
pub mod drain;
pub mod emulator;
pub mod gcs;
pub mod loadtest;
pub mod model;
pub mod offline;
pub mod publish;
pub mod pubsub;
pub mod record;
pub mod shutdown;
pub mod sink;
pub mod source;
pub mod store;
pub mod telemetry;
pub mod worker;
