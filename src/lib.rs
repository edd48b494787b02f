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
//! * [`model`]: tokenization, the encoders behind one `Embedder` (the fused CPU encoder of
//!   `crates/bert-cpu`, the candle encoder for CUDA), pooling, and the thread that runs them.
//! * [`external`]: the outside world the pipeline talks to: Pub/Sub, Cloud Storage, the
//!   database (results, failures and jobs), the early-drain watches, logs and metrics.
//!
//! Beside the worker's path, [`export`] streams a job's rows out of the database into Parquet
//! or JSON lines files, local or `gs://`.
//!
//! Beside them, the vocabulary all three share: [`config`] (every setting, a flag with an
//! environment fallback), [`record`] (the message data contract) and [`shutdown`] (the
//! cancellation handed to every task). The commands themselves
//! (`setup`, `publish`, `work`, …) are thin entry points in the binary's `src/commands/`; the
//! load test is a crate of its own (`crates/loadtest`), so the worker a user deploys carries no
//! chaos tooling.

pub mod choice;
pub mod config;
pub mod export;
pub mod external;
pub mod model;
pub mod pipeline;
pub mod record;
pub mod shutdown;
