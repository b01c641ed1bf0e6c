-- The dashboard's server-side sessions, the audit log of management actions, and each
-- request's time to first token.

-- A dashboard session. The cookie holds a random token; only its SHA-256 is stored here.
-- kind: tenant (signed in with an API key or JWT that has the `manage` scope) or operator
-- (the admin token). A tenant session names its credential: an API key id (checked again
-- on every request, so revoking the key ends the session) or a JWT principal with the
-- scopes and models the token carried.
CREATE TABLE dashboard_sessions (
    token_sha256  TEXT PRIMARY KEY,
    kind          TEXT NOT NULL,
    tenant_id     TEXT,
    credential    TEXT,
    scopes        TEXT,
    models        TEXT,
    -- operator sessions: a fingerprint of the admin token they were opened with.
    admin_fp      TEXT,
    csrf          TEXT NOT NULL,
    address       TEXT,
    created_at    BIGINT NOT NULL,
    last_seen     BIGINT NOT NULL,
    expires_at    BIGINT NOT NULL
);
CREATE INDEX dashboard_sessions_expiry ON dashboard_sessions(expires_at);

-- Who did what to which object, when and from where: written by the management service
-- for the admin API, the self-service API, the dashboard and the CLI alike.
CREATE TABLE audit_log (
    id         TEXT PRIMARY KEY,
    at         BIGINT NOT NULL,
    -- The tenant the object belongs to (NULL: not a tenant's, e.g. a price).
    tenant_id  TEXT,
    -- admin | cli:<user> | key:<id> | jwt:<issuer id>:<sub>
    actor      TEXT NOT NULL,
    -- api | dashboard | cli
    channel    TEXT NOT NULL,
    address    TEXT,
    action     TEXT NOT NULL,
    object     TEXT NOT NULL,
    detail     TEXT NOT NULL
);
CREATE INDEX audit_by_tenant_time ON audit_log(tenant_id, at);
CREATE INDEX audit_by_time ON audit_log(at);

-- Milliseconds from the request's arrival to its first token (NULL: no token was sent).
ALTER TABLE usage_records ADD COLUMN ttft_ms BIGINT;
