-- Per-principal limits for JWT subjects (`jwt:<issuer id>:<sub>`), as api_keys has for keys.
CREATE TABLE principal_limits (
    principal      TEXT PRIMARY KEY,
    tenant_id      TEXT NOT NULL REFERENCES tenants(id),
    rpm            BIGINT,
    tpm            BIGINT,
    max_concurrent BIGINT
);
