//! (none) -> queued again, on purpose: retry.

use super::*;

#[derive(Debug, thiserror::Error)]
pub enum RetryError {
    #[error("run not found")]
    NotFound,
    #[error("{0}")]
    Conflict(String),
    /// The tenant has `max` queued runs, the most its quota allows.
    #[error("the tenant has {max} queued runs")]
    QueueFull { max: u32 },
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// For `POST /v1/runs/{id}/retry`: a new queued run for the same user
/// message (which goes back to `queued`), with the same plugin (digest and
/// manifest as pinned) and config, its seq 1-2 and the wake. Only a failed or
/// cancelled run that is its conversation's latest turn can be retried;
/// nothing is ever re-run silently. The run row, then the conversation row,
/// are locked, so two retries of one run serialise and the second finds a
/// later turn.
pub async fn retry(
    pool: &PgPool,
    run: RunId,
    owner_id: &str,
    tenant_max_queued: Option<u32>,
) -> Result<Enqueued, RetryError> {
    let mut tx = pool.begin().await?;
    // Held to the tenant's queue quota like any enqueue, its lock taken
    // before the run's and the conversation's (the order every enqueue keeps).
    if let Some(max) = tenant_max_queued {
        let tenant: String = sqlx::query_scalar("SELECT tenant_id FROM agent_run WHERE id = $1 AND owner_id = $2")
            .bind(run)
            .bind(owner_id)
            .fetch_optional(&mut *tx)
            .await?
            .ok_or(RetryError::NotFound)?;
        lock_tenant_queue(&mut tx, &tenant).await?;
        if !queue_has_room(&mut tx, &tenant, max).await? {
            return Err(RetryError::QueueFull { max });
        }
    }
    let locked = lock_owned_run(&mut tx, run, owner_id).await?.ok_or(RetryError::NotFound)?;
    let (conversation, message) = (locked.conversation_id, locked.user_message_id);
    sqlx::query("SELECT 1 FROM conversation WHERE id = $1 FOR UPDATE").bind(conversation).execute(&mut *tx).await?;
    // Read under the conversation's lock: no turn can be enqueued meanwhile.
    let later: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM agent_run l
                        WHERE l.conversation_id = r.conversation_id AND l.queue_pos > r.queue_pos)
         FROM agent_run r WHERE r.id = $1",
    )
    .bind(run)
    .fetch_one(&mut *tx)
    .await?;
    let status = locked.status;
    if status != RunStatus::Failed && status != RunStatus::Cancelled {
        return Err(RetryError::Conflict(format!(
            "run {run} is {status}: only a failed or cancelled run can be retried"
        )));
    }
    if later {
        return Err(RetryError::Conflict(format!(
            "run {run} is not its conversation's latest turn: only the latest turn can be retried"
        )));
    }
    let new = RunId::new();
    sqlx::query(
        "INSERT INTO agent_run (id, conversation_id, owner_id, tenant_id, user_message_id,
                                plugin, plugin_digest, request, config, plugin_manifest, webhook)
         SELECT $2, conversation_id, owner_id, tenant_id, user_message_id,
                plugin, plugin_digest, request, config, plugin_manifest, webhook
         FROM agent_run WHERE id = $1",
    )
    .bind(run)
    .bind(new)
    .execute(&mut *tx)
    .await?;
    sqlx::query("UPDATE message SET status = $3, run_id = $2 WHERE id = $1")
        .bind(message)
        .bind(new)
        .bind(MessageStatus::Queued)
        .execute(&mut *tx)
        .await?;
    journal_queued(&mut *tx, new, message, Some(run)).await?;
    notify(&mut *tx, RUN_ENQUEUED, &conversation.to_string()).await?;
    tx.commit().await?;
    Ok(Enqueued { run_id: new, status: RunStatus::Queued, conversation_id: conversation, user_message_id: message })
}
