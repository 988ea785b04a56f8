//! running -> terminal: the holder's finish, the backstop; the reaper's reap or resume, the drain's hand-back.

use super::*;

/// How a worker ends its run.
#[derive(Debug, Clone)]
pub struct Finish<'a> {
    pub status: RunStatus,
    pub error: Option<&'a str>,
    /// The assistant's text, if any, with its message status (`complete` or
    /// `partial`).
    pub assistant: Option<(&'a str, MessageStatus)>,
    /// Model usage (`agent::Usage`), if the run called a model.
    pub usage: Option<Value>,
}

/// running -> completed | failed | cancelled, for the run task (the claim
/// holder), fenced: status flip, `finished_at`, the one `complete` event, the
/// assistant message and the wake, in one statement (one transaction). The
/// `complete` seq is max(seq)+1: the holder's own appends are done (or, for
/// the backstop, its task is gone), so nothing can append concurrently.
/// Returns false when fenced: someone else already ended this run.
pub async fn finish(
    db: impl PgExecutor<'_>,
    run: RunId,
    token: ClaimToken,
    finish: &Finish<'_>,
) -> Result<bool, sqlx::Error> {
    let ending = Ending {
        run,
        token,
        status: finish.status,
        error: finish.error.map(str::to_string),
        assistant: finish.assistant.map(|(t, s)| (t.to_string(), s)),
        usage: finish.usage.clone(),
    };
    Ok(!finish_many(db, std::slice::from_ref(&ending)).await?.is_empty())
}

/// One ending of a batch for [`finish_many`]: the run, the token it was
/// claimed with, and how it ends.
#[derive(Debug, Clone)]
pub struct Ending {
    pub run: RunId,
    pub token: ClaimToken,
    pub status: RunStatus,
    pub error: Option<String>,
    pub assistant: Option<(String, MessageStatus)>,
    pub usage: Option<Value>,
}

/// Endings one [`finish_many`] statement writes at most.
pub const FINISH_BATCH_MAX: usize = 256;

/// running -> completed | failed | cancelled for several runs in ONE
/// statement (one commit), for the worker's group commit. Each row is
/// [`finish`] exactly: fenced by its own token (`claim_token = token AND
/// status = 'running'`), with its `complete` event (its own max(seq)+1), its
/// assistant message, its tails told (NOTIFY on its events channel) and the
/// wake of its conversation. A fenced row matches
/// nothing and drops out alone: the answer lists the runs whose ending was
/// written, and a run missing from it was ended by someone else. At most
/// [`FINISH_BATCH_MAX`] endings; a run appears at most once.
pub async fn finish_many(db: impl PgExecutor<'_>, endings: &[Ending]) -> Result<Vec<RunId>, sqlx::Error> {
    if endings.is_empty() {
        return Ok(Vec::new());
    }
    let rows = bind_endings(sqlx::query(&FINISH_SQL), endings).fetch_all(db).await?;
    rows.iter().map(|r| r.try_get(0)).collect()
}

/// [`finish_many`]'s statement.
pub(super) static FINISH_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH {FINISH_CTES}
         -- Referencing `wake` and `told` is what makes them run.
         SELECT f.id FROM fin f WHERE (SELECT count(*) FROM wake) >= 0 AND (SELECT count(*) FROM told) >= 0"
    )
});

/// What [`finish_and_claim`] did: the endings written (a run missing was
/// fenced) and the runs claimed into the freed slots.
#[derive(Debug, Default)]
pub struct Turnover {
    pub written: Vec<RunId>,
    pub claimed: Vec<ClaimedRun>,
    /// Statements the one-running-per-conversation index refused.
    pub conflicts: u32,
    /// The queue held nothing else to claim ([`DRY_SQL`]).
    pub dry: bool,
}

