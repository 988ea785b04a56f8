//! (none) -> running: the eager start, a run written claimed in its own enqueue.

use super::*;
use crate::db::enqueue::{bind_new_run, enqueue_target_sql, not_found, EnqueueError, NewRun};

/// A start made in the enqueue's own statement (eager start): the process
/// enqueuing has a free slot of its own, so instead of queueing the run,
/// waking every dispatcher with `run_enqueued` and waiting for one of them
/// to claim it, the enqueue writes it claimed by this process (`running`,
/// its fence token, lease and `started_at`, seq 3 `run_started`, the user
/// message `complete`), and the caller hands it to its worker's run task.
/// As Temporal's eager workflow start does, it saves the round trip to the
/// queue and back; here also one claim statement and one wake of every
/// idle dispatcher per run.
///
/// Only when it takes no other run's place: it is made only if nothing is
/// queued (a backlog keeps its claim order and its tenant fairness), the
/// conversation has no running or waiting turn (one running turn per
/// conversation, FIFO), and the tenant is under its running cap. Otherwise
/// the run is queued and woken for as always. The one-running index still
/// has the last word: an enqueue that meets a concurrent start in its
/// conversation is made again without the start ([`enqueue_eager`]).
#[derive(Debug, Clone)]
pub struct Eager<'a> {
    /// The claim as the worker would make it.
    pub worker_id: &'a str,
    pub lease: std::time::Duration,
    /// Running runs one tenant may have at most (`None`: no cap).
    pub tenant_max_running: Option<i64>,
}

/// The enqueue's statement ([`crate::db::enqueue::enqueue`]: the same
/// conversation, message, run and journal seq 1-2, its binds `$1`-`$20`)
/// with the start decided in it: the run `running` and claimed, seq 3
/// `run_started`, the message `complete`, and no wake; or, when the start is
/// not allowed, exactly the plain enqueue's rows.
const EAGER_SQL: &str = concat!(
    enqueue_target_sql!(),
    ",
-- Whether the run starts here (see `Eager`): nothing queued, no running or
-- waiting turn in a named conversation, the tenant under its cap.
eager AS (
    SELECT NOT EXISTS (SELECT 1 FROM agent_run WHERE status = 'queued')
       AND NOT EXISTS (SELECT 1 FROM agent_run
                       WHERE conversation_id = $1 AND status IN ('running', 'waiting'))
       AND ($23::bigint IS NULL
            OR (SELECT count(*) FROM agent_run WHERE tenant_id = $4 AND status = 'running') < $23)
       AS go
),
msg AS (
    INSERT INTO message (id, conversation_id, run_id, role, content, status)
    SELECT $5, t.id, $6, 'user', $7, CASE WHEN e.go THEN 'complete' ELSE $8::text END
    FROM target t, eager e
    RETURNING conversation_id
),
run AS (
    INSERT INTO agent_run (id, conversation_id, owner_id, tenant_id, user_message_id,
                           plugin, plugin_digest, request, config, idempotency_key, plugin_manifest, webhook,
                           status, claim_token, claim_expires_at, worker_id, started_at, last_heartbeat_at, seed)
    SELECT $6, m.conversation_id, $3, $4, $5, $9, $10, $11, $12, $13, $14, $15,
           CASE WHEN e.go THEN 'running' ELSE 'queued' END,
           CASE WHEN e.go THEN gen_random_uuid() END,
           -- The statement's start, not the transaction's: in a caller's
           -- transaction the enqueue is not its first statement.
           CASE WHEN e.go THEN statement_timestamp() + make_interval(secs => $22) END,
           CASE WHEN e.go THEN $21 END,
           CASE WHEN e.go THEN clock_timestamp() END,
           CASE WHEN e.go THEN statement_timestamp() END,
           CASE WHEN e.go THEN gen_random_uuid() END
    FROM msg m, eager e
    RETURNING id, conversation_id, status, claim_token, seed, trace_id, trace_span_id
),
journal AS (
    INSERT INTO run_event (run_id, seq, type, payload)
    SELECT r.id, s.seq, s.type, s.payload
    FROM run r, (VALUES (1, $16::text, $17::jsonb), (2, $18::text, $19::jsonb),
                        (3, $24::text, jsonb_build_object('worker_id', $21::text))) AS s(seq, type, payload)
    WHERE s.seq < 3 OR r.status = 'running'
),
-- A run that started here wakes nobody: no dispatcher could claim it.
wake AS (
    SELECT pg_notify($20, conversation_id::text) FROM run WHERE status = 'queued'
)
-- Referencing `wake` is what makes it run. `has_history`: the conversation
-- had a message before this turn's (this statement's snapshot holds none of
-- its own rows).
SELECT r.conversation_id, r.claim_token, r.seed,
       $1::uuid IS NOT NULL AND EXISTS (SELECT 1 FROM message h WHERE h.conversation_id = $1)
           AS has_history,
       r.trace_id, r.trace_span_id
