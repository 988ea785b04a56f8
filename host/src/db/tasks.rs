//! Runs as the protocols' tasks see them (`api::a2a`, `api::mcp`): one run
//! of one agent with its user message, its answer as the transcript keeps it
//! and the approval it waits for. Read by owner, as every run read is.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgExecutor;

use super::{ConversationId, RunId, RunStatus};

/// One run as a task.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct TaskRow {
    pub id: RunId,
    pub conversation_id: ConversationId,
    pub plugin: String,
    pub status: RunStatus,
    pub error: Option<String>,
    pub cancel_requested: bool,
    pub created_at: DateTime<Utc>,
    /// The last change: ended, started or created.
    pub updated_at: DateTime<Utc>,
    pub user_message_id: uuid::Uuid,
    pub input: String,
    /// The assistant's message, once the run has ended with one.
    pub answer_id: Option<uuid::Uuid>,
    pub answer: Option<String>,
    /// `{call_id, tool, args}` of the approval a waiting run asks for.
    pub pending_approval: Option<Value>,
}

const SELECT: &str = "
    SELECT r.id, r.conversation_id, r.plugin, r.status, r.error, r.cancel_requested, r.created_at,
           coalesce(r.finished_at, r.started_at, r.created_at) AS updated_at,
           r.user_message_id, u.content AS input, a.id AS answer_id, a.content AS answer,
           (SELECT jsonb_build_object('call_id', s.call_index, 'tool', s.tool, 'args', s.args)
            FROM run_suspension s
            WHERE s.run_id = r.id AND s.kind = 'approval' AND s.decision IS NULL AND r.status = 'waiting'
            LIMIT 1) AS pending_approval
    FROM agent_run r
    JOIN message u ON u.id = r.user_message_id
    LEFT JOIN LATERAL (
        SELECT m.id, m.content FROM message m
        WHERE m.conversation_id = r.conversation_id AND m.run_id = r.id AND m.role = 'assistant'
        ORDER BY m.created_at DESC LIMIT 1) a ON true";

/// The run `id` (of agent `plugin`, when given) as its owner sees it.
pub async fn get(
    db: impl PgExecutor<'_>,
    id: RunId,
    owner_id: &str,
    plugin: Option<&str>,
) -> Result<Option<TaskRow>, sqlx::Error> {
    sqlx::query_as(&format!("{SELECT} WHERE r.id = $1 AND r.owner_id = $2 AND ($3::text IS NULL OR r.plugin = $3)"))
        .bind(id)
        .bind(owner_id)
        .bind(plugin)
        .fetch_optional(db)
        .await
}

/// The owner's runs (of `plugin`, when given), newest first, before
/// `after`, in one conversation and one status when given, at most `limit`.
pub async fn list(
    db: impl PgExecutor<'_>,
    owner_id: &str,
    plugin: Option<&str>,
    conversation: Option<ConversationId>,
    statuses: Option<&[&str]>,
    after: Option<RunId>,
    limit: i64,
) -> Result<Vec<TaskRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "{SELECT} WHERE r.owner_id = $1 AND ($2::text IS NULL OR r.plugin = $2)
                    AND ($3::uuid IS NULL OR r.conversation_id = $3)
                    AND ($4::text[] IS NULL OR r.status = ANY($4)) AND ($5::uuid IS NULL OR r.id < $5)
         ORDER BY r.id DESC LIMIT $6"
    ))
    .bind(owner_id)
    .bind(plugin)
    .bind(conversation)
    .bind(statuses)
    .bind(after)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// How many runs [`list`] would page through.
pub async fn count(
    db: impl PgExecutor<'_>,
    owner_id: &str,
    plugin: &str,
    conversation: Option<ConversationId>,
    statuses: Option<&[&str]>,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT count(*) FROM agent_run r WHERE r.owner_id = $1 AND r.plugin = $2
           AND ($3::uuid IS NULL OR r.conversation_id = $3) AND ($4::text[] IS NULL OR r.status = ANY($4))",
    )
    .bind(owner_id)
    .bind(plugin)
    .bind(conversation)
    .bind(statuses)
    .fetch_one(db)
    .await
}

/// Push-notification configs a task holds at most.
pub const PUSH_CONFIGS_MAX: i64 = 10;

