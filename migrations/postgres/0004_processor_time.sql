-- Tenant processors' CPU time per request, and its price class (see the SQLite twin).
ALTER TABLE usage_records ADD COLUMN processor_us BIGINT NOT NULL DEFAULT 0;
ALTER TABLE usage_records ADD COLUMN cost_processor_nusd BIGINT NOT NULL DEFAULT 0;
ALTER TABLE prices ADD COLUMN processor_micros_per_cpu_s BIGINT NOT NULL DEFAULT 0;
