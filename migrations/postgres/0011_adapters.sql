-- Tenants' LoRA adapters for catalogue models. The files live in the adapter store (a
-- directory shared with the workers), content-addressed by digest, so identical uploads
-- are stored once; a row is one version of a tenant's adapter name for one base model.
CREATE TABLE adapters (
    id          TEXT PRIMARY KEY,
    tenant_id   TEXT NOT NULL REFERENCES tenants(id),
    name        TEXT NOT NULL,
    version     BIGINT NOT NULL,
    base_model  TEXT NOT NULL,
    -- SHA-256 of the files (hearth_protocol::adapter), their name in the store.
    digest      TEXT NOT NULL,
    -- 'peft' (a directory) or 'gguf' (one file).
    format      TEXT NOT NULL,
    -- The rank in adapter_config.json (NULL for GGUF, whose modules carry their own).
    rank        BIGINT,
    size        BIGINT NOT NULL,
    created_at  BIGINT NOT NULL,
    UNIQUE (tenant_id, name, version)
);
CREATE INDEX adapters_by_digest ON adapters(digest);

-- The adapter a request ran under (its name; NULL: the base model).
ALTER TABLE usage_records ADD COLUMN adapter TEXT;
