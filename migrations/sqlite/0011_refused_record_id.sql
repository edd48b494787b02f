-- The record id a refused row names, where the reader could tell it (see migrations/postgres/0011).
ALTER TABLE job_refused_lines ADD COLUMN record_id TEXT;
