//! Configuration: every setting is a command-line flag with an environment-variable fallback.
//!
//! The environment names are part of the contract (docs/configuration.md, k8s manifests); the
//! flag names are their lower-case, dashed twins. Defaults run the README's Quick start: the
//! Pub/Sub emulator when `PUBSUB_EMULATOR_HOST` is set, and a SQLite file in the working
//! directory.

mod commands;
mod shared;
mod values;

pub use commands::*;
pub use shared::*;
pub use values::{parse_duration, MAX_BATCH_SIZE, MAX_MESSAGE_BYTES};

use crate::external::telemetry::LogFormat;
use clap::{Parser, Subcommand};
use values::choice;

/// spotinfer: batch inference on preemptible capacity without losing or duplicating a result.
#[derive(Debug, Parser)]
#[command(name = "spotinfer", version, about, long_about = None)]
pub struct Cli {
    /// Log format: text for people, json (one object per line, Cloud Logging `severity`).
    #[arg(
        long,
        env = "SPOTINFER_LOG_FORMAT",
        value_parser = choice::<LogFormat>(),
        default_value = "text",
        global = true
    )]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
// Parsed once per process: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create the topic and subscription (idempotent) and run the database migrations.
    Setup(SetupArgs),
    /// Publish records from a JSONL file (one `{"id","text","job"?}` object per line); with
    /// --job, register them as a job in the database first.
    Publish(PublishArgs),
    /// Run a worker until SIGTERM/SIGINT (or until idle, with --exit-when-idle).
    Work(WorkArgs),
    /// Run the model over a JSONL file offline, without Pub/Sub, into a JSONL file of results
    /// (vectors; labels, pair scores or entities for a task model).
    Embed(EmbedArgs),
    /// Measure model throughput on a JSONL file; the last line printed is a JSON report.
    Bench(BenchArgs),
    /// A job's progress (published, done, failed, remaining, rate, ETA, complete), or the
    /// database's done/failed counts.
    Status(StatusArgs),
    /// Stream a job's results (or `--failed`: its failure rows) to a .parquet or .jsonl file,
    /// local or gs://.
    Export(ExportArgs),
    /// Inspect a model folder: what spotinfer understood of it, or why it is refused.
    Models(ModelsArgs),
    /// Prove nothing is lost: publish, run K workers under injected faults, verify, report.
    /// Runs the `spotinfer-loadtest` binary installed beside this one (`crates/loadtest`), with
    /// these arguments; `spotinfer loadtest --help` lists them.
    #[command(disable_help_flag = true)]
    Loadtest(PassThroughArgs),
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use std::time::Duration;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    /// Settings that could only fail later (a statement past the bind limits, a lease Pub/Sub
    /// refuses, a silently clamped policy) are refused as the worker starts, naming the flag.
    #[test]
    fn out_of_range_settings_are_refused_at_start_up() {
        let parse = |extra: &[&str]| {
            let mut argv = vec!["spotinfer", "work", "--subscription", "s"];
            argv.extend_from_slice(extra);
            Cli::try_parse_from(argv)
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        assert!(parse(&[]).is_ok());
        for (flag, value) in [
            ("--batch-size", "0"),
            ("--batch-size", "100000"),
            ("--max-outstanding", "0"),
            ("--max-outstanding-bytes", "1000"),
            ("--streams", "0"),
            ("--lease-extension", "5s"),
            ("--lease-extension", "11m"),
            ("--commit-timeout", "0s"),
            ("--shutdown-timeout", "0s"),
            ("--drain-poll", "0s"),
            ("--drain-poll", "2m"),
            ("--job-poll", "0s"),
            ("--exit-when-idle", "0s"),
            ("--batch-wait", "2m"),
            ("--max-lease", "0s"),
            ("--max-lease", "30s"),
            ("--max-lease", "2d"),
            ("--stall-timeout", "0s"),
            ("--stall-timeout", "10s"),
            ("--max-text-bytes", "0"),
            ("--max-text-bytes", "20000000"),
        ] {
            let err = parse(&[flag, value]).expect_err(&format!("{flag} {value} accepted"));
            assert!(err.contains(flag), "{flag} {value}: {err}");
        }
        // A duration's error names its range.
        let err = parse(&["--drain-poll", "0s"]).unwrap_err();
        assert!(err.contains("outside the range 100ms to 1m"), "{err}");
        assert!(parse(&["--drain-poll", "100ms", "--batch-wait", "0s"]).is_ok());
        assert!(parse(&["--max-lease", "2h", "--stall-timeout", "10m"]).is_ok());
        let setup = |extra: &[&str]| {
            let mut argv = vec!["spotinfer", "setup"];
            argv.extend_from_slice(extra);
            Cli::try_parse_from(argv)
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        assert!(setup(&["--max-delivery-attempts", "4"]).is_err());
        assert!(setup(&["--max-delivery-attempts", "101"]).is_err());
        assert!(setup(&["--ack-deadline", "1s"]).is_err());
        assert!(setup(&["--max-retry-backoff", "11m"]).is_err());
        assert!(setup(&["--min-retry-backoff", "1h"]).is_err());
        assert!(setup(&["--max-delivery-attempts", "20"]).is_ok());
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert!(parse_duration("soon").unwrap_err().contains("500ms"));
    }
}
