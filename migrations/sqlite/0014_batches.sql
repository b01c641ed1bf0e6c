-- The OpenAI Files and Batch APIs. A file's bytes are in the database, not on a gateway's
-- disk: every gateway sharing the database serves them, and a batch's output is written in
-- the same transaction that completes it.
CREATE TABLE files (
    id          TEXT PRIMARY KEY,
    tenant_id   TEXT NOT NULL REFERENCES tenants(id),
    -- 'batch' (an upload) or 'batch_output' (a batch's output or error file).
    purpose     TEXT NOT NULL,
    filename    TEXT NOT NULL,
    bytes       INTEGER NOT NULL,
    content     BLOB NOT NULL,
    created_at  INTEGER NOT NULL
);
CREATE INDEX files_by_tenant ON files(tenant_id, created_at);

-- A batch: its lines run as batch-class requests of the tenant under the key that created it.
CREATE TABLE batches (
    id                TEXT PRIMARY KEY,
    tenant_id         TEXT NOT NULL REFERENCES tenants(id),
    key_id            TEXT NOT NULL,
    endpoint          TEXT NOT NULL,
    input_file_id     TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    -- in_progress, finalizing, completed, expired, cancelling, cancelled
    status            TEXT NOT NULL,
    -- JSON object (the client's metadata), or NULL.
    metadata          TEXT,
    total             INTEGER NOT NULL,
    -- Why no line runs now (a spent hard budget), or NULL.
    paused_reason     TEXT,
    output_file_id    TEXT,
    error_file_id     TEXT,
    created_at        INTEGER NOT NULL,
    in_progress_at    INTEGER,
    expires_at        INTEGER NOT NULL,
    finalizing_at     INTEGER,
    completed_at      INTEGER,
    expired_at        INTEGER,
    cancelling_at     INTEGER,
    cancelled_at      INTEGER
);
CREATE INDEX batches_by_tenant ON batches(tenant_id, created_at);
CREATE INDEX batches_by_status ON batches(status);

-- A batch's lines. A gateway claims a line by a conditional update (pending, or running
-- under a lease that ran out) and keeps its lease alive while the line runs; a result is
-- kept only from the lease's owner, so no line is answered twice.
CREATE TABLE batch_lines (
    batch_id     TEXT NOT NULL REFERENCES batches(id),
    line         INTEGER NOT NULL,
    custom_id    TEXT,
    -- The request's body (JSON); NULL for a line refused when the batch was created.
    body         TEXT,
    -- pending, running, done
    state        TEXT NOT NULL,
    owner        TEXT,
    lease_until  INTEGER NOT NULL DEFAULT 0,
    -- Runs sent back (rate limit, overload, budget): each run is its own request id.
    attempt      INTEGER NOT NULL DEFAULT 0,
    -- A line sent back (rate limit, overload, budget) waits until then.
    not_before   INTEGER NOT NULL DEFAULT 0,
    -- The answer's HTTP status (NULL: no request was made, e.g. a line that is not JSON).
    status_code  INTEGER,
    -- The output line's JSON.
    result       TEXT,
    finished_at  INTEGER,
    PRIMARY KEY (batch_id, line)
);
CREATE INDEX batch_lines_by_state ON batch_lines(batch_id, state);

-- The batch a request ran in (NULL: not a batch's).
ALTER TABLE usage_records ADD COLUMN batch_id TEXT;
CREATE INDEX usage_by_batch ON usage_records(batch_id);
-- What a batch request pays, in percent of the price (OpenAI's Batch API: half).
ALTER TABLE prices ADD COLUMN batch_percent INTEGER NOT NULL DEFAULT 50;
