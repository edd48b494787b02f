-- What an input's content was when a publish got through part of it (see migrations/postgres/0010).
ALTER TABLE job_inputs ADD COLUMN version TEXT;
