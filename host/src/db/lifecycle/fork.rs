//! (none) -> queued, from another run's recorded calls: fork.

use super::*;

#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    #[error("run not found")]
    NotFound,
    /// The run cannot be forked as asked (the message says why).
    #[error("{0}")]
    Conflict(String),
    /// The fork's point or its edits do not fit the run's record.
    #[error("{0}")]
    Invalid(String),
    /// The tenant has `max` queued runs, the most its quota allows.
    #[error("the tenant has {max} queued runs")]
    QueueFull { max: u32 },
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// The last call a fork replays.
#[derive(Debug, Clone, Copy)]
pub enum After {
    /// Position `n` of the original's call log (0: none, the turn runs live
    /// from its start).
    Call(i32),
    /// The original's `k`th tool call (its events' `call_index`).
    ToolCall(i32),
}

/// Where a fork branches off, and what it changes there.
#[derive(Debug, Clone)]
pub struct ForkPoint {
    /// The recorded calls the fork replays: those up to this one.
    pub after: After,
    /// The answer that last call gives instead of the recorded one (a tool
    /// call's JSON text).
    pub tool_answer: Option<String>,
    /// The turn's user message instead of the original's (only with
    /// `after_call` 0: every recorded call after it was made for the
    /// original message).
    pub content: Option<String>,
}

