-- Job-mode heartbeats (see migrations/postgres/0012). beat_at as the other tables keep times:
-- ISO 8601 text in UTC, which compares in time order.
CREATE TABLE IF NOT EXISTS job_workers (
    job      TEXT NOT NULL,
    worker   TEXT NOT NULL,
    holding  INTEGER NOT NULL,
    beat_at  TEXT NOT NULL,
    PRIMARY KEY (job, worker)
);
