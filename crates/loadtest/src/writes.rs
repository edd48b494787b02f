//! Who committed each record, and when: on PostgreSQL a trigger logs every write to the results
//! table with the writer's `application_name` (each worker start connects as `w{slot}-{n}`), so
//! the verdict can tell a record redone after a graceful stop (a defect: the stopping worker
//! must finish its commit and ack it) from the redo at-least-once delivery allows after a
//! SIGKILL or a database outage. SQLite has no session name to log; there the count is skipped.

use crate::LoadtestError;
use spotinfer::external::store::Store;
use std::collections::HashMap;

/// The database URL a worker named `name` connects with: PostgreSQL URLs gain an
/// `application_name`; others are returned as they are.
pub fn named_url(url: &str, name: &str) -> String {
    if !url.starts_with("postgres") {
        return url.to_string();
    }
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name={name}")
}

/// Seconds since the epoch, as the database's `clock_timestamp()` counts them.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

const INSTALL: [&str; 3] = [
    "CREATE TABLE IF NOT EXISTS loadtest_writes (
        record_id TEXT NOT NULL,
        writer TEXT NOT NULL,
        at DOUBLE PRECISION NOT NULL)",
    "CREATE OR REPLACE FUNCTION loadtest_log_write() RETURNS trigger AS $$
     BEGIN
        INSERT INTO loadtest_writes VALUES (
            NEW.record_id, current_setting('application_name'),
            extract(epoch FROM clock_timestamp()));
        RETURN NEW;
     END $$ LANGUAGE plpgsql",
    "CREATE OR REPLACE TRIGGER loadtest_log_write AFTER INSERT OR UPDATE ON embeddings
     FOR EACH ROW EXECUTE FUNCTION loadtest_log_write()",
];

/// Installs the write log; false on SQLite, where it is not kept.
pub async fn install(store: &Store) -> Result<bool, LoadtestError> {
    let Store::Postgres(pool) = store else {
        return Ok(false);
    };
    for sql in INSTALL {
        sqlx::query(sql).execute(pool).await.map_err(db)?;
    }
    Ok(true)
}

/// Removes the trigger (the table stays, for a look after the run).
pub async fn uninstall(store: &Store) -> Result<(), LoadtestError> {
    if let Store::Postgres(pool) = store {
        sqlx::query("DROP TRIGGER IF EXISTS loadtest_log_write ON embeddings")
            .execute(pool)
            .await
            .map_err(db)?;
    }
    Ok(())
}

/// One write of a result row.
#[derive(Debug, Clone, PartialEq)]
pub struct Write {
    /// The record.
    pub record_id: String,
    /// The worker start that wrote it (`w{slot}-{n}`).
    pub writer: String,
    /// When, seconds since the epoch.
    pub at: f64,
}

/// The writes of records whose id starts with `prefix`, oldest first.
pub async fn read(store: &Store, prefix: &str) -> Result<Vec<Write>, LoadtestError> {
    let Store::Postgres(pool) = store else {
        return Ok(Vec::new());
    };
    let rows: Vec<(String, String, f64)> = sqlx::query_as(
        "SELECT record_id, writer, at FROM loadtest_writes
         WHERE starts_with(record_id, $1) ORDER BY at",
    )
    .bind(prefix)
    .fetch_all(pool)
    .await
    .map_err(db)?;
    Ok(rows
        .into_iter()
        .map(|(record_id, writer, at)| Write {
            record_id,
            writer,
            at,
        })
        .collect())
}

/// What the write log shows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Redone {
    /// Records written more than once, for any reason.
    pub any: usize,
    /// Records a worker wrote in its last second or after its SIGTERM (it then exited 0) that
    /// another worker wrote again: the commit in flight at a graceful stop was not acked.
    pub after_graceful_stop: usize,
}

/// Counts redone records. `graceful` maps each worker start that exited 0 after a SIGTERM to
/// when the signal was sent; writes inside `excused` windows (a database outage, where a commit
/// can land while its worker sees an error) do not count against a graceful stop.
pub fn redone(writes: &[Write], graceful: &HashMap<String, f64>, excused: &[(f64, f64)]) -> Redone {
    let mut by_record: HashMap<&str, Vec<&Write>> = HashMap::new();
    for w in writes {
        by_record.entry(&w.record_id).or_default().push(w);
    }
    let mut out = Redone::default();
    for ws in by_record.values().filter(|ws| ws.len() > 1) {
        out.any += 1;
        let defect = ws.iter().enumerate().any(|(i, w)| {
            let stopping = graceful
                .get(&w.writer)
                .is_some_and(|&signalled| w.at >= signalled - 1.0);
            let excused = excused
                .iter()
                .any(|&(a, b)| w.at >= a - 1.0 && w.at <= b + 1.0);
            stopping && !excused && ws[i + 1..].iter().any(|later| later.writer != w.writer)
        });
        if defect {
            out.after_graceful_stop += 1;
        }
    }
    out
}

fn db(e: sqlx::Error) -> LoadtestError {
    LoadtestError::Io(format!("write log: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(record_id: &str, writer: &str, at: f64) -> Write {
        Write {
            record_id: record_id.into(),
            writer: writer.into(),
            at,
        }
    }

    #[test]
    fn a_redo_counts_against_a_graceful_stop_only_for_its_last_commits() {
        let graceful = HashMap::from([("w0-1".to_string(), 100.0)]);
        let writes = [
            // Written by w0-1 while it stopped, then again by w1-1: the defect.
            w("a", "w0-1", 100.2),
            w("a", "w1-1", 103.0),
            // Written by w0-1 long before its SIGTERM and redone: at-least-once, not a defect.
            w("b", "w0-1", 50.0),
            w("b", "w1-1", 51.0),
            // Written by a SIGKILLed start and redone.
            w("c", "w2-1", 100.5),
            w("c", "w1-1", 104.0),
            // Written once.
            w("d", "w0-1", 100.3),
        ];
        let r = redone(&writes, &graceful, &[]);
        assert_eq!(
            r,
            Redone {
                any: 3,
                after_graceful_stop: 1
            }
        );
        // Inside a database outage the same redo is excused.
        let r = redone(&writes, &graceful, &[(99.0, 101.0)]);
        assert_eq!(r.after_graceful_stop, 0);
    }

    #[test]
    fn only_postgres_urls_are_named() {
        assert_eq!(
            named_url("postgres://u@h/db", "w0-1"),
            "postgres://u@h/db?application_name=w0-1"
        );
        assert_eq!(
            named_url("postgres://u@h/db?sslmode=disable", "w1-2"),
            "postgres://u@h/db?sslmode=disable&application_name=w1-2"
        );
        assert_eq!(
            named_url("sqlite:///tmp/x.db", "w0-1"),
            "sqlite:///tmp/x.db"
        );
    }
}
