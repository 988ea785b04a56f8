//! Suspended runs (`run_suspension`): a resumable run whose agent called a
//! tool that needs approval, or the durable `wait` tool, waits with nothing
//! held. Every transition here goes through [`super`]'s table:
//! running -> waiting ([`suspend`], fenced, by the run's holder), waiting ->
//! queued ([`decide`] by a person, [`wake_due`] by the scheduler), and
//! waiting -> cancelled (a stop, in `lifecycle`).

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{json, Value};
use sqlx::{PgConnection, PgExecutor, PgPool};

use crate::db::events::{AGENTS_JOINED, APPROVAL_DECIDED, APPROVAL_REQUESTED, WAIT_ELAPSED, WAIT_STARTED};
use crate::db::journal::write_event;
use crate::db::notify::{events_channel, notify, RUN_ENQUEUED};
use crate::db::{ClaimToken, ConversationId, Reach, RunId};

/// What a run is suspended for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Approval,
    Wait,
    /// A parent awaits its children (`await-agents`): the ending of the
    /// child that joins them wakes it (`agent_run_child_ended`).
    Children,
    /// A model call would wait long for a shared limit: the time wakes it,
    /// and the resumed attempt asks again. One call may suspend so more
    /// than once (its row is taken again each time).
    Limit,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Approval => "approval",
            Kind::Wait => "wait",
            Kind::Children => "children",
            Kind::Limit => "limit",
        }
    }
}

/// A suspension as the run's holder asks for it.
#[derive(Debug, Clone)]
pub struct Suspend<'a> {
    pub call_index: i32,
    pub position: i32,
    pub kind: Kind,
    pub tool: &'a str,
    pub args: &'a Value,
    /// Until the approval times out, or the wait ends.
    pub for_secs: f64,
}

/// running -> waiting, for the run's holder (fenced): the suspension, the
/// status (no lease) and its event (`approval_requested` or `wait_started`,
/// at max(seq)+1: the holder's journal is closed) in one transaction, and
/// the tails told. `None` when fenced.
pub async fn suspend(
    pool: &PgPool,
    run: RunId,
    token: ClaimToken,
    s: &Suspend<'_>,
) -> Result<Option<Suspended>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    // The row, locked: still ours, and was a stop requested meanwhile?
    let stop: Option<bool> = sqlx::query_scalar(
        "SELECT cancel_requested FROM agent_run
         WHERE id = $1 AND claim_token = $2 AND status = 'running'   -- the fence
         FOR UPDATE",
    )
    .bind(run)
    .bind(token)
    .fetch_optional(&mut *tx)
    .await?;
    match stop {
        None => return Ok(None),
        Some(true) => return Ok(Some(Suspended::StopRequested)),
        Some(false) => {}
    }
    sqlx::query(
        "UPDATE agent_run SET status = 'waiting', waits = waits + 1, claim_expires_at = NULL, last_heartbeat_at = NULL
         WHERE id = $1",
    )
    .bind(run)
    .execute(&mut *tx)
    .await?;
    let (requested_at, expires_at): (DateTime<Utc>, DateTime<Utc>) = sqlx::query_as(
        "INSERT INTO run_suspension (run_id, call_index, position, kind, tool, args, expires_at)
         VALUES ($1, $2, $3, $4, $5, $6, now() + make_interval(secs => $7))
         ON CONFLICT (run_id, call_index) DO UPDATE
         SET position = excluded.position, args = excluded.args, requested_at = now(),
             expires_at = excluded.expires_at, decision = NULL, decided_args = NULL, reason = NULL,
             decided_at = NULL, decided_by = NULL
         WHERE run_suspension.kind = 'limit' AND excluded.kind = 'limit'
         RETURNING requested_at, expires_at",
    )
    .bind(run)
    .bind(s.call_index)
    .bind(s.position)
    .bind(s.kind.as_str())
    .bind(s.tool)
    .bind(s.args)
    .bind(s.for_secs)
    .fetch_one(&mut *tx)
    .await?;
    let (kind, payload) = match s.kind {
        Kind::Approval => (
            APPROVAL_REQUESTED,
            json!({ "call_id": s.call_index, "tool": s.tool, "args": s.args,
                    "requested_at": requested_at, "expires_at": expires_at }),
        ),
        Kind::Wait => (WAIT_STARTED, json!({ "call_id": s.call_index, "until": expires_at })),
        Kind::Limit => (
            WAIT_STARTED,
            json!({ "call_id": s.call_index, "until": expires_at, "for": "model_limit", "limit": s.args["limit"] }),
        ),
        Kind::Children => (
            WAIT_STARTED,
            json!({ "call_id": s.call_index, "until": expires_at, "for": "agents", "runs": s.args["runs"],
                    "mode": s.args["mode"] }),
        ),
    };
    write_event(&mut *tx, run, kind, &payload).await?;
    // The children may have been joined since the agent looked: under the
    // parent's lock (a child's ending takes it too), so either this sees the
    // ending or the ending sees this suspension.
    if s.kind == Kind::Children {
        let joined: bool = sqlx::query_scalar("SELECT agent_children_joined($1, $2)")
            .bind(run)
            .bind(s.args)
            .fetch_one(&mut *tx)
            .await?;
        if joined {
            sqlx::query(
                "UPDATE run_suspension SET decision = 'joined', decided_at = now(), decided_by = 'child'
                 WHERE run_id = $1 AND call_index = $2",
            )
            .bind(run)
            .bind(s.call_index)
            .execute(&mut *tx)
            .await?;
            let conversation: ConversationId =
                sqlx::query_scalar("SELECT conversation_id FROM agent_run WHERE id = $1")
                    .bind(run)
                    .fetch_one(&mut *tx)
                    .await?;
            requeue_waiting(&mut tx, run, conversation).await?;
            write_event(&mut *tx, run, AGENTS_JOINED, &json!({ "call_id": s.call_index })).await?;
        }
    }
    notify(&mut *tx, &events_channel(run), "suspended").await?;
    tx.commit().await?;
    Ok(Some(Suspended::Waiting))
}

