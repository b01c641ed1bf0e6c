-- Tenant processors: WebAssembly components run on a tenant's requests and responses.
-- Uploading a name again adds a version; at most one version of a name is active.
CREATE TABLE processors (
    id          TEXT PRIMARY KEY,
    tenant_id   TEXT NOT NULL REFERENCES tenants(id),
    name        TEXT NOT NULL,
    version     INTEGER NOT NULL,
    sha256      TEXT NOT NULL,
    wasm        BLOB NOT NULL,
    -- JSON handed to the guest (host.config).
    config      TEXT NOT NULL DEFAULT '{}',
    cpu_ms      INTEGER NOT NULL,
    memory_mib  INTEGER NOT NULL,
    -- 1: runs on requests; 0: kept.
    active      INTEGER NOT NULL DEFAULT 0,
    -- NULL: every request of the tenant; else only this API key's.
    key_id      TEXT,
    -- Order among the tenant's processors: pre-processors run ascending, post-processors
    -- descending.
    position    INTEGER NOT NULL,
    created_at  INTEGER NOT NULL,
    UNIQUE (tenant_id, name, version)
);
CREATE INDEX processors_by_tenant ON processors(tenant_id, active);