/// running -> terminal for a batch of endings and queued -> running for up
/// to `claim.limit` runs, in ONE statement and one (durable) commit: the
/// worker's finisher hands the slots its endings free straight to the runs
/// it claims, so a busy worker makes one statement, one commit and one
/// round trip per batch instead of two. Each ending is [`finish_many`]'s
/// exactly (fenced per row: a fenced row drops out alone); the claim is
/// [`claim`]'s exactly (each conversation's oldest queued turn, fair across
/// tenants, SKIP LOCKED, `run_started`, the user message `complete`), except
/// that it waits for the flush with the endings instead of skipping it.
///
/// Both halves read one snapshot: a conversation whose running turn ends in
/// this statement still looks running to the claim, so its next turn is not
/// claimed here (the pre-filter passes over it and the unique index would
/// refuse it); the ending's wake knocks for it, and the dispatcher claims it
/// after this commit. An index conflict (a turn the pre-filter could not
/// see) rolls the whole statement back: the statement is made again passing
/// over that conversation, up to [`CLAIM_CONFLICTS_MAX`] times, then the
/// endings are written alone and nothing is claimed. At most
/// [`FINISH_BATCH_MAX`] endings, and `claim.limit` rows: the caller holds a
/// slot for each (acquire-before-pull).
pub async fn finish_and_claim(
    conn: &mut PgConnection,
    endings: &[Ending],
    claim: &Claim<'_>,
) -> Result<Turnover, sqlx::Error> {
    let shape = !claim.rooms.bind(claim.limit);
    let (rows, conflicts) = past_conflicts(
        conn,
        shape,
        |except| write_claim_in(&TURNOVER_SQL, claim, except),
        |q| bind_endings(q, endings),
    )
    .await?;
    let Some(rows) = rows else {
        // Out of conflicts: the endings alone.
        return Ok(Turnover {
            written: finish_many(&mut *conn, endings).await?,
            claimed: Vec::new(),
            conflicts,
            dry: false,
        });
    };
    // Every row carries the ended runs; a row without an id is the one the
    // LEFT JOIN makes when nothing was claimed.
    let ended: Option<Vec<uuid::Uuid>> = match rows.first() {
        Some(row) => row.try_get("ended")?,
        None => None,
    };
    Ok(Turnover {
        written: ended.unwrap_or_default().into_iter().map(RunId).collect(),
        claimed: claimed_in(&rows)?,
        conflicts,
        dry: dry_in(&rows)?,
    })
}

/// [`finish_and_claim`]'s statement, the claim's values still to be
/// written in ([`write_claim_in`]).
pub(super) static TURNOVER_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH RECURSIVE {FINISH_CTES}, {CLAIM_CTES}
         SELECT ended.ids AS ended, {DRY_SQL} AS dry, x.*
         FROM (SELECT array_agg(id) AS ids FROM fin) ended
         LEFT JOIN (SELECT c.*, umsg.content, umsg.has_history
                    FROM claimed c JOIN umsg ON umsg.id = c.user_message_id) x ON true
         -- Referencing `wake` and `told` is what makes them run.
         WHERE (SELECT count(*) FROM wake) >= 0 AND (SELECT count(*) FROM told) >= 0"
    )
});

