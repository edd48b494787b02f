-- Input lines `spotinfer publish --job` refused (not JSON, not UTF-8, an id over its limit or
-- holding NUL, a record naming another job, a line too large for a message): never published,
-- but each one belongs to its job, so `status` counts them and `export --failed` lists them.
-- A re-run of the same input replaces that input's rows (the file may have been fixed).
-- `raw` is the line's first 64 KiB as bytes (a line need not be UTF-8; the same as PostgreSQL's
-- BYTEA); `raw_bytes` and `raw_sha256` (hex) describe the whole line. `error` has any NUL
-- written as the six characters \u0000, as on PostgreSQL.
CREATE TABLE IF NOT EXISTS job_refused_lines (
    job         TEXT NOT NULL REFERENCES jobs (job),
    input       TEXT NOT NULL,
    line        INTEGER NOT NULL,
    error       TEXT NOT NULL,
    raw         BLOB NOT NULL,
    raw_bytes   INTEGER NOT NULL,
    raw_sha256  TEXT NOT NULL,
    refused_at  TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (job, input, line)
);
