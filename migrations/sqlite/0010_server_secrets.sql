-- Secrets the gateways of one installation share, created on first use: e.g. the key that
-- signs the dashboard sign-in form's anti-CSRF token, so that a form served by one gateway
-- can be posted to another.
CREATE TABLE server_secrets (
    name       TEXT PRIMARY KEY,
    -- hex
    value      TEXT NOT NULL,
    created_at BIGINT NOT NULL
);