/// The ending's common table expressions (`e` .. `told`), shared by
/// [`finish_many`] and [`finish_and_claim`]; their parameters are bound by
/// [`bind_endings`]. `fin` answers the runs whose ending was written.
pub(super) const FINISH_CTES: &str = "e AS (
             -- Each array is read through a subquery, so no plan sees its
             -- length: the custom plan costs what the generic one does and
             -- the prepared statement keeps the generic plan (read directly,
             -- every call's lengths made a custom plan look cheaper, and the
             -- statement was planned on every call, 0.65 ms a time).
             SELECT * FROM unnest((SELECT $1::uuid[]), (SELECT $2::uuid[]), (SELECT $3::text[]),
                                  (SELECT $4::text[]), (SELECT $5::text[]), (SELECT $6::text[]),
                                  (SELECT $7::text[]), (SELECT $8::text[]), (SELECT $9::uuid[]),
                                  (SELECT $12::text[]))
                 AS e(id, token, status, error, text, message_status, usage, payload, message_id, channel)
         ),
         -- No explicit row locks: the heartbeat, the one other statement that
         -- writes several running rows, skips a row it finds locked (see
         -- `heartbeat`), so it never waits on an ending and the two cannot
         -- deadlock, whatever order this update takes its rows in.
         fin AS (
             -- finished_at is the statement clock (see the module's Clocks).
             UPDATE agent_run r SET status = e.status, error = e.error, finished_at = clock_timestamp(),
                                    usage = e.usage::jsonb
             FROM e
             WHERE r.id = e.id
               AND r.claim_token = e.token AND r.status = 'running'   -- the fence, per row
             RETURNING r.id, r.conversation_id
         ),
         ev AS (
             INSERT INTO run_event (run_id, seq, type, payload)
             SELECT f.id, (SELECT coalesce(max(seq), 0) + 1 FROM run_event WHERE run_id = f.id), $10, e.payload::jsonb
             FROM fin f JOIN e ON e.id = f.id
         ),
         msg AS (
             INSERT INTO message (id, conversation_id, run_id, role, content, status)
             SELECT e.message_id, f.conversation_id, f.id, 'assistant', e.text, e.message_status
             FROM fin f JOIN e ON e.id = f.id WHERE e.text IS NOT NULL
         ),
         -- The wake chain, as in `finish`: knock once per conversation that
         -- has a turn waiting on one of these runs.
         wake AS (
             SELECT pg_notify($11, c.conversation_id::text)
             FROM (SELECT DISTINCT conversation_id FROM fin) c
             WHERE EXISTS (SELECT 1 FROM agent_run q
                           WHERE q.conversation_id = c.conversation_id AND q.status = 'queued')
         ),
         -- Each run's tails: its `complete` is there. A notifying commit
         -- holds the notify queue's lock through its flush, which would
         -- serialise terminal commits one run at a time; one commit serves
         -- the whole batch here, so it is taken once per batch.
         told AS (
             SELECT pg_notify(e.channel, $13) FROM fin f JOIN e ON e.id = f.id
         )";

/// `query` (a statement over [`FINISH_CTES`]) with the endings bound.
pub(super) fn bind_endings<'q>(query: PgQuery<'q>, endings: &[Ending]) -> PgQuery<'q> {
    assert!(endings.len() <= FINISH_BATCH_MAX, "a batch of {} endings", endings.len());
    debug_assert!(endings.iter().all(|e| e.status.is_terminal()));
    let col = |f: &dyn Fn(&Ending) -> Option<String>| endings.iter().map(f).collect::<Vec<Option<String>>>();
    let ids: Vec<uuid::Uuid> = endings.iter().map(|e| e.run.0).collect();
    let tokens: Vec<uuid::Uuid> = endings.iter().map(|e| e.token.0).collect();
    let message_ids: Vec<uuid::Uuid> = endings.iter().map(|_| MessageId::new().0).collect();
    query
        .bind(ids)
        .bind(tokens)
        .bind(col(&|e| Some(e.status.as_str().to_string())))
        .bind(col(&|e| e.error.clone()))
        .bind(col(&|e| e.assistant.as_ref().map(|(t, _)| t.clone())))
        .bind(col(&|e| e.assistant.as_ref().map(|(_, s)| s.as_str().to_string())))
        .bind(col(&|e| e.usage.as_ref().map(|u| u.to_string())))
        .bind(col(&|e| Some(complete_payload(e.status, e.error.as_deref()).to_string())))
        .bind(message_ids)
        .bind(COMPLETE)
        .bind(RUN_ENQUEUED)
        .bind(col(&|e| Some(events_channel(e.run))))
        .bind(COMPLETE_PAYLOAD)
}

/// running -> failed, for the run task's backstop: the run's own task died
/// (panic, error) without an ending. Fenced like [`finish`], which it is with
/// no answer and no usage; `reason` is the run's error text.
pub async fn backstop(
    db: impl PgExecutor<'_>,
    run: RunId,
    token: ClaimToken,
    reason: &str,
) -> Result<bool, sqlx::Error> {
    let ending = Finish { status: RunStatus::Failed, error: Some(reason), assistant: None, usage: None };
    finish(db, run, token, &ending).await
}

