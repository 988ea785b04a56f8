-- Cost accounting of model calls (issue 46): each tenant's day per provider
-- model also counts the prompt tokens the provider read from its cache and
-- the calls' cost in USD by the tools file's `[[price]]` table (0 for a
-- model without a price; a price changed later applies from then on).
ALTER TABLE model_usage_day
    ADD COLUMN cached_tokens bigint NOT NULL DEFAULT 0,
    ADD COLUMN cost_usd double precision NOT NULL DEFAULT 0;
