-- Per-principal limits for JWT subjects (see migrations/sqlite/0005_principal_limits.sql).
CREATE TABLE principal_limits (
    principal      TEXT PRIMARY KEY,
    tenant_id      TEXT NOT NULL REFERENCES tenants(id),
    rpm            BIGINT,
    tpm            BIGINT,
    max_concurrent BIGINT
);
