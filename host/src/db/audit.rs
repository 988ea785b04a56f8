//! The audit trail: one append-only table (`audit_event`; a trigger refuses
//! updates and deletes) of who did what and when. [`record`] is the one
//! writer; callers pass ids, names and digests, never a secret or message
//! text (the `detail` is for such facts only).

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::PgExecutor;
use uuid::Uuid;

use super::tokens::Principal;

/// Every action the trail records, written once.
pub mod action {
    pub const TOKEN_CREATED: &str = "token.created";
    pub const TOKEN_REVOKED: &str = "token.revoked";
    pub const PLUGIN_UPLOADED: &str = "plugin.uploaded";
    pub const PLUGIN_REPOINTED: &str = "plugin.repointed";
    pub const PLUGIN_PUBLISHED: &str = "plugin.published";
    pub const RUN_CANCELLED: &str = "run.cancelled";
    pub const RUN_RETRIED: &str = "run.retried";
    pub const RUN_FORKED: &str = "run.forked";
    pub const RUN_STEERED: &str = "run.steered";
    pub const CONVERSATION_STOPPED: &str = "conversation.stopped";
    pub const APPROVAL_DECIDED: &str = "approval.decided";
    pub const SCHEDULE_CREATED: &str = "schedule.created";
    pub const SCHEDULE_DELETED: &str = "schedule.deleted";
    pub const SCHEDULE_PAUSED: &str = "schedule.paused";
    pub const SCHEDULE_RESUMED: &str = "schedule.resumed";
    pub const TENANT_SHARE_SET: &str = "tenant.share_set";
    pub const TENANT_CEILINGS_SET: &str = "tenant.ceilings_set";
    /// The host refused a model call at its tenant's budget (target: the run).
    pub const MODEL_BUDGET_REFUSED: &str = "model.budget_refused";
}

/// Who acted: a token's principal, or the operator's command line.
#[derive(Debug, Clone)]
pub struct Actor {
    pub user: String,
    pub tenant: Option<String>,
    pub token: Option<Uuid>,
}

impl Actor {
    /// The operator at the command line (`agent-host tokens ...`).
    pub fn cli() -> Actor {
        Actor { user: "cli".into(), tenant: None, token: None }
    }
}

impl From<&Principal> for Actor {
    fn from(p: &Principal) -> Actor {
        Actor { user: p.user_id.clone(), tenant: Some(p.tenant_id.clone()), token: Some(p.token_id) }
    }
}

#[derive(Debug, Clone, Serialize, sqlx::FromRow, schemars::JsonSchema)]
pub struct AuditEvent {
    pub id: i64,
    pub at: DateTime<Utc>,
    pub actor_user: String,
    pub actor_tenant: Option<String>,
    pub actor_token: Option<Uuid>,
    pub tenant_id: Option<String>,
    pub action: String,
    pub target: String,
    pub detail: Value,
}

/// Rows one read answers at most.
pub const PAGE_MAX: i64 = 1000;

/// Appends one row: `actor` did `action` to `target` (of `tenant`; `None`:
/// operator-wide, e.g. a published plugin).
pub async fn record(
    db: impl PgExecutor<'_>,
    actor: &Actor,
    action: &str,
    tenant: Option<&str>,
    target: &str,
    detail: Value,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO audit_event (actor_user, actor_tenant, actor_token, tenant_id, action, target, detail)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(&actor.user)
    .bind(&actor.tenant)
    .bind(actor.token)
    .bind(tenant)
    .bind(action)
    .bind(target)
    .bind(detail)
    .execute(db)
    .await?;
    Ok(())
}

/// Rows after `after` (oldest first), at most `limit`: of `tenant` (its own
/// rows and the operator-wide ones) when given, else all. A tenant's read
/// names only its own tokens: the token of an actor from another tenant, or
/// of an operator, is left out (null).
pub async fn list(
    db: impl PgExecutor<'_>,
    tenant: Option<&str>,
    after: Option<i64>,
    limit: i64,
) -> Result<Vec<AuditEvent>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, at, actor_user, actor_tenant,
                CASE WHEN $1::text IS NULL
                       OR (actor_tenant = $1
                           AND NOT EXISTS (SELECT 1 FROM api_token t WHERE t.id = actor_token AND t.operator))
                     THEN actor_token END AS actor_token,
                tenant_id, action, target, detail FROM audit_event
         WHERE ($1::text IS NULL OR tenant_id = $1 OR tenant_id IS NULL) AND id > $2
         ORDER BY id LIMIT $3",
    )
    .bind(tenant)
    .bind(after.unwrap_or(0))
    .bind(limit.clamp(1, PAGE_MAX))
    .fetch_all(db)
    .await
}