FROM run r WHERE (SELECT count(*) FROM wake) >= 0"
);

/// [`crate::db::enqueue::enqueue`], starting the run in the same statement
/// when `eager` allows (see [`Eager`]): the run as claimed, for the caller's
/// worker to run at once (the caller took its slot before), or `None` when
/// it was queued. An enqueue that met a start in its conversation committing
/// at the same instant (the one-running index refused it, rolling back
/// everything) is made again without the start.
pub async fn enqueue_eager(
    pool: &PgPool,
    new: &NewRun<'_>,
    eager: &Eager<'_>,
) -> Result<(Enqueued, Option<ClaimedRun>), EnqueueError> {
    match start_on(pool, new, eager).await {
        Err(EnqueueError::Db(e)) if is_running_conflict(&e) => {
            Ok((crate::db::enqueue::enqueue(pool, new).await?, None))
        }
        done => done,
    }
}

/// [`enqueue_eager`] inside a caller's transaction; a start refused by the
/// index rolls back to a savepoint, not the caller's transaction. (Only a
/// named conversation can meet one: a new one is made in the statement.)
pub async fn enqueue_eager_in(
    tx: &mut Transaction<'_, Postgres>,
    new: &NewRun<'_>,
    eager: &Eager<'_>,
) -> Result<(Enqueued, Option<ClaimedRun>), EnqueueError> {
    if new.conversation_id.is_none() {
        return start_on(&mut **tx, new, eager).await;
    }
    let mut savepoint = sqlx::Connection::begin(&mut **tx).await?;
    match start_on(&mut *savepoint, new, eager).await {
        Ok(done) => {
            savepoint.commit().await?;
            Ok(done)
        }
        Err(EnqueueError::Db(e)) if is_running_conflict(&e) => {
            savepoint.rollback().await?;
            Ok((crate::db::enqueue::enqueue_in(tx, new).await?, None))
        }
        // The error itself (a used idempotency key, a missing conversation),
        // not the release's failure in an aborted transaction.
        Err(e) => {
            let _ = savepoint.rollback().await;
            Err(e)
        }
    }
}

async fn start_on(
    db: impl PgExecutor<'_>,
    new: &NewRun<'_>,
    eager: &Eager<'_>,
) -> Result<(Enqueued, Option<ClaimedRun>), EnqueueError> {
    let run_id = RunId::new();
    let message_id = MessageId::new();
    type Row = (ConversationId, Option<ClaimToken>, Option<uuid::Uuid>, bool, Option<uuid::Uuid>, Option<i64>);
    let row: Option<Row> = bind_new_run(sqlx::query_as(EAGER_SQL), new, run_id, message_id)
        .bind(eager.worker_id)
        .bind(eager.lease.as_secs_f64())
        .bind(eager.tenant_max_running)
        .bind(RUN_STARTED)
        .fetch_optional(db)
        .await?;
    let Some((conversation_id, token, seed, has_history, trace_id, trace_span_id)) = row else {
        return Err(not_found(new));
    };
    // The answer the API gives: the state the run was accepted in (seq 2,
    // `run_queued`), whether or not it started in the same commit.
    let enqueued = Enqueued { run_id, status: RunStatus::Queued, conversation_id, user_message_id: message_id };
    // A token and a seed: the statement started the run.
    let started = token.zip(seed).map(|(claim_token, seed)| ClaimedRun {
        id: run_id,
        conversation_id,
        claim_token,
        user_message_id: message_id,
        owner_id: new.owner.user_id.clone(),
        tenant_id: new.owner.tenant_id.clone(),
        plugin: new.plugin.to_string(),
        plugin_digest: new.plugin_digest.map(str::to_string),
        plugin_manifest: new.plugin_manifest.cloned(),
        config: new.config.clone(),
        content: new.content.to_string(),
        waited_s: 0.0,
        attempt: 1,
        waits: 0,
        seed,
        forked: false,
        has_history,
        trace_id,
        trace_span_id,
    });
    Ok((enqueued, started))
}
