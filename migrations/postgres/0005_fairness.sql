-- Fair scheduling (see migrations/sqlite/0007_fairness.sql).
ALTER TABLE tenants ADD COLUMN share BIGINT;
ALTER TABLE tenants ADD COLUMN priority TEXT;
ALTER TABLE api_keys ADD COLUMN share BIGINT;
ALTER TABLE api_keys ADD COLUMN priority TEXT;
ALTER TABLE principal_limits ADD COLUMN share BIGINT;
ALTER TABLE principal_limits ADD COLUMN priority TEXT;
