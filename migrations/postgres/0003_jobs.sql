-- Jobs: what `spotinfer publish --job` registered, so `status` can say "N of M" and "complete".
-- The model is the one whose results count as done (a job re-embedded with a second model is a
-- second job).
CREATE TABLE IF NOT EXISTS jobs (
    job         TEXT PRIMARY KEY,
    model       TEXT NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- One row per input published to a job; finished_at stays NULL while a publish runs, and after
-- one that was interrupted (re-run it: the job is not complete until it finishes).
CREATE TABLE IF NOT EXISTS job_inputs (
    job         TEXT NOT NULL REFERENCES jobs (job),
    input       TEXT NOT NULL,
    records     BIGINT NOT NULL DEFAULT 0,
    started_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    finished_at TIMESTAMPTZ,
    PRIMARY KEY (job, input)
);

-- Every record id a job published, written before its message is: the expected total is a count
-- of distinct ids, so a publish re-run after a crash cannot double it.
CREATE TABLE IF NOT EXISTS job_records (
    job         TEXT NOT NULL,
    record_id   TEXT NOT NULL,
    PRIMARY KEY (job, record_id)
);

-- status: a failed record is one with a failure row and no result; the last minute's rate.
CREATE INDEX IF NOT EXISTS failed_records_record ON failed_records (record_id);
CREATE INDEX IF NOT EXISTS embeddings_processed_at ON embeddings (processed_at);
