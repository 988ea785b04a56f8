//! Limits on model calls shared by every process (issue 46): leases in
//! `model_lease`, one row per call and limit, and pauses in
//! `model_limit_pause`. A call arrives (a waiting row), polls until a poll
//! (its own or any other process's) grants it in arrival order, and ends.
//! The grant is one transaction under the limit's advisory lock: it drops
//! the rows that no longer count, grants the longest waiting prefix the
//! limit admits, and reads the caller's row. The clock is the database's
//! (`clock_timestamp()`: the grant's own instant, not its transaction's start,
//! since a transaction may wait for the lock).

use sqlx::{PgPool, Row};
use uuid::Uuid;

use super::RunId;

/// One limit as the grant applies it: `None` is no bound.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    pub minute_ms: i64,
    pub requests: Option<i64>,
    pub tokens: Option<i64>,
    pub concurrent: Option<i64>,
}

/// What a poll found of the caller's row.
#[derive(Debug, Clone, PartialEq)]
pub enum Poll {
    Granted,
    /// Still waiting: its place in the queue (1: next), what holds it, and
    /// how long until the limit may admit it (ms; `None`: unknown, poll again).
    Waiting {
        position: i64,
        reason: &'static str,
        wait_ms: Option<f64>,
    },
    /// The row is gone (its waiter was too slow to poll and was taken for dead).
    Gone,
}

/// A waiting row for `key`; `heartbeat_ms` keeps it alive between polls.
pub async fn arrive(
    pool: &PgPool,
    id: Uuid,
    key: &str,
    run_id: RunId,
    tenant: Option<&str>,
    tokens: i64,
    heartbeat_ms: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO model_lease (id, limit_key, run_id, tenant_id, tokens, arrived_at, expires_at)
         SELECT $1, $2, $3, $4, $5, c.t, c.t + $6::float8 * interval '1 millisecond'
         FROM (SELECT clock_timestamp() AS t) c",
    )
    .bind(id)
    .bind(key)
    .bind(run_id)
    .bind(tenant)
    .bind(tokens.max(0))
    .bind(heartbeat_ms)
    .execute(pool)
    .await?;
    Ok(())
}

