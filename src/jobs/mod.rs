//! A batch job as its user sees it, from files in to a file out: [`publish`] an [`input`] (JSON
//! lines, CSV or Parquet; a file, a folder or a `gs://` prefix of shards; columns by name) as a
//! job (every id registered before its message goes out, every refused row recorded), and
//! [`export`] the job's results or failures to Parquet or JSON lines; [`offline`] runs a file
//! of records through a model with no queue and no database (`embed`, `bench`; a generation
//! model's bench in [`generation_bench`]). Where the job stands
//! (`status`) is a read of the job tables in [`crate::external::store`]; the workers in between
//! know nothing of jobs beyond the `job` field of a record.
//!
//! These are use cases built on the outside world (Pub/Sub, the database, Cloud Storage), not
//! adapters to it, so they live here rather than in `external`.

pub mod export;
pub mod generation_bench;
pub mod input;
pub mod offline;
pub mod publish;
