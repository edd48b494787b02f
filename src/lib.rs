//! spotinfer: batch inference on preemptible capacity without losing or duplicating a result.
//!
//! Three folders, one question each:
//!
//! * [`pipeline`]: the path one message travels, a stage a file, from the Pub/Sub source to
//!   the ack after commit:
//!
//!   ```text
//!    source  ->  batcher  ->  infer  ->  sink
//!    every message carries an `Ack`; only the sink resolves it, after its commit;
//!    infer talks to the model through one trait, model::Infer, and knows no task
//!   ```
//!
//! * [`model`]: every model the worker runs behind that one seam: the engines that compute a
//!   network (the fused CPU networks of `crates/fused-cpu`, candle on the CPU or CUDA), apart
//!   from the tasks that say what goes in and comes out (embed, classify, score, tag, images,
//!   generate), the factory that loads a folder, and the thread that runs it.
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

#![deny(missing_docs)]

pub mod alloc;
pub mod choice;
pub mod config;
pub mod external;
pub mod jobs;
pub mod model;
pub mod pipeline;
pub mod record;
pub mod shutdown;
