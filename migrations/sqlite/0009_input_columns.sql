-- Sharded inputs and column mappings (see migrations/postgres/0009).
ALTER TABLE job_records ADD COLUMN source BIGINT;
ALTER TABLE job_records ADD COLUMN origin BIGINT;
ALTER TABLE job_records ADD COLUMN columns TEXT;
ALTER TABLE jobs ADD COLUMN columns TEXT;
ALTER TABLE job_inputs ADD COLUMN rows_done BIGINT NOT NULL DEFAULT 0;
