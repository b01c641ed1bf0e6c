-- Responses kept for `previous_response_id`, `GET /v1/responses/{id}` and its input items
-- (the OpenAI Responses API's `store: true`), per tenant, until `expires_at`.
CREATE TABLE stored_responses (
    id          TEXT PRIMARY KEY,
    tenant_id   TEXT NOT NULL,
    created_at  BIGINT NOT NULL,
    expires_at  BIGINT NOT NULL,
    -- The response object as it was returned (JSON).
    response    TEXT NOT NULL,
    -- The input items of this response, inherited ones (previous_response_id) first (JSON array).
    input_items TEXT NOT NULL,
    -- Its output items (JSON array): with input_items, the conversation a continuation reads.
    output      TEXT NOT NULL,
    bytes       BIGINT NOT NULL
);
CREATE INDEX stored_responses_by_tenant ON stored_responses(tenant_id, created_at);
CREATE INDEX stored_responses_expiry ON stored_responses(expires_at);