/// Grants what `key`'s limit admits, oldest first, and says where `id`
/// stands; a pause of `pause_key` (the limit's key without a tenant) holds
/// every grant.
#[allow(clippy::too_many_arguments)]
pub async fn poll(
    pool: &PgPool,
    id: Uuid,
    key: &str,
    pause_key: &str,
    b: Bounds,
    call_ms: i64,
    heartbeat_ms: i64,
) -> Result<Poll, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('model_limit:' || $1, 0))")
        .bind(key)
        .execute(&mut *tx)
        .await?;
    // Rows that no longer count: dead waiters, and calls that have left the
    // minute and ended (or whose caller died).
    sqlx::query(
        "DELETE FROM model_lease
         WHERE limit_key = $1
           AND ((granted_at IS NULL AND expires_at < clock_timestamp())
             OR (granted_at < clock_timestamp() - $2::float8 * interval '1 millisecond'
                 AND (ended_at IS NOT NULL OR expires_at < clock_timestamp())))",
    )
    .bind(key)
    .bind(b.minute_ms)
    .execute(&mut *tx)
    .await?;
    // The grant: the waiting rows in arrival order, as many as every bound
    // admits (each bound grows with the row's place, so this is a prefix:
    // nobody is passed over). A call larger than the whole token budget
    // goes alone once the minute is empty, rather than never.
    sqlx::query(
        "WITH c AS (SELECT clock_timestamp() AS t),
         used AS (
             SELECT count(*) FILTER (WHERE l.granted_at > c.t - $2::float8 * interval '1 millisecond') AS requests,
                    coalesce(sum(l.tokens) FILTER (WHERE l.granted_at > c.t - $2::float8 * interval '1 millisecond'), 0)
                        AS tokens,
                    count(*) FILTER (WHERE l.ended_at IS NULL AND l.expires_at > c.t) AS in_flight
             FROM model_lease l, c
             WHERE l.limit_key = $1 AND l.granted_at IS NOT NULL
         ),
         queue AS (
             SELECT l.id, row_number() OVER (ORDER BY l.arrival) AS n,
                    sum(l.tokens) OVER (ORDER BY l.arrival) AS cum_tokens
             FROM model_lease l, c
             WHERE l.limit_key = $1 AND l.granted_at IS NULL AND l.expires_at > c.t
         ),
         grantable AS (
             SELECT q.id FROM queue q, used u, c
             WHERE NOT EXISTS (SELECT 1 FROM model_limit_pause p WHERE p.limit_key = $7 AND p.paused_until > c.t)
               AND ($3::bigint IS NULL OR u.requests + q.n <= $3)
               AND ($4::bigint IS NULL OR u.tokens + q.cum_tokens <= $4 OR (u.tokens = 0 AND q.n = 1))
               AND ($5::bigint IS NULL OR u.in_flight + q.n <= $5)
         )
         UPDATE model_lease l SET granted_at = c.t, expires_at = c.t + $6::float8 * interval '1 millisecond'
         FROM grantable g, c
         WHERE l.id = g.id",
    )
    .bind(key)
    .bind(b.minute_ms)
    .bind(b.requests)
    .bind(b.tokens)
    .bind(b.concurrent)
    .bind(call_ms)
    .bind(pause_key)
    .execute(&mut *tx)
    .await?;
    // Where the caller stands; a waiter's heartbeat is renewed on the way.
    let row = sqlx::query(
        "WITH c AS (SELECT clock_timestamp() AS t)
         UPDATE model_lease l
         SET expires_at = CASE WHEN l.granted_at IS NULL THEN c.t + $3::float8 * interval '1 millisecond' ELSE l.expires_at END
         FROM c
         WHERE l.id = $2
         RETURNING l.granted_at IS NOT NULL AS granted,
             (SELECT count(*) FROM model_lease w
              WHERE w.limit_key = $1 AND w.granted_at IS NULL AND w.expires_at > c.t AND w.arrival <= l.arrival)
                 AS position,
             (SELECT extract(epoch FROM p.paused_until - c.t)::float8 * 1000 FROM model_limit_pause p
              WHERE p.limit_key = $5 AND p.paused_until > c.t) AS paused_ms,
             (SELECT count(*) FROM model_lease g
              WHERE g.limit_key = $1 AND g.granted_at > c.t - $4::float8 * interval '1 millisecond') AS requests,
             (SELECT count(*) FROM model_lease g
              WHERE g.limit_key = $1 AND g.granted_at IS NOT NULL AND g.ended_at IS NULL AND g.expires_at > c.t)
                 AS in_flight",
    )
    .bind(key)
    .bind(id)
    .bind(heartbeat_ms)
    .bind(b.minute_ms)
    .bind(pause_key)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(row) = row else {
        tx.commit().await?;
        return Ok(Poll::Gone);
    };
    if row.get::<bool, _>("granted") {
        tx.commit().await?;
        return Ok(Poll::Granted);
    }
    let position: i64 = row.get("position");
    let requests: i64 = row.get("requests");
    let in_flight: i64 = row.get("in_flight");
    let poll = if let Some(ms) = row.get::<Option<f64>, _>("paused_ms") {
        Poll::Waiting { position, reason: "paused", wait_ms: Some(ms) }
    } else if let Some(rpm) = b.requests.filter(|rpm| requests + position > *rpm) {
        // The minute frees a request when its oldest one leaves it: this
        // caller needs the (requests + position - rpm)-th oldest gone.
        let at: Option<f64> = sqlx::query_scalar(
            "SELECT extract(epoch FROM g.granted_at + $2::float8 * interval '1 millisecond' - clock_timestamp())::float8 * 1000
             FROM model_lease g
             WHERE g.limit_key = $1 AND g.granted_at > clock_timestamp() - $2::float8 * interval '1 millisecond'
             ORDER BY g.granted_at OFFSET $3 LIMIT 1",
        )
        .bind(key)
        .bind(b.minute_ms)
        .bind((requests + position - rpm - 1).max(0))
        .fetch_optional(&mut *tx)
        .await?
        .flatten();
        Poll::Waiting { position, reason: "requests_per_minute", wait_ms: at }
    } else if b.concurrent.is_some_and(|c| in_flight + position > c) {
        Poll::Waiting { position, reason: "concurrent", wait_ms: None }
    } else if b.tokens.is_some() {
        Poll::Waiting { position, reason: "tokens_per_minute", wait_ms: None }
    } else {
        Poll::Waiting { position, reason: "queue", wait_ms: None }
    };
    tx.commit().await?;
    Ok(poll)
}

