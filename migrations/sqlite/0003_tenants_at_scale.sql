-- Tenants at scale: key scopes, allowed models and expiry; JWT issuers; monthly budgets;
-- versioned prices; rated usage and the monthly spend each gateway checks budgets against.
-- Money is integer nano-USD (1e-9 USD); prices are integer micro-USD per million tokens.

ALTER TABLE api_keys ADD COLUMN scopes TEXT NOT NULL DEFAULT 'inference,manage';
-- Comma-separated model ids the key may use; NULL means every model.
ALTER TABLE api_keys ADD COLUMN models TEXT;
ALTER TABLE api_keys ADD COLUMN expires_at INTEGER;

ALTER TABLE tenants ADD COLUMN monthly_budget_nusd INTEGER;
-- hard: refuse requests once the month's spend reaches the budget; soft: warn only.
ALTER TABLE tenants ADD COLUMN budget_mode TEXT NOT NULL DEFAULT 'hard';

CREATE TABLE jwt_issuers (
    id           TEXT PRIMARY KEY,
    tenant_id    TEXT NOT NULL REFERENCES tenants(id),
    -- The `iss` claim; unique across tenants.
    issuer       TEXT NOT NULL UNIQUE,
    audience     TEXT NOT NULL,
    -- The one algorithm accepted (HS256, RS256, EdDSA, …): pinned, never read from a token.
    algorithm    TEXT NOT NULL,
    -- A PEM public key or an HMAC secret, or a JWKS document, or a JWKS URL.
    key_material TEXT,
    jwks         TEXT,
    jwks_url     TEXT,
    created_at   INTEGER NOT NULL
);

-- A price is never updated: a change is a new row with a later effective_from.
CREATE TABLE prices (
    model                          TEXT NOT NULL,
    effective_from                 INTEGER NOT NULL,
    input_micros_per_mtok          INTEGER NOT NULL,
    cached_input_micros_per_mtok   INTEGER NOT NULL,
    output_micros_per_mtok         INTEGER NOT NULL,
    created_at                     INTEGER NOT NULL,
    PRIMARY KEY (model, effective_from)
);

ALTER TABLE usage_records ADD COLUMN price_effective_from INTEGER;
ALTER TABLE usage_records ADD COLUMN cost_input_nusd INTEGER NOT NULL DEFAULT 0;
ALTER TABLE usage_records ADD COLUMN cost_cached_nusd INTEGER NOT NULL DEFAULT 0;
ALTER TABLE usage_records ADD COLUMN cost_output_nusd INTEGER NOT NULL DEFAULT 0;
ALTER TABLE usage_records ADD COLUMN cost_nusd INTEGER NOT NULL DEFAULT 0;

-- Spend per tenant and calendar month (UTC), written in the same transaction as the usage
-- row it counts.
CREATE TABLE tenant_spend (
    tenant_id  TEXT NOT NULL,
    month      TEXT NOT NULL,
    cost_nusd  INTEGER NOT NULL,
    requests   INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, month)
);
