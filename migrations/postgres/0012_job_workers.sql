-- Job-mode heartbeats (`work --exit-when-job-complete`): each worker writes, at every poll of its
-- job, that it is alive and how many of the job's messages it holds. An idle worker whose job
-- has not moved for `--exit-when-idle` exits 66 only when no other worker has said, recently,
-- that it holds some: a long batch (an LLM's answers) commits nothing for minutes but is work.
-- No foreign key: a worker may start before the job's publish registers it.
CREATE TABLE IF NOT EXISTS job_workers (
    job      TEXT NOT NULL,
    worker   TEXT NOT NULL,
    holding  BIGINT NOT NULL,
    beat_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (job, worker)
);
