-- Sharded inputs and column mappings (`spotinfer publish --keep-columns`, issue 45).
-- `source` and `origin` say where a job's record was first read: a hash of the input (file,
-- folder or prefix) and of its shard and row. A second row of the same input with the same id
-- is refused as a repeat; the same id in another input is the same record published again
-- (counted once: how `--skip-done` resumes a job from an overlapping file). NULL for records
-- registered before these columns existed, which are never taken for repeats.
-- `columns` holds the record's kept columns as a JSON object; `jobs.columns` their names and
-- export types (a JSON array of {"name", "type"}), the same for every input of a job.
ALTER TABLE job_records ADD COLUMN IF NOT EXISTS source BIGINT;
ALTER TABLE job_records ADD COLUMN IF NOT EXISTS origin BIGINT;
ALTER TABLE job_records ADD COLUMN IF NOT EXISTS columns TEXT;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS columns TEXT;
-- How far a publish of an input (a shard) got: every row up to `rows_done` is published and
-- confirmed, refused and recorded, or already done. A re-run after a crash reads on from there.
ALTER TABLE job_inputs ADD COLUMN IF NOT EXISTS rows_done BIGINT NOT NULL DEFAULT 0;