/// What [`suspend`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Suspended {
    /// The run waits.
    #[default]
    Waiting,
    /// A stop was requested first: the run does not wait, it ends cancelled.
    StopRequested,
}

/// A decision on a suspended call, as the resumed attempt applies it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decided {
    Approve,
    /// Approved with other arguments (a JSON object).
    Edit(Value),
    Reject(String),
    /// A wait whose time came.
    Elapsed,
    /// The awaited children were joined (or the await timed out): the
    /// resumed attempt reads them.
    Joined,
}

/// The decided suspensions of a run, by call index, with whether an
/// earlier attempt already began the approved call.
pub async fn decided(db: &mut PgConnection, run: RunId) -> Result<Vec<(i32, (Decided, bool))>, sqlx::Error> {
    let rows: Vec<(i32, String, Option<Value>, Option<String>, bool)> = sqlx::query_as(
        "SELECT call_index, decision, decided_args, reason, call_started_at IS NOT NULL FROM run_suspension
         WHERE run_id = $1 AND decision IS NOT NULL",
    )
    .bind(run)
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(i, decision, args, reason, started)| {
            let d = match decision.as_str() {
                "approve" => Decided::Approve,
                "edit" => Decided::Edit(args.unwrap_or_else(|| json!({}))),
                "elapsed" => Decided::Elapsed,
                "joined" => Decided::Joined,
                _ => Decided::Reject(reason.unwrap_or_else(|| "rejected".into())),
            };
            (i, (d, started))
        })
        .collect())
}

/// Marks the approved call `call_index` begun, fenced by the claim: before
/// the resumed attempt makes it. Returns false when fenced.
pub async fn start_approved(
    db: impl PgExecutor<'_>,
    run: RunId,
    token: ClaimToken,
    call_index: i32,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE run_suspension s SET call_started_at = now()
         FROM (SELECT 1 FROM agent_run
               WHERE id = $1 AND claim_token = $2 AND status = 'running'   -- the fence
               FOR SHARE) AS fence
         WHERE s.run_id = $1 AND s.call_index = $3",
    )
    .bind(run)
    .bind(token)
    .bind(call_index)
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// A pending approval, as the approver sees it.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow, schemars::JsonSchema)]
pub struct Pending {
    pub run_id: RunId,
    pub conversation_id: ConversationId,
    pub call_id: i32,
    pub tool: String,
    pub args: Value,
    pub requested_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
}

