-- The record id a refused row names, where the reader could tell it: a table row's id column
-- (or its generated id), read before what refused the row. `export --failed` shows it; NULL
-- where no id could be read, and for rows refused before this column existed (export then
-- reads the id from the raw line if it can).
ALTER TABLE job_refused_lines ADD COLUMN IF NOT EXISTS record_id TEXT;
