-- Model usage per user too (issue 46, item 4): each tenant's day per
-- provider model is kept per user (the run owner's), so `GET /v1/usage`
-- can answer by user; rows written before this keep an empty user.
ALTER TABLE model_usage_day ADD COLUMN user_id text NOT NULL DEFAULT '';
ALTER TABLE model_usage_day DROP CONSTRAINT model_usage_day_pkey;
ALTER TABLE model_usage_day ADD PRIMARY KEY (tenant_id, day, user_id, provider, model);
