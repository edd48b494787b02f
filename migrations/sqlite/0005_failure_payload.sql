-- A failure row keeps at most the first 64 KiB of a refused payload, with the whole payload's
-- size and SHA-256 (see migrations/postgres/0005). SQLite has no sha256(): rows written before
-- this migration (kept whole) get '' and their length.
ALTER TABLE failed_records ADD COLUMN payload_bytes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE failed_records ADD COLUMN payload_sha256 TEXT NOT NULL DEFAULT '';
UPDATE failed_records SET payload_bytes = length(payload);
