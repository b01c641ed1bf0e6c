-- Tenant processors (see migrations/sqlite/0004_processors.sql).
CREATE TABLE processors (
    id          TEXT PRIMARY KEY,
    tenant_id   TEXT NOT NULL REFERENCES tenants(id),
    name        TEXT NOT NULL,
    version     BIGINT NOT NULL,
    sha256      TEXT NOT NULL,
    wasm        BYTEA NOT NULL,
    config      TEXT NOT NULL DEFAULT '{}',
    cpu_ms      BIGINT NOT NULL,
    memory_mib  BIGINT NOT NULL,
    active      BIGINT NOT NULL DEFAULT 0,
    key_id      TEXT,
    position    BIGINT NOT NULL,
    created_at  BIGINT NOT NULL,
    UNIQUE (tenant_id, name, version)
);
CREATE INDEX processors_by_tenant ON processors(tenant_id, active);
