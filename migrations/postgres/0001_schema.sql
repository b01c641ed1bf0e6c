-- The whole schema for PostgreSQL; the same tables as migrations/sqlite/0001-0003.
-- Times are Unix milliseconds; money is integer nano-USD; prices micro-USD per million tokens.

CREATE TABLE tenants (
    id                   TEXT PRIMARY KEY,
    name                 TEXT NOT NULL UNIQUE,
    created_at           BIGINT NOT NULL,
    rpm                  BIGINT,
    tpm                  BIGINT,
    max_concurrent       BIGINT,
    monthly_budget_nusd  BIGINT,
    budget_mode          TEXT NOT NULL DEFAULT 'hard'
);

CREATE TABLE api_keys (
    id             TEXT PRIMARY KEY,
    tenant_id      TEXT NOT NULL REFERENCES tenants(id),
    name           TEXT NOT NULL DEFAULT '',
    secret_sha256  BYTEA NOT NULL,
    created_at     BIGINT NOT NULL,
    revoked_at     BIGINT,
    rpm            BIGINT,
    tpm            BIGINT,
    max_concurrent BIGINT,
    scopes         TEXT NOT NULL DEFAULT 'inference,manage',
    models         TEXT,
    expires_at     BIGINT
);
CREATE INDEX api_keys_by_tenant ON api_keys(tenant_id);

CREATE TABLE jwt_issuers (
    id           TEXT PRIMARY KEY,
    tenant_id    TEXT NOT NULL REFERENCES tenants(id),
    issuer       TEXT NOT NULL UNIQUE,
    audience     TEXT NOT NULL,
    algorithm    TEXT NOT NULL,
    key_material TEXT,
    jwks         TEXT,
    jwks_url     TEXT,
    created_at   BIGINT NOT NULL
);

CREATE TABLE prices (
    model                          TEXT NOT NULL,
    effective_from                 BIGINT NOT NULL,
    input_micros_per_mtok          BIGINT NOT NULL,
    cached_input_micros_per_mtok   BIGINT NOT NULL,
    output_micros_per_mtok         BIGINT NOT NULL,
    created_at                     BIGINT NOT NULL,
    PRIMARY KEY (model, effective_from)
);

CREATE TABLE usage_records (
    request_id            TEXT PRIMARY KEY,
    tenant_id             TEXT NOT NULL REFERENCES tenants(id),
    key_id                TEXT,
    model                 TEXT NOT NULL,
    endpoint              TEXT NOT NULL,
    prompt_tokens         BIGINT NOT NULL,
    cached_tokens         BIGINT NOT NULL,
    completion_tokens     BIGINT NOT NULL,
    status                TEXT NOT NULL,
    finish_reason         TEXT,
    error_code            TEXT,
    started_at            BIGINT NOT NULL,
    finished_at           BIGINT NOT NULL,
    price_effective_from  BIGINT,
    cost_input_nusd       BIGINT NOT NULL DEFAULT 0,
    cost_cached_nusd      BIGINT NOT NULL DEFAULT 0,
    cost_output_nusd      BIGINT NOT NULL DEFAULT 0,
    cost_nusd             BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX usage_by_tenant_time ON usage_records(tenant_id, started_at);

CREATE TABLE tenant_spend (
    tenant_id  TEXT NOT NULL,
    month      TEXT NOT NULL,
    cost_nusd  BIGINT NOT NULL,
    requests   BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, month)
);
