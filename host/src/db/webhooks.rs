//! The completion-webhook outbox (`webhook_delivery`): a trigger writes a row
//! in the transaction of a webhook run's terminal write
//! (`migrations/0007_webhooks_schedules.sql`); any process's sender claims
//! due rows (`FOR UPDATE SKIP LOCKED`, pushing `next_attempt_at` forward as a
//! lease while it sends), POSTs them and records the outcome. A2A push
//! notifications ride the same outbox (`migrations/0017_a2a_push.sql`): a
//! row per config and state change, with the headers the config asks for.

use serde_json::Value;
use sqlx::PgExecutor;
use uuid::Uuid;

use super::RunId;

/// A delivery a sender holds for one attempt.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Due {
    pub id: Uuid,
    pub run_id: RunId,
    pub url: String,
    pub payload: Value,
    /// This attempt's number (1 for the first).
    pub attempts: i32,
    /// The run's tenant, whose key signs the delivery.
    pub tenant_id: String,
    /// Headers of its own (an A2A push notification's token and
    /// credentials), sent beside the signature's.
    pub headers: Option<Value>,
    /// When the row was written: one receiver's deliveries of one run are
    /// sent in this order.
    pub created_at: chrono::DateTime<chrono::Utc>,
}

/// Claims up to `limit` due deliveries for one attempt each; `lease_s`
/// pushes their next attempt out, so another sender takes one only if this
/// one died mid-attempt.
/// A due row whose attempts are all spent (its sender died during the last
/// one) is `failed` instead: never an attempt past the bound.
pub async fn claim_due(
    db: impl PgExecutor<'_>,
    limit: i64,
    lease_s: f64,
    attempts_max: i32,
) -> Result<Vec<Due>, sqlx::Error> {
    sqlx::query_as(
        "WITH due AS (SELECT id FROM webhook_delivery
                      WHERE status = 'pending' AND next_attempt_at <= now()
                      ORDER BY next_attempt_at LIMIT $1
                      FOR UPDATE SKIP LOCKED),
         spent AS (UPDATE webhook_delivery d SET status = 'failed',
                          last_error = coalesce(d.last_error || '; ', '') || 'the last attempt was lost with its sender'
                   FROM due WHERE d.id = due.id AND d.attempts >= $3),
         claimed AS (UPDATE webhook_delivery d SET attempts = d.attempts + 1,
                            next_attempt_at = now() + make_interval(secs => $2)
                     FROM due WHERE d.id = due.id AND d.attempts < $3
                     RETURNING d.id, d.run_id, d.url, d.payload, d.attempts, d.headers, d.created_at,
                               (SELECT r.tenant_id FROM agent_run r WHERE r.id = d.run_id) AS tenant_id)
         SELECT * FROM claimed",
    )
    .bind(limit)
    .bind(lease_s)
    .bind(attempts_max)
    .fetch_all(db)
    .await
}

/// The attempt was answered 2xx.
/// Written only while `attempt` is still the row's latest (a sender whose
/// lease lapsed and whose row another sender took writes nothing).
pub async fn delivered(db: impl PgExecutor<'_>, id: Uuid, attempt: i32) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE webhook_delivery SET status = 'delivered', delivered_at = now(), last_error = NULL
         WHERE id = $1 AND attempts = $2 AND status = 'pending'",
    )
    .bind(id)
    .bind(attempt)
    .execute(db)
    .await?;
    Ok(())
}

/// The attempt failed: retried after `retry_in_s`, or `failed` for good
/// when it was the last one allowed. Returns whether it is failed for good.
pub async fn attempt_failed(
    db: impl PgExecutor<'_>,
    id: Uuid,
    attempt: i32,
    error: &str,
    retry_in_s: Option<f64>,
) -> Result<bool, sqlx::Error> {
    sqlx::query(
        "UPDATE webhook_delivery SET last_error = $2,
                status = CASE WHEN $3::float8 IS NULL THEN 'failed' ELSE 'pending' END,
                next_attempt_at = CASE WHEN $3::float8 IS NULL THEN next_attempt_at
                                       ELSE now() + make_interval(secs => $3) END
         WHERE id = $1 AND attempts = $4 AND status = 'pending'",
    )
    .bind(id)
    .bind(error)
    .bind(retry_in_s)
    .bind(attempt)
    .execute(db)
    .await?;
    Ok(retry_in_s.is_none())
}

/// Deliveries waiting to be sent, all processes.
pub async fn pending_count(db: impl PgExecutor<'_>) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM webhook_delivery WHERE status = 'pending'").fetch_one(db).await
}