/// Pending approvals a page of [`pending`] holds at most.
pub const PENDING_PAGE_MAX: i64 = 1000;

/// The pending approvals of `owner_id`'s runs, oldest first, after the one
/// `(run, call)` last seen.
pub async fn pending(
    db: impl PgExecutor<'_>,
    reach: Reach<'_>,
    limit: i64,
    after: Option<(RunId, i32)>,
) -> Result<Vec<Pending>, sqlx::Error> {
    let (run, call) = after.unzip();
    let (owner, tenant, all) = reach.binds();
    sqlx::query_as(&format!(
        "SELECT s.run_id, r.conversation_id, s.call_index AS call_id, s.tool, s.args, s.requested_at, s.expires_at
         FROM run_suspension s JOIN agent_run r ON r.id = s.run_id
         WHERE {} AND r.status = 'waiting' AND s.kind = 'approval' AND s.decision IS NULL
           AND ($5::uuid IS NULL OR (s.requested_at, s.run_id, s.call_index) >
                (SELECT a.requested_at, a.run_id, a.call_index FROM run_suspension a
                 WHERE a.run_id = $5 AND a.call_index = $6))
         ORDER BY s.requested_at, s.run_id, s.call_index
         LIMIT $4",
        Reach::filter("r.", 1)
    ))
    .bind(owner)
    .bind(tenant)
    .bind(all)
    .bind(limit)
    .bind(run)
    .bind(call)
    .fetch_all(db)
    .await
}

/// An approval call the caller may decide: its run's owner and its tool.
pub async fn approval_call(
    db: impl PgExecutor<'_>,
    run: RunId,
    call_index: i32,
    reach: Reach<'_>,
) -> Result<Option<(String, String)>, sqlx::Error> {
    let (owner, tenant, all) = reach.binds();
    sqlx::query_as(&format!(
        "SELECT r.owner_id, s.tool FROM run_suspension s JOIN agent_run r ON r.id = s.run_id
         WHERE s.run_id = $1 AND s.call_index = $2 AND s.kind = 'approval' AND {}",
        Reach::filter("r.", 3)
    ))
    .bind(run)
    .bind(call_index)
    .bind(owner)
    .bind(tenant)
    .bind(all)
    .fetch_optional(db)
    .await
}

/// A person's decision.
#[derive(Debug, Clone)]
pub struct Decision<'a> {
    /// `approve`, `reject` or `edit`.
    pub decision: &'a str,
    /// The arguments an `edit` runs the call with (a JSON object).
    pub args: Option<&'a Value>,
    pub reason: Option<&'a str>,
    pub decided_by: &'a str,
}

#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    #[error("not found")]
    NotFound,
    /// Decided already: the first decision stands.
    #[error("already decided")]
    Decided(Value),
    /// The run is not waiting for it (ended, or never suspended there).
    #[error("{0}")]
    NotWaiting(String),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// The decision as clients see it (and as `approval_decided` carries it).
fn decision_view(call: i32, decision: &str, args: Option<&Value>, reason: Option<&str>, at: DateTime<Utc>) -> Value {
    let mut v = json!({ "call_id": call, "decision": decision, "decided_at": at });
    if let Some(args) = args {
        v["args"] = args.clone();
    }
    if let Some(reason) = reason {
        v["reason"] = json!(reason);
    }
    v
}

