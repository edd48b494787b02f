-- A failure row keeps at most the first 64 KiB of a refused payload, with the whole payload's
-- size and SHA-256: a 10 MB bad message no longer becomes a 10 MB row. Rows written before this
-- migration kept their payload whole; their size is its length.
ALTER TABLE failed_records ADD COLUMN IF NOT EXISTS payload_bytes BIGINT;
ALTER TABLE failed_records ADD COLUMN IF NOT EXISTS payload_sha256 TEXT;
UPDATE failed_records SET payload_bytes = length(payload) WHERE payload_bytes IS NULL;
UPDATE failed_records SET payload_sha256 = encode(sha256(payload), 'hex') WHERE payload_sha256 IS NULL;
ALTER TABLE failed_records ALTER COLUMN payload_bytes SET NOT NULL;
ALTER TABLE failed_records ALTER COLUMN payload_sha256 SET NOT NULL;