/// The call is over: a granted row stays, ended (its tokens now the
/// provider's count when it reported one) until it leaves the minute; a
/// waiting one is dropped.
pub async fn end(pool: &PgPool, id: Uuid, tokens: Option<i64>) -> Result<(), sqlx::Error> {
    sqlx::query(
        "WITH gone AS (DELETE FROM model_lease WHERE id = $1 AND granted_at IS NULL RETURNING id)
         UPDATE model_lease SET ended_at = clock_timestamp(), tokens = coalesce($2, tokens)
         WHERE id = $1 AND granted_at IS NOT NULL",
    )
    .bind(id)
    .bind(tokens.map(|t| t.max(0)))
    .execute(pool)
    .await?;
    Ok(())
}

/// Pauses `key` for every process for `ms` (a provider's Retry-After); a
/// longer pause already in place stays.
pub async fn pause(pool: &PgPool, key: &str, ms: i64) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO model_limit_pause (limit_key, paused_until)
         VALUES ($1, clock_timestamp() + $2::float8 * interval '1 millisecond')
         ON CONFLICT (limit_key) DO UPDATE
         SET paused_until = greatest(model_limit_pause.paused_until, excluded.paused_until)",
    )
    .bind(key)
    .bind(ms)
    .execute(pool)
    .await?;
    Ok(())
}

/// The tenant a run belongs to (its owner's), for limits per tenant.
pub async fn run_owner(pool: &PgPool, run_id: RunId) -> Result<Option<RunOwner>, sqlx::Error> {
    sqlx::query_as("SELECT tenant_id AS tenant, owner_id AS user FROM agent_run WHERE id = $1")
        .bind(run_id)
        .fetch_optional(pool)
        .await
}

/// Whose a run is: its owner and the owner's tenant.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct RunOwner {
    pub tenant: String,
    pub user: String,
}

/// One model call's reported usage and its cost, as a tenant's day adds it.
#[derive(Debug, Clone, Copy, Default)]
pub struct CallCost {
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
    pub cached_tokens: i64,
    pub cost_usd: f64,
}

/// Adds one model call's reported tokens and cost to its tenant's day (UTC).
pub async fn record_usage(
    pool: &PgPool,
    owner: &RunOwner,
    provider: &str,
    model: &str,
    c: CallCost,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO model_usage_day
             (tenant_id, user_id, day, provider, model, calls, prompt_tokens, completion_tokens, cached_tokens, cost_usd)
         VALUES ($1, $8, (now() AT TIME ZONE 'UTC')::date, $2, $3, 1, $4, $5, $6, $7)
         ON CONFLICT (tenant_id, day, user_id, provider, model) DO UPDATE
         SET calls = model_usage_day.calls + 1,
             prompt_tokens = model_usage_day.prompt_tokens + excluded.prompt_tokens,
             completion_tokens = model_usage_day.completion_tokens + excluded.completion_tokens,
             cached_tokens = model_usage_day.cached_tokens + excluded.cached_tokens,
             cost_usd = model_usage_day.cost_usd + excluded.cost_usd",
    )
    .bind(&owner.tenant)
    .bind(provider)
    .bind(model)
    .bind(c.prompt_tokens.max(0))
    .bind(c.completion_tokens.max(0))
    .bind(c.cached_tokens.max(0))
    .bind(if c.cost_usd.is_finite() { c.cost_usd.max(0.0) } else { 0.0 })
    .bind(&owner.user)
    .execute(pool)
    .await?;
    Ok(())
}