/// waiting -> queued, for `POST /v1/runs/{id}/approvals/{call_id}`: records
/// the decision once (a second answers [`DecideError::Decided`] with the
/// first) in the transaction that re-queues the run as a new attempt,
/// journals `approval_decided` and wakes the claimers.
pub async fn decide(
    pool: &PgPool,
    run: RunId,
    reach: Reach<'_>,
    call_index: i32,
    d: &Decision<'_>,
) -> Result<Value, DecideError> {
    let mut tx = pool.begin().await?;
    let (owner, tenant, all) = reach.binds();
    let locked: Option<(crate::db::RunStatus, ConversationId)> = sqlx::query_as(&format!(
        "SELECT status, conversation_id FROM agent_run WHERE id = $1 AND {} FOR UPDATE",
        Reach::filter("", 2)
    ))
    .bind(run)
    .bind(owner)
    .bind(tenant)
    .bind(all)
    .fetch_optional(&mut *tx)
    .await?;
    let (status, conversation) = locked.ok_or(DecideError::NotFound)?;
    type Row = (Option<String>, Option<Value>, Option<String>, Option<DateTime<Utc>>, String);
    let row: Option<Row> = sqlx::query_as(
        "SELECT decision, decided_args, reason, decided_at, kind FROM run_suspension
         WHERE run_id = $1 AND call_index = $2 FOR UPDATE",
    )
    .bind(run)
    .bind(call_index)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((first, first_args, first_reason, first_at, kind)) = row else {
        return Err(DecideError::NotFound);
    };
    if kind != "approval" {
        return Err(DecideError::NotFound);
    }
    if let (Some(first), Some(at)) = (first, first_at) {
        return Err(DecideError::Decided(decision_view(
            call_index,
            &first,
            first_args.as_ref(),
            first_reason.as_deref(),
            at,
        )));
    }
    if status != crate::db::RunStatus::Waiting {
        return Err(DecideError::NotWaiting(format!("run {run} is {status}, not waiting for a decision")));
    }
    let at: DateTime<Utc> = sqlx::query_scalar(
        "UPDATE run_suspension SET decision = $3, decided_args = $4, reason = $5, decided_at = now(), decided_by = $6
         WHERE run_id = $1 AND call_index = $2 RETURNING decided_at",
    )
    .bind(run)
    .bind(call_index)
    .bind(d.decision)
    .bind(d.args)
    .bind(d.reason)
    .bind(d.decided_by)
    .fetch_one(&mut *tx)
    .await?;
    requeue_waiting(&mut tx, run, conversation).await?;
    let view = decision_view(call_index, d.decision, d.args, d.reason, at);
    write_event(&mut *tx, run, APPROVAL_DECIDED, &view).await?;
    notify(&mut *tx, &events_channel(run), "decided").await?;
    tx.commit().await?;
    Ok(view)
}

async fn requeue_waiting(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    run: RunId,
    conversation: ConversationId,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE agent_run SET status = 'queued', attempt = attempt + 1 WHERE id = $1 AND status = 'waiting'")
        .bind(run)
        .execute(&mut **tx)
        .await?;
    notify(&mut **tx, RUN_ENQUEUED, &conversation.to_string()).await
}

/// waiting -> queued, for the waiting runs' scheduler
/// (`crate::worker::suspensions`, on the reaper's interval, on every
/// process): suspensions whose time came (an approval's timeout
/// rejects it; a wait has elapsed), at most `limit`, each with its event and
/// the wake. Rows another process is deciding are skipped. Returns the runs
/// woken.
pub async fn wake_due(pool: &PgPool, limit: i64) -> Result<Vec<RunId>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let due: Vec<(RunId, ConversationId, i32, String)> = sqlx::query_as(
        "SELECT s.run_id, r.conversation_id, s.call_index, s.kind
         FROM run_suspension s JOIN agent_run r ON r.id = s.run_id
         WHERE s.decision IS NULL AND s.expires_at <= now() AND r.status = 'waiting'
         ORDER BY s.expires_at LIMIT $1
         FOR UPDATE OF s, r SKIP LOCKED",
    )
    .bind(limit)
    .fetch_all(&mut *tx)
    .await?;
    for (run, conversation, call, kind) in &due {
        let (decision, reason, event) = match kind.as_str() {
            "wait" | "limit" => ("elapsed", None, WAIT_ELAPSED),
            "children" => ("joined", Some("the await timed out"), AGENTS_JOINED),
            _ => ("reject", Some("the approval timed out"), APPROVAL_DECIDED),
        };
        let at: DateTime<Utc> = sqlx::query_scalar(
            "UPDATE run_suspension SET decision = $3, reason = $4, decided_at = now(), decided_by = 'timeout'
             WHERE run_id = $1 AND call_index = $2 RETURNING decided_at",
        )
        .bind(run)
        .bind(call)
        .bind(decision)
        .bind(reason)
        .fetch_one(&mut *tx)
        .await?;
        requeue_waiting(&mut tx, *run, *conversation).await?;
        write_event(&mut *tx, *run, event, &decision_view(*call, decision, None, reason, at)).await?;
        notify(&mut *tx, &events_channel(*run), "decided").await?;
    }
    tx.commit().await?;
    Ok(due.into_iter().map(|d| d.0).collect())
}
