-- Rate limits per tenant and per API key; NULL means unlimited.
ALTER TABLE tenants ADD COLUMN rpm INTEGER;
ALTER TABLE tenants ADD COLUMN tpm INTEGER;
ALTER TABLE tenants ADD COLUMN max_concurrent INTEGER;
ALTER TABLE api_keys ADD COLUMN rpm INTEGER;
ALTER TABLE api_keys ADD COLUMN tpm INTEGER;
ALTER TABLE api_keys ADD COLUMN max_concurrent INTEGER;
