-- Tenants, their API keys, and one usage row per request.
-- Times are Unix milliseconds.

CREATE TABLE tenants (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL UNIQUE,
    created_at  INTEGER NOT NULL
);

CREATE TABLE api_keys (
    -- The public half of the key (`hk_<id>_<secret>`); the secret is stored only as SHA-256.
    id             TEXT PRIMARY KEY,
    tenant_id      TEXT NOT NULL REFERENCES tenants(id),
    name           TEXT NOT NULL DEFAULT '',
    secret_sha256  BLOB NOT NULL,
    created_at     INTEGER NOT NULL,
    revoked_at     INTEGER
);
CREATE INDEX api_keys_by_tenant ON api_keys(tenant_id);

CREATE TABLE usage_records (
    request_id         TEXT PRIMARY KEY,
    tenant_id          TEXT NOT NULL REFERENCES tenants(id),
    key_id             TEXT,
    model              TEXT NOT NULL,
    endpoint           TEXT NOT NULL,
    prompt_tokens      INTEGER NOT NULL,
    cached_tokens      INTEGER NOT NULL,
    completion_tokens  INTEGER NOT NULL,
    -- completed | cancelled | failed
    status             TEXT NOT NULL,
    finish_reason      TEXT,
    error_code         TEXT,
    started_at         INTEGER NOT NULL,
    finished_at        INTEGER NOT NULL
);
CREATE INDEX usage_by_tenant_time ON usage_records(tenant_id, started_at);
