//! spotinfer: batch inference on preemptible capacity without losing or duplicating a result.
//!
//! Three folders, one question each:
//!
//! * [`pipeline`]: the path one message travels, a stage a file, from the Pub/Sub source to
//!   the ack after commit:
//!
//!   ```text
//!    source  ->  batcher  ->  embed (model stage)  ->  sink
//!    every message carries an `Ack`; only the sink resolves it, after its commit
//!   ```
//!
//! * [`model`]: every model the worker runs (text encoders with their task heads, image models,
//!   generation's decoder), the engines that compute them (the fused CPU encoder of
//!   `crates/fused-cpu`, candle on the CPU or CUDA, the CPU decoder), and the thread that runs
//!   them.
//! * [`external`]: the outside world the pipeline talks to: Pub/Sub, Cloud Storage, the
//!   database (results, failures and jobs), the early-drain watches, logs and metrics.
//!
//! Beside the worker's path, [`jobs`] holds what a batch user does with a job: publish a file
//! as one, and export its rows into Parquet or JSON lines files, local or `gs://`.
//!
//! Beside them, what they share: [`record`] (the message data contract), [`shutdown`] (the
//! cancellation handed to every task) and [`choice`] (settings picked by name); [`config`] is
//! the command line only (every setting, a flag with an environment fallback), mapped once onto
//! each layer's own settings, and no layer imports it. The commands themselves
//! (`setup`, `publish`, `work`, …) are thin entry points in the binary's `src/commands/`; the
//! load test is a crate of its own (`crates/loadtest`), so the worker a user deploys carries no
//! chaos tooling.

pub mod choice;
pub mod config;
pub mod external;
pub mod jobs;
pub mod model;
pub mod pipeline;
pub mod record;
pub mod shutdown;
