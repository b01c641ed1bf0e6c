-- People of a tenant (dashboard sign-in), each with one role; see the book's
-- "Members and roles" page for what each role may do. A member signs in with a password
-- (Argon2id, PHC string) or, later, through the tenant's identity provider. Removing a
-- member deletes the row and every session it opened.
CREATE TABLE members (
    id            TEXT PRIMARY KEY,
    tenant_id     TEXT NOT NULL REFERENCES tenants(id),
    -- lower-cased
    email         TEXT NOT NULL,
    role          TEXT NOT NULL,
    password_hash TEXT,
    created_at    BIGINT NOT NULL,
    UNIQUE (tenant_id, email)
);

-- An invitation to become a member: the link's token is shown once; only its SHA-256 is
-- kept. Accepting deletes it.
CREATE TABLE member_invitations (
    id           TEXT PRIMARY KEY,
    token_sha256 TEXT NOT NULL UNIQUE,
    tenant_id    TEXT NOT NULL REFERENCES tenants(id),
    email        TEXT NOT NULL,
    role         TEXT NOT NULL,
    invited_by   TEXT NOT NULL,
    created_at   BIGINT NOT NULL,
    expires_at   BIGINT NOT NULL,
    UNIQUE (tenant_id, email)
);
-- Removing a member deletes its sessions by this column.
CREATE INDEX dashboard_sessions_credential ON dashboard_sessions(credential);
