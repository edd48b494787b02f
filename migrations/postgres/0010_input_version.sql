-- What identifies an input's (a shard's) content when a publish read it: a Cloud Storage
-- object's generation, or a local file's size and modification time. A re-run resumes from
-- `rows_done` only while it is the same, so a shard re-exported to the same path is not read
-- past its first `rows_done` rows as if they were the old ones. NULL for publishes made before
-- this column existed (taken as unknown, and resumed).
ALTER TABLE job_inputs ADD COLUMN IF NOT EXISTS version TEXT;
