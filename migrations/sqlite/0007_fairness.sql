-- Fair scheduling: a tenant's share (its weight on a saturated worker) and the priority
-- class of its requests (`interactive` or `batch`); a key's or JWT subject's class can only
-- lower its tenant's. NULL: share 1, interactive.
ALTER TABLE tenants ADD COLUMN share BIGINT;
ALTER TABLE tenants ADD COLUMN priority TEXT;
ALTER TABLE api_keys ADD COLUMN share BIGINT;
ALTER TABLE api_keys ADD COLUMN priority TEXT;
ALTER TABLE principal_limits ADD COLUMN share BIGINT;
ALTER TABLE principal_limits ADD COLUMN priority TEXT;
