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
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow, schemars::JsonSchema)]
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

pub use super::Reach as Scope;

/// The rows a [`Scope`] reaches.
static SCOPE_FILTER: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| Scope::filter("", 2));

/// The schedules in `scope`, oldest first, after the schedule `after`.
pub async fn list(
    db: impl PgExecutor<'_>,
    scope: Scope<'_>,
    after: Option<Uuid>,
    limit: i64,
) -> Result<Vec<Schedule>, sqlx::Error> {
    let (owner, tenant, all) = scope.binds();
    let filter = &*SCOPE_FILTER;
    sqlx::query_as(&format!(
        "SELECT {COLUMNS} FROM schedule
         WHERE {filter}
           AND ($1::uuid IS NULL OR (created_at, id) > (SELECT created_at, id FROM schedule WHERE id = $1))
         ORDER BY created_at, id LIMIT $5"
    ))
    .bind(after)
    .bind(owner)
    .bind(tenant)
    .bind(all)
    .bind(limit)
    .fetch_all(db)
    .await
}

pub async fn get(db: impl PgExecutor<'_>, id: Uuid, scope: Scope<'_>) -> Result<Option<Schedule>, sqlx::Error> {
    let (owner, tenant, all) = scope.binds();
    let filter = &*SCOPE_FILTER;
    sqlx::query_as(&format!("SELECT {COLUMNS} FROM schedule WHERE id = $1 AND {filter}"))
        .bind(id)
        .bind(owner)
        .bind(tenant)
        .bind(all)
        .fetch_optional(db)
        .await
}

/// Pauses or resumes a schedule in `scope`; a resumed one fires next at
/// `next_fire_at` (missed firings are not caught up).
pub async fn set_paused(
    db: impl PgExecutor<'_>,
    id: Uuid,
    scope: Scope<'_>,
    paused: bool,
    next_fire_at: Option<DateTime<Utc>>,
) -> Result<Option<Schedule>, sqlx::Error> {
    let (owner, tenant, all) = scope.binds();
    let filter = &*SCOPE_FILTER;
    sqlx::query_as(&format!(
        "UPDATE schedule SET paused = $5, next_fire_at = coalesce($6, next_fire_at)
         WHERE id = $1 AND {filter} RETURNING {COLUMNS}"
    ))
    .bind(id)
    .bind(owner)
    .bind(tenant)
    .bind(all)
    .bind(paused)
    .bind(next_fire_at)
    .fetch_optional(db)
    .await
}

pub async fn delete(db: impl PgExecutor<'_>, id: Uuid, scope: Scope<'_>) -> Result<bool, sqlx::Error> {
    let (owner, tenant, all) = scope.binds();
    let filter = &*SCOPE_FILTER;
    let done = sqlx::query(&format!("DELETE FROM schedule WHERE id = $1 AND {filter}"))
        .bind(id)
        .bind(owner)
        .bind(tenant)
        .bind(all)
        .execute(db)
        .await?;
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

/// Due schedules, at most `limit`, shared fairly among their tenants: of the
/// `scan` longest due, each tenant's oldest first, then each tenant's next,
/// and so on; locked (`SKIP LOCKED`: another process firing one is passed
/// over), and still due when locked.
pub async fn due(tx: &mut Transaction<'_, Postgres>, limit: i64, scan: i64) -> Result<Vec<DueSchedule>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT owner_id, tenant_id, {COLUMNS}
         FROM schedule
         WHERE id IN (
             SELECT id FROM (
                 SELECT id, next_fire_at,
                        row_number() OVER (PARTITION BY tenant_id ORDER BY next_fire_at) AS turn
                 FROM (SELECT id, tenant_id, next_fire_at FROM schedule
                       WHERE NOT paused AND next_fire_at <= now()
                       ORDER BY next_fire_at LIMIT $2) d
             ) ranked
             ORDER BY turn, next_fire_at LIMIT $1)
           AND NOT paused AND next_fire_at <= now()
         ORDER BY next_fire_at
         FOR UPDATE SKIP LOCKED"
    ))
    .bind(limit)
    .bind(scan)
    .fetch_all(&mut **tx)
    .await
}

/// A firing a quota held: tried again at `again`.
pub async fn hold(tx: &mut Transaction<'_, Postgres>, id: Uuid, again: DateTime<Utc>) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE schedule SET next_fire_at = $2 WHERE id = $1").bind(id).bind(again).execute(&mut **tx).await?;
    Ok(())
}

/// Pauses a schedule whose owner holds no valid token.
pub async fn pause_orphaned(tx: &mut Transaction<'_, Postgres>, id: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE schedule SET paused = true WHERE id = $1").bind(id).execute(&mut **tx).await?;
    Ok(())
}

/// How many schedules `tenant` has, counted under a per-tenant lock held to
/// the end of the transaction (so a concurrent create waits for this one).
pub async fn count_for_tenant_locked(tx: &mut Transaction<'_, Postgres>, tenant: &str) -> Result<i64, sqlx::Error> {
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('schedule-tenant:' || $1))")
        .bind(tenant)
        .execute(&mut **tx)
        .await?;
    sqlx::query_scalar("SELECT count(*) FROM schedule WHERE tenant_id = $1").bind(tenant).fetch_one(&mut **tx).await
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
