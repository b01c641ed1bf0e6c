-- Single sign-on: a tenant's OpenID Connect identity provider (one per tenant), the
-- identity a member signed in with, and the ID-token nonces already used (a replayed
-- token is refused; rows are purged once the nonce could no longer be accepted).
CREATE TABLE sso_providers (
    tenant_id     TEXT PRIMARY KEY REFERENCES tenants(id),
    issuer        TEXT NOT NULL,
    client_id     TEXT NOT NULL,
    client_secret TEXT,
    created_at    BIGINT NOT NULL
);

ALTER TABLE members ADD COLUMN sso_issuer TEXT;
ALTER TABLE members ADD COLUMN sso_subject TEXT;
CREATE UNIQUE INDEX members_sso ON members(tenant_id, sso_issuer, sso_subject);

CREATE TABLE sso_nonces (
    nonce      TEXT PRIMARY KEY,
    expires_at BIGINT NOT NULL
);

-- A suspended tenant's credentials, sessions and members are refused (403
-- tenant_suspended) until the operator resumes it; nothing else changes.
ALTER TABLE tenants ADD COLUMN suspended_at BIGINT;

-- `hearth admin login`: an operator signed in through the provider in a browser; the CLI
-- that started it trades the one-time code (with its PKCE verifier) for a session within a
-- minute. Only the code's SHA-256 is kept.
CREATE TABLE cli_grants (
    code_sha256 TEXT PRIMARY KEY,
    email       TEXT NOT NULL,
    challenge   TEXT NOT NULL,
    expires_at  BIGINT NOT NULL
);