/// The wake chain's second half, after terminal writes have committed (the
/// waker calls it, batched across runs that ended in the same instant). No
/// status change. A turn enqueued after a terminal write's snapshot but
/// before its commit announced itself while this run still looked running,
/// so its wake found nothing to claim; this read (a fresh snapshot, after our
/// commit) sees it and knocks for it. A turn enqueued after this read
/// announces itself after our commit. Either way it is claimed now, not on
/// the tick.
///
/// A plain read first, which takes no transaction id, writes no commit
/// record and waits for no flush: the knock (a NOTIFY, which does all three)
/// is sent only for conversations that have a queued turn, almost never in a
/// drain. (Each run's tails were told in its terminal write's own statement.)
pub async fn announce_ended(conn: &mut PgConnection, ended: &[(RunId, ConversationId)]) -> Result<(), sqlx::Error> {
    let conversations: Vec<uuid::Uuid> = ended.iter().map(|(_, c)| c.0).collect();
    // Per conversation, a probe of its queued turns. The array is read
    // through a subquery: a plan sees no array length, so the custom plan
    // costs what the generic one does and the prepared statement keeps the
    // generic plan. Unnested directly, each call's length made its custom
    // plan look cheaper, and the statement was planned anew on every call
    // (in a drain: 14,563 plans in 19,621 calls, 3.3 s of the server's CPU).
    let waiting: Vec<uuid::Uuid> = sqlx::query_scalar(
        "SELECT c FROM (SELECT DISTINCT c FROM unnest((SELECT $1::uuid[])) AS c) d
         WHERE EXISTS (SELECT 1 FROM agent_run WHERE conversation_id = d.c AND status = 'queued')",
    )
    .bind(conversations)
    .fetch_all(&mut *conn)
    .await?;
    if waiting.is_empty() {
        return Ok(());
    }
    sqlx::query("SELECT pg_notify($1, c::text) FROM unnest($2::uuid[]) AS c")
        .bind(RUN_ENQUEUED)
        .bind(waiting)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// A run whose lease lapsed past the grace, as the reaper read it.
#[derive(Debug, Clone, Copy, sqlx::FromRow)]
pub struct Expired {
    pub id: RunId,
    pub claim_token: ClaimToken,
}

/// The reaper's read (and the boot reconciler's): running runs whose lease
/// lapsed more than `grace` ago (by the database's clock). A snapshot, stale
/// the instant it is returned; [`reap`] re-checks in its write. Served by
/// `agent_run_running_by_tenant`, whose entries are the running runs only,
/// bounded by the slots (migration 0009 dropped the lease index every claim
/// and heartbeat wrote).
pub async fn find_expired(db: impl PgExecutor<'_>, grace: Duration, limit: i64) -> Result<Vec<Expired>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, claim_token FROM agent_run
         WHERE status = 'running' AND claim_expires_at < now() - make_interval(secs => $1)
         ORDER BY claim_expires_at LIMIT $2",
    )
    .bind(grace.as_secs_f64())
    .bind(limit)
    .fetch_all(db)
    .await
}

/// What [`reap_or_resume`] did with a lapsed run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reaped {
    /// Ended: failed (worker lost), failed with its attempts exhausted, or
    /// (a resumable run whose stop was requested) cancelled.
    Ended(RunStatus, crate::error::FailReason),
    /// A resumable run, back in the queue as its conversation's head; this
    /// is the attempt its next claim makes.
    Requeued { attempt: i32 },
}

/// running -> failed (or, for a resumable run, back to queued), for the
/// reaper and the boot reconciler, with the default attempts of a resumable
/// run. See [`reap_or_resume`].
pub async fn reap(pool: &PgPool, expired: Expired, grace: Duration) -> Result<bool, sqlx::Error> {
    Ok(reap_or_resume(pool, expired, grace, RESUME_ATTEMPTS_DEFAULT).await?.is_some())
}

/// Attempts a resumable run gets by default before it ends failed.
pub const RESUME_ATTEMPTS_DEFAULT: u32 = 3;