/// One of a task's push-notification configs (`a2a_push_config`). The
/// credentials are written into the headers each notification carries and
/// never read back.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct PushConfig {
    pub id: String,
    pub url: String,
    pub token: Option<String>,
    pub auth_scheme: Option<String>,
}

/// A config to make (or replace, by id).
#[derive(Debug, Clone)]
pub struct NewPushConfig {
    pub id: String,
    pub url: String,
    pub token: Option<String>,
    /// `(scheme, credentials)`: sent as `Authorization: <scheme> <credentials>`.
    pub authentication: Option<(String, String)>,
}

/// What [`put_push`] did.
#[derive(Debug)]
pub enum PushPut {
    Made(PushConfig),
    /// The task holds [`PUSH_CONFIGS_MAX`] others already.
    TooMany,
}

/// Makes (or replaces) a config of run `run` and tells it the task's state
/// now, in one transaction that holds the run's row: a state change
/// committed before it is the state told here, one committed after it
/// sees the config (its trigger writes the notification), so none is
/// missed between the two.
pub async fn put_push(pool: &sqlx::PgPool, run: RunId, config: &NewPushConfig) -> Result<PushPut, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT 1 FROM agent_run WHERE id = $1 FOR UPDATE").bind(run).execute(&mut *tx).await?;
    let others: i64 = sqlx::query_scalar("SELECT count(*) FROM a2a_push_config WHERE run_id = $1 AND id <> $2")
        .bind(run)
        .bind(&config.id)
        .fetch_one(&mut *tx)
        .await?;
    if others >= PUSH_CONFIGS_MAX {
        return Ok(PushPut::TooMany);
    }
    let mut headers = serde_json::Map::new();
    if let Some(token) = &config.token {
        headers.insert("X-A2A-Notification-Token".into(), token.clone().into());
    }
    if let Some((scheme, credentials)) = &config.authentication {
        headers.insert("Authorization".into(), format!("{scheme} {credentials}").into());
    }
    let made: PushConfig = sqlx::query_as(
        "INSERT INTO a2a_push_config (run_id, id, url, token, auth_scheme, headers)
         VALUES ($1, $2, $3, $4, $5, $6)
         ON CONFLICT (run_id, id) DO UPDATE SET url = EXCLUDED.url, token = EXCLUDED.token,
             auth_scheme = EXCLUDED.auth_scheme, headers = EXCLUDED.headers, created_at = now()
         RETURNING id, url, token, auth_scheme",
    )
    .bind(run)
    .bind(&config.id)
    .bind(&config.url)
    .bind(&config.token)
    .bind(config.authentication.as_ref().map(|(s, _)| s))
    .bind(Value::Object(headers))
    .fetch_one(&mut *tx)
    .await?;
    sqlx::query(
        "WITH r AS (UPDATE agent_run SET a2a_push = true WHERE id = $1
                    RETURNING id, conversation_id, status, error)
         SELECT a2a_push(r.id, r.conversation_id,
                         a2a_task_state(r.status, EXISTS (SELECT 1 FROM run_suspension s
                             WHERE s.run_id = r.id AND s.kind = 'approval' AND s.decision IS NULL)),
                         CASE WHEN r.status = 'failed' THEN r.error END, $2)
         FROM r",
    )
    .bind(run)
    .bind(&config.id)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(PushPut::Made(made))
}

/// Run `run`'s configs, by id.
pub async fn push_configs(db: impl PgExecutor<'_>, run: RunId) -> Result<Vec<PushConfig>, sqlx::Error> {
    sqlx::query_as("SELECT id, url, token, auth_scheme FROM a2a_push_config WHERE run_id = $1 ORDER BY id")
        .bind(run)
        .fetch_all(db)
        .await
}

/// Deletes one of run `run`'s configs; whether it was there.
pub async fn delete_push(db: impl PgExecutor<'_>, run: RunId, id: &str) -> Result<bool, sqlx::Error> {
    let gone =
        sqlx::query("DELETE FROM a2a_push_config WHERE run_id = $1 AND id = $2").bind(run).bind(id).execute(db).await?;
    Ok(gone.rows_affected() > 0)
}