/// What a tenant has used of its budgets: today and this calendar month (UTC).
#[derive(Debug, Clone, Copy, Default, sqlx::FromRow)]
pub struct Spent {
    pub tokens_day: i64,
    pub cost_day: f64,
    pub tokens_month: i64,
    pub cost_month: f64,
}

/// The model tokens and cost `tenant` has used today and this month (UTC), every model.
pub async fn spent(pool: &PgPool, tenant: &str) -> Result<Spent, sqlx::Error> {
    sqlx::query_as(
        "WITH d AS (SELECT (now() AT TIME ZONE 'UTC')::date AS today)
         SELECT coalesce(sum(prompt_tokens + completion_tokens) FILTER (WHERE u.day = d.today), 0)::bigint AS tokens_day,
                coalesce(sum(cost_usd) FILTER (WHERE u.day = d.today), 0)::float8 AS cost_day,
                coalesce(sum(prompt_tokens + completion_tokens), 0)::bigint AS tokens_month,
                coalesce(sum(cost_usd), 0)::float8 AS cost_month
         FROM model_usage_day u, d
         WHERE u.tenant_id = $1 AND u.day >= date_trunc('month', d.today)::date",
    )
    .bind(tenant)
    .fetch_one(pool)
    .await
}

/// Rows of the usage API, at most.
pub const USAGE_ROWS_MAX: i64 = 10_000;

/// One tenant's model tokens on one UTC day with one provider's model.
#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize, schemars::JsonSchema)]
pub struct UsageDay {
    pub tenant_id: String,
    /// The UTC day.
    pub day: chrono::NaiveDate,
    /// The user whose runs made the calls (`by=user` only; empty for calls
    /// recorded before usage was kept per user).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user_id: Option<String>,
    pub provider: String,
    pub model: String,
    pub calls: i64,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
    /// Of the prompt tokens, those the provider read from its cache.
    pub cached_tokens: i64,
    /// USD by the tools file's price table when the calls were made.
    pub cost_usd: f64,
}

/// The usage of today and the `days - 1` days before (UTC), of `tenant`
/// (`None`: every tenant's), newest day first, at most [`USAGE_ROWS_MAX`] rows.
pub async fn usage(
    pool: &PgPool,
    tenant: Option<&str>,
    days: i32,
    by_user: bool,
) -> Result<Vec<UsageDay>, sqlx::Error> {
    sqlx::query_as(
        "SELECT tenant_id, day, CASE WHEN $4 THEN user_id END AS user_id, provider, model,
                sum(calls)::bigint AS calls, sum(prompt_tokens)::bigint AS prompt_tokens,
                sum(completion_tokens)::bigint AS completion_tokens, sum(cached_tokens)::bigint AS cached_tokens,
                sum(cost_usd) AS cost_usd
         FROM model_usage_day
         WHERE ($1::text IS NULL OR tenant_id = $1) AND day > (now() AT TIME ZONE 'UTC')::date - $2
         GROUP BY tenant_id, day, 3, provider, model
         ORDER BY day DESC, tenant_id, 3, provider, model LIMIT $3",
    )
    .bind(tenant)
    .bind(days)
    .bind(USAGE_ROWS_MAX)
    .bind(by_user)
    .fetch_all(pool)
    .await
}