/// For `POST /v1/runs/{id}/fork`: a new conversation holding the original's
/// transcript before the run's turn and the turn's user message (or the
/// edited one), and a queued run of the same plugin (digest, manifest and
/// config as pinned, the same random seed) whose call log is the
/// original's up to the point (the last call's answer edited, when asked):
/// its first attempt replays those calls, so no tool or model call is made
/// again, and goes on live after them. The original is only read (its row
/// locked against a concurrent trim). One transaction: the run is never
/// claimed before its log is there.
pub async fn fork(
    pool: &PgPool,
    run: RunId,
    owner_id: &str,
    at: &ForkPoint,
    tenant_max_queued: Option<u32>,
) -> Result<Enqueued, ForkError> {
    let mut tx = pool.begin().await?;
    let tenant: String = sqlx::query_scalar("SELECT tenant_id FROM agent_run WHERE id = $1 AND owner_id = $2")
        .bind(run)
        .bind(owner_id)
        .fetch_optional(&mut *tx)
        .await?
        .ok_or(ForkError::NotFound)?;
    if let Some(max) = tenant_max_queued {
        lock_tenant_queue(&mut tx, &tenant).await?;
        if !queue_has_room(&mut tx, &tenant, max).await? {
            return Err(ForkError::QueueFull { max });
        }
    }
    let (durability, trimmed, original, user_message): (Option<String>, bool, ConversationId, MessageId) =
        sqlx::query_as(
            "SELECT plugin_manifest ->> 'durability', trimmed_at IS NOT NULL, conversation_id, user_message_id
         FROM agent_run WHERE id = $1 AND owner_id = $2 FOR SHARE",
        )
        .bind(run)
        .bind(owner_id)
        .fetch_optional(&mut *tx)
        .await?
        .ok_or(ForkError::NotFound)?;
    if durability.as_deref() != Some("resume") {
        return Err(ForkError::Conflict(format!(
            "run {run} cannot be forked: its plugin does not record its calls (it declares no \
             \"durability\": \"resume\" in its manifest)"
        )));
    }
    if trimmed {
        return Err(ForkError::Conflict(format!(
            "run {run} cannot be forked: retention has trimmed its recorded calls"
        )));
    }
    let after_call = match at.after {
        After::Call(n) if n >= 0 => n,
        After::Call(_) => return Err(ForkError::Invalid("after_call is a call's position, 0 or more".into())),
        After::ToolCall(k) => {
            let position: Option<i32> = sqlx::query_scalar(
                "SELECT position FROM run_call WHERE run_id = $1 AND import = $2
                 ORDER BY position OFFSET $3 LIMIT 1",
            )
            .bind(run)
            .bind(crate::run::record::CALL_TOOL)
            .bind(i64::from(k.max(1) - 1))
            .fetch_optional(&mut *tx)
            .await?;
            position.ok_or_else(|| {
                ForkError::Invalid(format!(
                    "run {run} recorded fewer than {k} tool calls: after_tool_call is past them"
                ))
            })?
        }
    };
    if at.content.is_some() && after_call != 0 {
        return Err(ForkError::Invalid(
            "an edited user message forks with after_call 0: the recorded calls after it answered the original".into(),
        ));
    }
    // The calls replayed: each with its outcome, none missing.
    let (count, complete, last_import): (i64, i64, Option<String>) = sqlx::query_as(
        "SELECT count(*), count(outcome),
                (SELECT import FROM run_call WHERE run_id = $1 AND position = $2)
         FROM run_call WHERE run_id = $1 AND position <= $2",
    )
    .bind(run)
    .bind(after_call)
    .fetch_one(&mut *tx)
    .await?;
    if count < after_call as i64 {
        let recorded: i64 =
            sqlx::query_scalar("SELECT count(*) FROM run_call WHERE run_id = $1").bind(run).fetch_one(&mut *tx).await?;
        return Err(ForkError::Invalid(format!(
            "run {run} recorded {recorded} calls: after_call {} is past them",
            after_call
        )));
    }
    if complete < count {
        return Err(ForkError::Invalid(format!(
            "a call up to {} of run {run} has no recorded outcome (it was in flight): fork before it",
            after_call
        )));
    }
    if at.tool_answer.is_some() && last_import.as_deref() != Some(crate::run::record::CALL_TOOL) {
        return Err(ForkError::Invalid(format!(
            "call {} of run {run} is not a tool call ({}): only a tool call's answer can be edited",
            after_call,
            last_import.as_deref().unwrap_or("none")
        )));
    }
    let (conversation, message, new) = (ConversationId::new(), MessageId::new(), RunId::new());
    sqlx::query("INSERT INTO conversation (id, owner_id, tenant_id) SELECT $2, owner_id, tenant_id FROM agent_run WHERE id = $1")
        .bind(run)
        .bind(conversation)
        .execute(&mut *tx)
        .await?;
    // The transcript before the turn, as the original's agent was shown it
    // (its order kept: the copies keep their times).
    sqlx::query(&format!(
        "{}
         INSERT INTO message (id, conversation_id, run_id, role, content, status, created_at)
         SELECT gen_random_uuid(), $3, NULL, role, content, status, created_at FROM t
         WHERE status IN ('complete', 'partial')
           AND (turn_at, turn_id) < (SELECT created_at, id FROM message WHERE id = $2)",
        conversations::TRANSCRIPT_CTE
    ))
    .bind(original)
    .bind(user_message)
    .bind(conversation)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO message (id, conversation_id, run_id, role, content, status)
         SELECT $2, $3, $4, 'user', coalesce($5, m.content), $6 FROM message m WHERE m.id = $1",
    )
    .bind(user_message)
    .bind(message)
    .bind(conversation)
    .bind(new)
    .bind(&at.content)
    .bind(MessageStatus::Queued)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO agent_run (id, conversation_id, owner_id, tenant_id, user_message_id, plugin, plugin_digest,
                                request, config, plugin_manifest, seed, forked_from, fork_after)
         SELECT $2, $3, owner_id, tenant_id, $4, plugin, plugin_digest, request, config, plugin_manifest,
                seed, $1, $5
         FROM agent_run WHERE id = $1",
    )
    .bind(run)
    .bind(new)
    .bind(conversation)
    .bind(message)
    .bind(after_call)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO run_call (run_id, position, import, name, args_hash, ops_before, ops_after, outcome,
                               result, attempt)
         SELECT $2, position, import, name, args_hash, ops_before, ops_after,
                CASE WHEN position = $3 AND $4::text IS NOT NULL THEN 'ok' ELSE outcome END,
                CASE WHEN position = $3 AND $4::text IS NOT NULL THEN $4 ELSE result END, 1
         FROM run_call WHERE run_id = $1 AND position <= $3",
    )
    .bind(run)
    .bind(new)
    .bind(after_call)
    .bind(&at.tool_answer)
    .execute(&mut *tx)
    .await?;
    journal_queued(&mut *tx, new, message, None).await?;
    notify(&mut *tx, RUN_ENQUEUED, &conversation.to_string()).await?;
    tx.commit().await?;
    Ok(Enqueued { run_id: new, status: RunStatus::Queued, conversation_id: conversation, user_message_id: message })
}
