//! Cron schedules (`schedule`): their rows, and the firing's claim. What a
//! firing enqueues goes through the enqueue service with the firing's time as
//! the run's idempotency key (`service::schedules`), so a firing is one run
//! however many processes fire it.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::{PgExecutor, Postgres, Transaction};
use uuid::Uuid;

use super::enqueue::Owner;
use super::{ConversationId, RunId};

/// Schedules one list page holds at most.
pub const SCHEDULES_PAGE_MAX: i64 = 1000;

/// A schedule as its owner sees it.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct Schedule {
    pub id: Uuid,
    pub plugin: String,
    pub content: String,
    pub config: Value,
    pub conversation_id: Option<ConversationId>,
    pub cron: String,
    pub timezone: String,
    pub webhook: Option<String>,
    pub paused: bool,
    pub next_fire_at: DateTime<Utc>,
    pub last_fired_at: Option<DateTime<Utc>>,
    pub last_run_id: Option<RunId>,
    pub created_at: DateTime<Utc>,
}

const COLUMNS: &str = "id, plugin, content, config, conversation_id, cron, timezone, webhook, paused, \
                       next_fire_at, last_fired_at, last_run_id, created_at";

/// A new schedule, checked by the service.
#[derive(Debug, Clone)]
pub struct NewSchedule<'a> {
    pub owner: &'a Owner,
    pub plugin: &'a str,
    pub content: &'a str,
    pub config: &'a Value,
    pub conversation_id: Option<ConversationId>,
    pub cron: &'a str,
    pub timezone: &'a str,
    pub webhook: Option<&'a str>,
    pub next_fire_at: DateTime<Utc>,
}

pub async fn create(db: impl PgExecutor<'_>, s: &NewSchedule<'_>) -> Result<Schedule, sqlx::Error> {
    sqlx::query_as(&format!(
        "INSERT INTO schedule (id, owner_id, tenant_id, plugin, content, config, conversation_id, cron, timezone,
                               webhook, next_fire_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) RETURNING {COLUMNS}"
    ))
    .bind(Uuid::now_v7())
    .bind(&s.owner.user_id)
    .bind(&s.owner.tenant_id)
    .bind(s.plugin)
    .bind(s.content)
    .bind(s.config)
    .bind(s.conversation_id)
    .bind(s.cron)
    .bind(s.timezone)
    .bind(s.webhook)
    .bind(s.next_fire_at)
    .fetch_one(db)
    .await
}

/// `owner_id`'s schedules, oldest first, after the schedule `after`.
pub async fn list(
    db: impl PgExecutor<'_>,
    owner_id: &str,
    after: Option<Uuid>,
    limit: i64,
) -> Result<Vec<Schedule>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM schedule
         WHERE owner_id = $1
           AND ($2::uuid IS NULL OR (created_at, id) > (SELECT created_at, id FROM schedule WHERE id = $2))
         ORDER BY created_at, id LIMIT $3"
    ))
    .bind(owner_id)
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await
}

pub async fn get(db: impl PgExecutor<'_>, id: Uuid, owner_id: &str) -> Result<Option<Schedule>, sqlx::Error> {
    sqlx::query_as(&format!("SELECT {COLUMNS} FROM schedule WHERE id = $1 AND owner_id = $2"))
        .bind(id)
        .bind(owner_id)
        .fetch_optional(db)
        .await
}

/// Pauses or resumes one of `owner_id`'s schedules; a resumed one fires next
/// at `next_fire_at` (missed firings are not caught up).
pub async fn set_paused(
    db: impl PgExecutor<'_>,
    id: Uuid,
    owner_id: &str,
    paused: bool,
    next_fire_at: Option<DateTime<Utc>>,
) -> Result<Option<Schedule>, sqlx::Error> {
    sqlx::query_as(&format!(
        "UPDATE schedule SET paused = $3, next_fire_at = coalesce($4, next_fire_at)
         WHERE id = $1 AND owner_id = $2 RETURNING {COLUMNS}"
    ))
    .bind(id)
    .bind(owner_id)
    .bind(paused)
    .bind(next_fire_at)
    .fetch_optional(db)
    .await
}

pub async fn delete(db: impl PgExecutor<'_>, id: Uuid, owner_id: &str) -> Result<bool, sqlx::Error> {
    let done =
        sqlx::query("DELETE FROM schedule WHERE id = $1 AND owner_id = $2").bind(id).bind(owner_id).execute(db).await?;
    Ok(done.rows_affected() == 1)
}

/// A schedule whose firing is due, locked for the caller's transaction.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct DueSchedule {
    pub owner_id: String,
    pub tenant_id: String,
    #[sqlx(flatten)]
    pub schedule: Schedule,
}

/// Due schedules, at most `limit`, locked (`SKIP LOCKED`: another process
/// firing one is passed over).
pub async fn due(tx: &mut Transaction<'_, Postgres>, limit: i64) -> Result<Vec<DueSchedule>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT owner_id, tenant_id, {COLUMNS}
         FROM schedule WHERE NOT paused AND next_fire_at <= now()
         ORDER BY next_fire_at LIMIT $1
         FOR UPDATE SKIP LOCKED"
    ))
    .bind(limit)
    .fetch_all(&mut **tx)
    .await
}

/// Records a firing and the next one (`None`: the expression never fires
/// again, and the schedule is paused).
pub async fn fired(
    tx: &mut Transaction<'_, Postgres>,
    id: Uuid,
    fired_at: DateTime<Utc>,
    run: Option<RunId>,
    next: Option<DateTime<Utc>>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE schedule SET last_fired_at = $2, last_run_id = coalesce($3, last_run_id),
                next_fire_at = coalesce($4, next_fire_at), paused = paused OR $4 IS NULL
         WHERE id = $1",
    )
    .bind(id)
    .bind(fired_at)
    .bind(run)
    .bind(next)
    .execute(&mut **tx)
    .await?;
    Ok(())
}
