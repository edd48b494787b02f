-- Issue 52: a checkpoint names the engine that wrote its tokens (device, precision, kernels),
-- and `model_hash` now names only the weights and settings, so a record interrupted on one
-- engine (the CPU decoder, the paged GPU decoder, bf16 or f32) continues on another. Rows
-- saved before carry no engine and a hash with the engine's mark in it: they start over.
ALTER TABLE generation_checkpoints ADD COLUMN IF NOT EXISTS engine TEXT;
