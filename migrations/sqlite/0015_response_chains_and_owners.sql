-- A stored response keeps its own items once: a continuation names the response it continues
-- (previous_response_id) and its conversation is read by walking that chain, not copied.
-- Rows stored before this migration hold their inherited items themselves (previous_id NULL).
ALTER TABLE stored_responses ADD COLUMN previous_id TEXT;
-- Eviction past a tenant's quotas drops the least recently continued first; the tenant's
-- stored bytes are summed from the index alone (the rows' large columns are not read).
CREATE INDEX stored_responses_by_tenant_expiry ON stored_responses(tenant_id, expires_at, bytes);
-- The API key that created a file (an upload's; a batch output's is its batch's key) and a
-- stored response: a key restricted to some models sees only its own. NULL: created
-- before this migration, or by the operator; seen by unrestricted keys only.
ALTER TABLE files ADD COLUMN key_id TEXT;
ALTER TABLE stored_responses ADD COLUMN key_id TEXT;
