-- The same indexes as PostgreSQL's (see migrations/postgres/0013): none that a join over a job
-- could use to read a whole model or a whole job's failures for every record.
DROP INDEX IF EXISTS embeddings_model;
DROP INDEX IF EXISTS failed_records_job;
DROP INDEX IF EXISTS failed_records_record;
CREATE INDEX IF NOT EXISTS failed_records_record_job ON failed_records (record_id, job);