/// For the reaper and the boot reconciler: a lost worker's run, if the lease
/// is still lapsed *now* (the liveness check lives in the write, so a
/// heartbeat that landed after [`find_expired`] makes this a no-op). A
/// resumable run with attempts left (`attempt < attempts_max`) goes running
/// -> queued with its attempt raised and the wake; any other goes running ->
/// failed (a resumable run whose stop was requested: cancelled) with its
/// `complete` event (seq max+1, safe because the fence now shuts the worker
/// out) and the wake. `None`: nothing was done.
pub async fn reap_or_resume(
    pool: &PgPool,
    expired: Expired,
    grace: Duration,
    attempts_max: u32,
) -> Result<Option<Reaped>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    if let Some(attempt) = requeue(&mut tx, expired.id, expired.claim_token, Some(grace), attempts_max).await? {
        tx.commit().await?;
        return Ok(Some(Reaped::Requeued { attempt }));
    }
    let reaped: Option<(ConversationId, RunStatus, Option<String>, bool)> = sqlx::query_as(
        "WITH r AS (SELECT id, (plugin_manifest ->> 'durability') IS NOT DISTINCT FROM 'resume' AS resumable
                    FROM agent_run WHERE id = $1)
         UPDATE agent_run a SET
                status = CASE WHEN r.resumable AND a.cancel_requested THEN 'cancelled' ELSE 'failed' END,
                finished_at = clock_timestamp(),
                error = CASE
                    WHEN r.resumable AND a.cancel_requested THEN NULL
                    WHEN r.resumable
                    THEN 'attempts exhausted: the run lost its worker on attempt ' || (a.attempt - a.waits) || ' of ' || $4
                         || ' (worker ' || coalesce(a.worker_id, '?') || ')'
                    ELSE 'worker lost: lease expired without a heartbeat (worker ' || coalesce(a.worker_id, '?') || ')'
                    END
         FROM r
         WHERE a.id = r.id AND a.claim_token = $2 AND a.status = 'running'
           AND a.claim_expires_at < now() - make_interval(secs => $3)   -- still dead now?
         RETURNING a.conversation_id, a.status, a.error, r.resumable",
    )
    .bind(expired.id)
    .bind(expired.claim_token)
    .bind(grace.as_secs_f64())
    .bind(attempts_max as i32)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((conversation_id, status, error, resumable)) = reaped else {
        return Ok(None);
    };
    write_complete(&mut *tx, expired.id, status, error.as_deref()).await?;
    notify(&mut *tx, RUN_ENQUEUED, &conversation_id.to_string()).await?;
    notify(&mut *tx, &events_channel(expired.id), COMPLETE_PAYLOAD).await?;
    tx.commit().await?;
    let reason = match resumable {
        true => crate::error::FailReason::Attempts,
        false => crate::error::FailReason::WorkerLost,
    };
    Ok(Some(Reaped::Ended(status, reason)))
}

/// running -> queued, for the run task of a resumable run that a drain is
/// aborting: fenced by the claim token, only with attempts left (`attempt <
/// attempts_max`); raises the attempt, clears the lease and wakes the
/// claimers, so another process resumes it at once instead of after a lease.
/// Returns false when fenced or out of attempts (the caller then ends it).
pub async fn hand_back(pool: &PgPool, run: RunId, token: ClaimToken, attempts_max: u32) -> Result<bool, sqlx::Error> {
    let mut tx = pool.begin().await?;
    if requeue(&mut tx, run, token, None, attempts_max).await?.is_none() {
        return Ok(false);
    }
    tx.commit().await?;
    Ok(true)
}

/// running -> queued in the caller's transaction, for [`reap_or_resume`]
/// (`lapsed`: only if the lease lapsed more than this ago, re-checked here)
/// and [`hand_back`]: fenced by the claim token, only for a resumable run
/// with attempts left; raises the attempt, clears the lease (the trigger
/// admits nothing else) and wakes the claimers. Returns the new attempt.
pub(super) async fn requeue(
    tx: &mut Transaction<'_, Postgres>,
    run: RunId,
    token: ClaimToken,
    lapsed: Option<Duration>,
    attempts_max: u32,
) -> Result<Option<i32>, sqlx::Error> {
    let requeued: Option<(ConversationId, i32)> = sqlx::query_as(
        "UPDATE agent_run SET status = 'queued', attempt = attempt + 1,
                claim_expires_at = NULL, last_heartbeat_at = NULL
         WHERE id = $1 AND claim_token = $2 AND status = 'running'   -- the fence
           AND ($3::float8 IS NULL OR claim_expires_at < now() - make_interval(secs => $3))   -- still dead now?
           AND plugin_manifest ->> 'durability' = 'resume' AND attempt - waits < $4
           AND NOT cancel_requested   -- a stopped run is ended, not resumed
         RETURNING conversation_id, attempt",
    )
    .bind(run)
    .bind(token)
    .bind(lapsed.map(|d| d.as_secs_f64()))
    .bind(attempts_max as i32)
    .fetch_optional(&mut **tx)
    .await?;
    let Some((conversation_id, attempt)) = requeued else {
        return Ok(None);
    };
    notify(&mut **tx, RUN_ENQUEUED, &conversation_id.to_string()).await?;
    Ok(Some(attempt))
}
