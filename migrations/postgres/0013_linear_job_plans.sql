-- Indexes the planner cannot turn into a loop over the whole table for every record of a job.
-- Right after a bulk load, before statistics catch up, PostgreSQL estimates one row for a new
-- job and a new model and joined job_records to embeddings by a nested loop whose inner side was
-- `embeddings_model` (every row of the model, filtered for one record id): quadratic, over 10
-- minutes for a 200,000-record `status`. With it gone, the only index that reads embeddings by
-- model is the primary key (record_id, model), which must be entered by record id: a lookup per
-- record. Likewise failed_records is read by (record_id, job), never by job alone inside a join;
-- a job's own failure rows (export --failed) are one scan of the table.
DROP INDEX IF EXISTS embeddings_model;
DROP INDEX IF EXISTS failed_records_job;
DROP INDEX IF EXISTS failed_records_record;
CREATE INDEX IF NOT EXISTS failed_records_record_job ON failed_records (record_id, job);
