//! Every change of a run's status, and the reads that decide one. No other
//! module changes `agent_run.status` (enqueue, and the benchmark's bulk
//! enqueue, insert runs `queued`). Each function's doc names its
//! caller and the transition it makes; the schema's trigger
//! `agent_run_status_transition` (`agent_run_transition_check`, last in
//! `migrations/0006_waiting.sql`; an AFTER trigger since
//! `migrations/0013_transition_after.sql`, which the claim's and the ending's
//! always-legal transitions pass over) enforces the same table, so a
//! transition missing here is refused by the database too.
//!
//! # The run state machine
//!
//! | from    | to        | function                         | caller                                   |
//! |---------|-----------|----------------------------------|------------------------------------------|
//! | (none)  | queued    | [`super::enqueue::enqueue`], [`retry`] (a new run) | HTTP API, demo, bench; HTTP retry |
//! | (none)  | running   | [`super::enqueue::enqueue_eager`]: queued and claimed in one statement, only when no other run is queued and its conversation has no active turn | HTTP API on a process with a free slot |
//! | queued  | running   | [`claim_batch`] ([`claim`]); [`finish_and_claim`] (with a batch of endings) | dispatcher; finisher |
//! | queued  | cancelled | [`cancel`], [`stop_conversation`] | HTTP cancel, HTTP stop                  |
//! | running | completed, failed, cancelled | [`finish_many`], [`finish_and_claim`] (group commit, each row fenced), [`finish`] (fenced) | run task (through the worker's finisher) |
//! | running | failed    | [`backstop`] (fenced)            | run task, when the run's own task died   |
//! | running | failed    | [`reap_or_resume`] (lease lapsed past the grace, re-checked in the write) | reaper, boot reconciler |
//! | running | queued    | [`reap_or_resume`], [`hand_back`] (fenced): a resumable run with attempts left, `attempt` raised | reaper, boot reconciler; run task at a drain timeout |
//! | running | waiting   | [`super::suspensions::suspend`] (fenced): a resumable run's call needs approval, or waits | run task (the run host) |
//! | waiting | queued    | [`super::suspensions::decide`], [`super::suspensions::wake_due`]: `attempt` raised | HTTP decision; the scheduler (reaper loop) |
//! | waiting | cancelled | [`cancel`], [`stop_conversation`] | HTTP cancel, HTTP stop |
//! | running | (flag)    | [`cancel`], [`stop_conversation`] set `cancel_requested` and NOTIFY; the holder then [`finish`]es `cancelled` | HTTP cancel, HTTP stop |
//!
//! completed, failed and cancelled are terminal: the trigger refuses any
//! change out of them. Nothing re-queues a run that started except the
//! hand-back of a resumable run (its plugin's manifest says `"durability":
//! "resume"`), which the trigger admits only with `attempt` raised by one and
//! the lease cleared; every other run is at-most-once: its worker died, it
//! ends failed, and a person's [`retry`] is a new run. A handed-back run keeps
//! its `queue_pos`, so it is its conversation's head again and no later turn
//! can start before it; its next claim rotates the claim token, which fences
//! the old worker out of every write. Every terminal write commits the run's
//! one `complete` event with the status flip.
//!
//! # The message state machine (see [`MessageStatus`])
//!
//! | role      | from            | to       | by                                             |
//! |-----------|-----------------|----------|------------------------------------------------|
//! | user      | (none)          | queued   | enqueue                                        |
//! | user      | queued          | complete | [`claim`] (its run started)                    |
//! | user      | queued          | draft    | [`cancel`] of a queued run, [`stop_conversation`] |
//! | user      | draft, complete | queued   | [`retry`] (its run failed or was cancelled)    |
//! | assistant | (none)          | complete | [`finish`] of a completed run                  |
//! | assistant | (none)          | partial  | [`finish`] of a failed or cancelled run with text streamed |
//!
//! # Clocks
//!
//! `started_at` and `finished_at` are the statement clock,
//! `clock_timestamp()`, taken while the row is written: a claim whose
//! transaction began before the previous turn's finish committed still
//! records a start after that finish, so a conversation's turns never appear
//! to overlap. (`now()` is the transaction's start, which precedes the
//! snapshot that saw the previous turn end.) Leases (`claim_expires_at`,
//! `last_heartbeat_at`) are the database's `now()` in every statement that
//! writes or compares them (claim, heartbeat, reaper): one clock for all
//! processes, and each of those statements is its transaction's first, so
//! `now()` trails the statement clock by far less than the reap grace.
//!
//! A message's `created_at` is its column default, `clock_timestamp()`, too,
//! so an answer is stamped after its run's `finished_at`.
//!
//! A status a statement decides itself is a literal in its SQL, as in the
//! trigger and the partial indexes (the planner matches `status = 'queued'`
//! against an index's predicate by its text, which a bound parameter would
//! defeat); a status that comes from Rust is bound as its typed enum.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use sqlx::postgres::PgRow;
use sqlx::{FromRow, PgConnection, PgExecutor, PgPool, Postgres, Row, Transaction};

pub use super::claimed::{is_running_conflict, ClaimedRun};
use super::enqueue::{journal_queued, Enqueued};
use super::events::{complete_payload, COMPLETE, RUN_STARTED};
use super::journal::write_complete;
use super::notify::{events_channel, notify, COMPLETE_PAYLOAD, RUN_CANCEL, RUN_ENQUEUED};
use super::{conversations, ClaimToken, ConversationId, MessageId, MessageStatus, RunId, RunStatus};

// ---------------------------------------------------------------------------
// queued -> running: the claim.

/// Parameters of one claim.
#[derive(Debug, Clone)]
pub struct Claim<'a> {
    /// At most this many rows: the dispatcher's free slots (acquire-before-pull).
    pub limit: i64,
    pub lease: Duration,
    pub worker_id: &'a str,
    /// The NOT EXISTS filter that skips conversations with a running run. An
    /// optimisation only (the partial unique index is the guarantee); tests
    /// turn it off to show the index holds alone.
    pub prefilter: bool,
    /// Running runs one tenant may have at most (`None`: no cap).
    pub tenant_max_running: Option<i64>,
    /// Runs each tenant may still start on this worker: its share of the
    /// process's slots less what it holds here ([`Rooms`]).
    pub rooms: Rooms,
}

/// How many more runs each tenant may start on the claiming worker (its
/// share of the process's slots, less the runs it holds there). Tenants not
/// named take `default`. A claim whose rooms bind nothing (every tenant may
/// take all `limit` rows) is the same statement as one without them, so it
/// keeps its prepared plan; one that binds is written for that claim alone.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rooms {
    pub tenants: Vec<String>,
    pub slots: Vec<i64>,
    /// For tenants not named; `None`: as many as the claim asks.
    pub default: Option<i64>,
}

impl Rooms {
    /// Whether the rooms can keep a claim of `limit` rows from any row.
    pub fn bind(&self, limit: i64) -> bool {
        self.default.is_some_and(|d| d < limit) || self.slots.iter().any(|s| *s < limit)
    }
}

/// The claim's common table expressions, shared by [`CLAIM_SQL`] and the
/// ending-and-claim statement ([`finish_and_claim`]); `umsg` answers the
/// claimed runs' user messages.
const CLAIM_CTES: &str = "
-- Tenants with queued work: a loose index scan (one probe per tenant) over
-- agent_run_queued_by_tenant, not a scan of the queue.
tenants AS (
    (SELECT tenant_id FROM agent_run WHERE status = 'queued' ORDER BY tenant_id LIMIT 1)
    UNION ALL
    SELECT (SELECT a.tenant_id FROM agent_run a
            WHERE a.status = 'queued' AND a.tenant_id > t.tenant_id
            ORDER BY a.tenant_id LIMIT 1)
    FROM tenants t WHERE t.tenant_id IS NOT NULL
),
-- Running runs per tenant. Only needed to weigh tenants against each other
-- or against a cap: a lone tenant without a cap skips the count (CASE runs
-- its subquery only when taken), which would otherwise step over every dead
-- index entry its finished runs left behind.
load AS (
    SELECT t.tenant_id,
           CASE WHEN {capped} OR (SELECT count(*) FROM tenants WHERE tenant_id IS NOT NULL) > 1
                THEN (SELECT count(*) FROM agent_run b WHERE b.tenant_id = t.tenant_id AND b.status = 'running')
                ELSE 0 END AS running
    FROM tenants t WHERE t.tenant_id IS NOT NULL
),
-- Each tenant's oldest claimable turns, locked as they are found (SKIP
-- LOCKED inside the per-tenant scan, so concurrent claimers move past each
-- other's rows exactly as a plain FIFO claim would), then ranked by the load
-- the tenant would carry if each were claimed (running + place in its line):
-- the least-loaded tenant goes first, and one claim's rows interleave
-- tenants. Rows locked but not chosen are released at commit, moments later.
-- The optional cap ({cap}) keeps a tenant from ever passing that many running.
heads AS (
    SELECT l.tenant_id, l.running, c.id, c.queue_pos
    FROM load l CROSS JOIN LATERAL (
        SELECT q.id, q.queue_pos
        FROM agent_run q
        WHERE q.tenant_id = l.tenant_id AND q.status = 'queued'
          -- FIFO within a conversation: only its oldest queued turn is a
          -- candidate, so SKIP LOCKED can never slide onto a later turn.
          AND NOT EXISTS (
              SELECT 1 FROM agent_run e
              WHERE e.conversation_id = q.conversation_id
                AND e.status = 'queued' AND e.queue_pos < q.queue_pos)
          -- The pre-filter (an optimisation). OFFSET 0 keeps it a probe of
          -- one_running_per_conversation per candidate: without it the
          -- planner may hash the whole index instead, every entry a finished
          -- run left there until vacuum included, on every claim.
          AND (NOT {prefilter} OR NOT EXISTS (
              SELECT 1 FROM agent_run b
              WHERE b.conversation_id = q.conversation_id AND b.status IN ('running', 'waiting')
              OFFSET 0))
          -- Conversations the index turned away earlier in this claim.
          AND NOT (q.conversation_id = ANY({except}::uuid[]))
        ORDER BY q.queue_pos
        LIMIT {limit}
        FOR UPDATE SKIP LOCKED                 -- contended rows turn invisible
    ) c
),
candidates AS (
    SELECT id, queue_pos, tenant_id,
           running + row_number() OVER (PARTITION BY tenant_id ORDER BY queue_pos) AS load_after,
           row_number() OVER (PARTITION BY tenant_id ORDER BY queue_pos) AS taken_here
    FROM heads
),
-- The tenants' rooms on this worker ({rooms}): a tenant takes no more
-- rows than its share of this process's slots leaves it (`worker::shares`).
rooms AS (
    SELECT * FROM unnest({room_tenants}::text[], {room_slots}::bigint[]) AS room(tenant_id, slots)
),
claimed AS (
    UPDATE agent_run r SET
        status            = 'running',
        claim_token       = gen_random_uuid(),
        claim_expires_at  = now() + make_interval(secs => {lease}),
        worker_id         = {worker},
        -- The statement clock: after the previous turn's finish, which this
        -- statement's snapshot saw commit (see the module's Clocks).
        started_at        = coalesce(r.started_at, clock_timestamp()),
        last_heartbeat_at = now(),
        seed              = coalesce(r.seed, gen_random_uuid())
    WHERE r.id IN (
        SELECT id FROM candidates
        WHERE (NOT {capped} OR load_after <= {cap})
          AND taken_here <= coalesce((SELECT slots FROM rooms WHERE rooms.tenant_id = candidates.tenant_id),
                                     {room_default})
        ORDER BY load_after, queue_pos
        LIMIT {limit}
    )
    RETURNING r.id, r.conversation_id, r.claim_token, r.user_message_id, r.owner_id,
              r.tenant_id, r.plugin, r.plugin_digest, r.plugin_manifest, r.config,
              extract(epoch FROM now() - r.created_at)::float8 AS waited_s, r.attempt, r.waits, r.seed
),
started AS (
    -- seq 3 belongs to the first claim: the run_started event commits with
    -- it. A resumed run's worker journals run_resumed instead.
    INSERT INTO run_event (run_id, seq, type, payload)
    SELECT id, 3, {run_started}, jsonb_build_object('worker_id', {worker}::text) FROM claimed WHERE attempt = 1
),
umsg AS (
    UPDATE message m SET status = 'complete'
    FROM claimed c WHERE m.id = c.user_message_id
    -- Whether the conversation has any other message: when it has none (a
    -- first turn, most runs), the run task need not read a history.
    RETURNING m.id, m.content,
              EXISTS (SELECT 1 FROM message h WHERE h.conversation_id = m.conversation_id AND h.id <> m.id)
                  AS has_history
)";

/// Whether a claim left the queue dry, as the `dry` column of
/// [`CLAIM_SQL`] and of the ending-and-claim statement: its snapshot held no
/// queued run besides those it claimed. Read only when it claimed fewer rows
/// than its limit (a full claim answers false at no cost): then one probe of
/// the queued rows, at most `limit + 1`, which in the statement's snapshot
/// still include the ones it claims. A row it could not take (locked by
/// another claimer, a conversation's later turn, a tenant at its cap) is a
/// queued row, so the answer is false; a run queued after the snapshot
/// NOTIFYs `run_enqueued`, which is what the worker waits for instead of
/// claiming again (`worker::dispatcher`).
const DRY_SQL: &str = "CASE WHEN (SELECT count(*) FROM claimed) < {limit}
         THEN (SELECT count(*) FROM (SELECT 1 FROM agent_run WHERE status = 'queued' LIMIT {limit} + 1) q)
              <= (SELECT count(*) FROM claimed)
         ELSE false END";

/// The claim on its own (the dispatcher's), which commits without waiting
/// for its WAL flush (see [`claim`]). One row without a run when it claimed
/// none, so `dry` is always answered.
const CLAIM_SQL: &str = "
WITH RECURSIVE {claim_ctes},
durability AS (
    SELECT set_config('synchronous_commit', 'off', true)
)
SELECT {dry} AS dry, x.*
FROM durability
LEFT JOIN (SELECT c.*, umsg.content, umsg.has_history
           FROM claimed c JOIN umsg ON umsg.id = c.user_message_id) x ON true";

/// queued -> running, for the dispatcher: claims up to `limit` queued runs in
/// one statement (each its conversation's oldest queued turn, fair across
/// tenants), stamping the fence token, the lease and `started_at`, writing
/// seq 3 `run_started` and turning the user message `complete`.
///
/// The claim commits without waiting for its WAL flush (`synchronous_commit`
/// off for its transaction only): the flush is most of a claim's latency and
/// nothing needs it. The run's first durable write flushes the WAL up to and
/// past the claim, and every effect a run has outside the database waits for
/// one (a tool call's `tool_call_started`, and so every model and webhook
/// call, is acknowledged only after its commit; a guest has no other way
/// out). A crash of the database before that write can only forget a claim
/// whose run nobody outside has seen act: the run is queued again as it was
/// (its seq 3 written anew by the next claim), and the worker still running
/// it is fenced out of every write. `tests/faults.rs`
/// (`a_crash_of_the_database_during_a_tool_call_never_forgets_the_claim`)
/// crashes PostgreSQL during a tool call and shows the claim survives and the
/// call is made once. An error for
/// which [`is_running_conflict`] holds is the one-running-per-conversation
/// index turning away a turn the pre-filter could not see: it means "claimed
/// nothing this round", and the caller simply claims again.
pub async fn claim(db: impl PgExecutor<'_>, claim: &Claim<'_>) -> Result<Vec<ClaimedRun>, sqlx::Error> {
    claimed_in(&sqlx::query(&claim_sql(claim, &[])).fetch_all(db).await?)
}

/// The runs in a claim's rows (a row without an id is the one the statement
/// answers when it claimed nothing).
fn claimed_in(rows: &[PgRow]) -> Result<Vec<ClaimedRun>, sqlx::Error> {
    let mut claimed = Vec::with_capacity(rows.len());
    for row in rows {
        if row.try_get::<Option<uuid::Uuid>, _>("id")?.is_some() {
            claimed.push(ClaimedRun::from_row(row)?);
        }
    }
    Ok(claimed)
}

/// A claim's `dry` answer (see [`DRY_SQL`]).
fn dry_in(rows: &[PgRow]) -> Result<bool, sqlx::Error> {
    Ok(match rows.first() {
        Some(row) => row.try_get::<Option<bool>, _>("dry")?.unwrap_or(false),
        None => false,
    })
}

/// [`CLAIM_SQL`] with everything written in: the row limit, the pre-filter,
/// the tenant cap, the lease, the worker's id and the conversations passed
/// over are literals, and the statement has no parameters. With them bound,
/// PostgreSQL's plan cache chose per execution between a plan for the
/// values and a generic one, by costs that swing with the queue's depth: a
/// LIMIT parameter made the generic plan an update by sequential scan, and
/// with the limit written in but the rest bound a drain still planned the
/// claim 6,165 times in 13,518 executions (0.55 ms each, 3.4 s of the
/// server's CPU in 60,000 runs). A statement without parameters has one
/// plan, made once per connection and shape (a process has a handful of
/// shapes: its slot counts) and again only when the tables' statistics
/// change. Every value is the worker's own configuration (numbers, a
/// boolean, the worker id as an escaped string literal) or a conversation
/// id the database reported. Public so its plan can be read (EXPLAIN).
pub fn claim_sql(claim: &Claim<'_>, except: &[uuid::Uuid]) -> Arc<str> {
    write_claim_in(&CLAIM_TEMPLATE, claim, except)
}

/// [`CLAIM_SQL`] with [`CLAIM_CTES`] in it, made once.
static CLAIM_TEMPLATE: LazyLock<String> =
    LazyLock::new(|| CLAIM_SQL.replace("{claim_ctes}", CLAIM_CTES).replace("{dry}", DRY_SQL));

/// `sql` (a template: [`CLAIM_TEMPLATE`] or [`TURNOVER_SQL`]) with the
/// claim's values written in (see [`claim_sql`]). Writing them in scans
/// the template's 10 KB once per value, in the host's turn between two
/// batches; a statement that passes over no conversation is made once per
/// shape and kept ([`WRITTEN_MAX`] shapes at most: a process has one per
/// template and slot count).
fn write_claim_in(sql: &'static str, claim: &Claim<'_>, except: &[uuid::Uuid]) -> Arc<str> {
    if !except.is_empty() || claim.rooms.bind(claim.limit) {
        return write_claim(sql, claim, except).into();
    }
    let key = (
        sql.as_ptr() as usize,
        claim.limit,
        claim.prefilter,
        claim.tenant_max_running,
        claim.lease,
        claim.worker_id.to_string(),
    );
    let mut written = WRITTEN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(text) = written.get(&key) {
        return text.clone();
    }
    if written.len() >= WRITTEN_MAX {
        written.clear();
    }
    let text: Arc<str> = write_claim(sql, claim, except).into();
    written.insert(key, text.clone());
    text
}

/// Claim statements kept by [`write_claim_in`], by template and values.
type WrittenKey = (usize, i64, bool, Option<i64>, Duration, String);
static WRITTEN: LazyLock<Mutex<HashMap<WrittenKey, Arc<str>>>> = LazyLock::new(Default::default);
/// Shapes kept at most; past it the cache starts again.
const WRITTEN_MAX: usize = 64;

/// `sql` with the claim's values written in.
fn write_claim(sql: &str, claim: &Claim<'_>, except: &[uuid::Uuid]) -> String {
    let except = except.iter().map(uuid::Uuid::to_string).collect::<Vec<_>>().join(",");
    sql.replace("{limit}", &claim.limit.max(0).to_string())
        .replace("{prefilter}", if claim.prefilter { "true" } else { "false" })
        .replace("{capped}", if claim.tenant_max_running.is_some() { "true" } else { "false" })
        .replace("{cap}", &claim.tenant_max_running.unwrap_or(0).to_string())
        .replace("{lease}", &format!("{:?}", claim.lease.as_secs_f64()))
        .replace("{run_started}", &sql_string(RUN_STARTED))
        .replace("{except}", &format!("'{{{except}}}'"))
        .replace(
            "{room_slots}",
            &format!("'{{{}}}'", claim.rooms.slots.iter().map(i64::to_string).collect::<Vec<_>>().join(",")),
        )
        .replace("{room_default}", &claim.rooms.default.unwrap_or(claim.limit).max(0).to_string())
        .replace("{worker}", &sql_string(claim.worker_id))
        // Last: nothing is written in after the texts from outside (tenant
        // ids), so none of them can hold a placeholder that is then filled.
        .replace(
            "{room_tenants}",
            &format!(
                "ARRAY[{}]::text[]",
                claim.rooms.tenants.iter().map(|t| sql_string(t)).collect::<Vec<_>>().join(",")
            ),
        )
}

/// `text` as an SQL string literal, whatever the server's
/// `standard_conforming_strings`: an escape string (`E'...'`) with its
/// backslashes and quotes doubled. PostgreSQL text holds no NUL; one is
/// dropped.
fn sql_string(text: &str) -> String {
    format!("E'{}'", text.replace('\0', "").replace('\\', "\\\\").replace('\'', "''"))
}

/// What [`claim_batch`] claimed, and how often the index turned a row away.
#[derive(Debug, Default)]
pub struct Batch {
    pub runs: Vec<ClaimedRun>,
    /// Statements the one-running-per-conversation index refused.
    pub conflicts: u32,
    /// The queue held nothing else to claim ([`DRY_SQL`]).
    pub dry: bool,
}

/// Re-claims after index conflicts in one [`claim_batch`], each passing over
/// one more conversation: bounded, so a claim always ends.
pub const CLAIM_CONFLICTS_MAX: u32 = 8;

/// queued -> running, for the dispatcher: [`claim`] of up to `limit` rows
/// (the caller's free slots) in which a conflict claims fewer rows instead of
/// failing. A conflict is the one-running-per-conversation index turning away
/// a turn the pre-filter could not see (it rolls back the whole statement);
/// the claim is made again at once, passing over that conversation, so its
/// neighbours in the batch are still claimed. The index keeps the last word:
/// nothing here decides that a turn may run. After [`CLAIM_CONFLICTS_MAX`]
/// conflicts (or one whose conversation cannot be read from the error) it
/// claims nothing this round.
pub async fn claim_batch(pool: &PgPool, claim: &Claim<'_>) -> Result<Batch, sqlx::Error> {
    claim_batch_on(&mut *pool.acquire().await?, claim).await
}

/// [`claim_batch`] on a given connection (the dispatcher's own).
pub async fn claim_batch_on(conn: &mut PgConnection, claim: &Claim<'_>) -> Result<Batch, sqlx::Error> {
    let shape = !claim.rooms.bind(claim.limit);
    let (rows, conflicts) = past_conflicts(conn, shape, |except| claim_sql(claim, except), |q| q).await?;
    let rows = rows.unwrap_or_default();
    Ok(Batch { runs: claimed_in(&rows)?, conflicts, dry: dry_in(&rows)? })
}

/// Makes a statement that claims (`sql` for the conversations to pass over,
/// its parameters bound by `bind`) until the one-running-per-conversation
/// index stops refusing it, passing over one more conversation each time:
/// its rows and the conflicts met, or no rows after [`CLAIM_CONFLICTS_MAX`]
/// conflicts (or one whose conversation cannot be read from the error). A
/// statement passing over conversations is a one-off text, not kept
/// prepared. Every attempt on one connection: PostgreSQL reports an error
/// before it aborts the transaction, so an attempt on another connection
/// could still find the rows the failed one locked, and skip them.
async fn past_conflicts(
    conn: &mut PgConnection,
    // Whether the statement is one of the worker's few shapes, kept
    // prepared: not when it names conversations or tenants' rooms of its own.
    shape: bool,
    sql: impl Fn(&[uuid::Uuid]) -> Arc<str>,
    bind: impl for<'q> Fn(PgQuery<'q>) -> PgQuery<'q>,
) -> Result<(Option<Vec<PgRow>>, u32), sqlx::Error> {
    let mut except = Vec::new();
    loop {
        let text = sql(&except);
        match bind(sqlx::query(&text).persistent(shape && except.is_empty())).fetch_all(&mut *conn).await {
            Ok(rows) => return Ok((Some(rows), except.len() as u32)),
            Err(e) if is_running_conflict(&e) => {
                let conflicts = except.len() as u32 + 1;
                match conflict_conversation(&e) {
                    Some(c) if conflicts < CLAIM_CONFLICTS_MAX => except.push(c),
                    _ => return Ok((None, conflicts)),
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// A statement with its parameters.
type PgQuery<'q> = sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>;

/// The conversation a running-conflict names: PostgreSQL's detail reads
/// `Key (conversation_id)=(<uuid>) already exists.`
fn conflict_conversation(e: &sqlx::Error) -> Option<uuid::Uuid> {
    let sqlx::Error::Database(d) = e else { return None };
    let detail = d.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()?.detail()?;
    let (_, rest) = detail.split_once("=(")?;
    let (id, _) = rest.split_once(')')?;
    id.parse().ok()
}

// ---------------------------------------------------------------------------
// running: the holder's lease and its stop flag (no status change).

/// The heartbeat's write (no status change): renews the lease of every run
/// this process holds, each fenced by its token. Returns the runs still held,
/// with their cancel flag; a run missing from the answer was lost (reaped or
/// otherwise ended).
pub async fn heartbeat(
    db: impl PgExecutor<'_>,
    held: &[(RunId, ClaimToken)],
    lease: Duration,
) -> Result<Vec<(RunId, bool)>, sqlx::Error> {
    if held.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<uuid::Uuid> = held.iter().map(|h| h.0 .0).collect();
    let tokens: Vec<uuid::Uuid> = held.iter().map(|h| h.1 .0).collect();
    // A row another transaction holds (an ending, a stop, the reaper) is
    // skipped, not waited for: it keeps its lease this beat and is reported
    // held as the statement's snapshot sees it; the next beat renews it or
    // finds it gone. So a beat never waits on an ending and the two never
    // deadlock, in whatever order the ending takes its rows. `NO KEY UPDATE`
    // is the lock an update of these columns takes.
    sqlx::query_as(
        "WITH h AS (SELECT * FROM unnest($1::uuid[], $2::uuid[]) AS h(id, token)),
         seen AS MATERIALIZED (
             SELECT r.id, r.cancel_requested FROM agent_run r JOIN h ON r.id = h.id AND r.claim_token = h.token
             WHERE r.status = 'running'
         ),
         locked AS MATERIALIZED (
             SELECT r.id FROM agent_run r JOIN h ON r.id = h.id AND r.claim_token = h.token
             WHERE r.status = 'running'
             FOR NO KEY UPDATE OF r SKIP LOCKED
         ),
         beat AS (
             UPDATE agent_run r SET
                 last_heartbeat_at = now(),
                 claim_expires_at  = now() + make_interval(secs => $3)
             FROM locked l
             WHERE r.id = l.id
             RETURNING r.id, r.cancel_requested
         )
         SELECT id, cancel_requested FROM beat
         UNION ALL
         SELECT id, cancel_requested FROM seen WHERE id NOT IN (SELECT id FROM locked)",
    )
    .bind(ids)
    .bind(tokens)
    .bind(lease.as_secs_f64())
    .fetch_all(db)
    .await
}

/// The canceller's read: of the runs a process holds, those with a stop
/// requested (the row is the truth a cancel NOTIFY only hints at).
pub async fn cancel_requested(
    db: impl PgExecutor<'_>,
    held: &[(RunId, ClaimToken)],
) -> Result<Vec<RunId>, sqlx::Error> {
    let ids: Vec<uuid::Uuid> = held.iter().map(|(r, _)| r.0).collect();
    let tokens: Vec<uuid::Uuid> = held.iter().map(|(_, t)| t.0).collect();
    sqlx::query_scalar(
        "SELECT r.id FROM agent_run r JOIN unnest($1::uuid[], $2::uuid[]) AS h(id, token)
             ON r.id = h.id AND r.claim_token = h.token
         WHERE r.status = 'running' AND r.cancel_requested",
    )
    .bind(ids)
    .bind(tokens)
    .fetch_all(db)
    .await
}

// ---------------------------------------------------------------------------
// running -> terminal: the holder's finish, the backstop, the reaper.

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
static FINISH_SQL: LazyLock<String> = LazyLock::new(|| {
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
static TURNOVER_SQL: LazyLock<String> = LazyLock::new(|| {
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
const FINISH_CTES: &str = "e AS (
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
fn bind_endings<'q>(query: PgQuery<'q>, endings: &[Ending]) -> PgQuery<'q> {
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
async fn requeue(
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

// ---------------------------------------------------------------------------
// Stops: queued -> cancelled outright; running flagged for its holder.

/// What `cancel` found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cancelled {
    /// Queued: cancelled outright, its message handed back as a draft.
    Queued,
    /// Running: flagged and woken; the holder finalizes it `cancelled`.
    /// `first`: this cancel set the flag (a repeat re-flags and re-wakes).
    Flagged { first: bool },
    /// Waiting: cancelled outright, its streamed text kept as a partial answer.
    Waiting,
    /// Already terminal: nothing changed (its status and cancel flag).
    Terminal(RunStatus, bool),
}

/// A user message handed back by a stop.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Draft {
    pub message_id: MessageId,
    pub content: String,
}

/// What a conversation stop did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Stopped {
    /// Queued runs, cancelled outright.
    pub cancelled: Vec<RunId>,
    /// Running runs, flagged: their holders are ending them.
    pub cancelling: Vec<RunId>,
    /// The cancelled runs' user messages, in conversation order.
    pub drafts: Vec<Draft>,
}

/// A run of one owner as a transition reads it, locked `FOR UPDATE` until
/// the caller's transaction ends.
#[derive(Debug, Clone, sqlx::FromRow)]
struct LockedRun {
    status: RunStatus,
    conversation_id: ConversationId,
    user_message_id: MessageId,
    cancel_requested: bool,
}

/// Locks run `run` of `owner_id`; `None` when missing or someone else's.
async fn lock_owned_run(
    tx: &mut Transaction<'_, Postgres>,
    run: RunId,
    owner_id: &str,
) -> Result<Option<LockedRun>, sqlx::Error> {
    sqlx::query_as(
        "SELECT status, conversation_id, user_message_id, cancel_requested FROM agent_run
         WHERE id = $1 AND owner_id = $2 FOR UPDATE",
    )
    .bind(run)
    .bind(owner_id)
    .fetch_optional(&mut **tx)
    .await
}

/// For `POST /v1/runs/{id}/cancel`: cancels one run of `owner_id`; `None`
/// when missing or someone else's. queued -> cancelled outright (with its
/// `complete` and its message handed back as a draft); running: the stop
/// flag and the NOTIFY, and its holder ends it cancelled. Idempotent: a
/// second cancel of a running run re-flags and re-wakes.
pub async fn cancel(pool: &PgPool, run: RunId, owner_id: &str) -> Result<Option<Cancelled>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let Some(locked) = lock_owned_run(&mut tx, run, owner_id).await? else {
        return Ok(None);
    };
    let done = match locked.status {
        RunStatus::Queued => {
            cancel_queued(&mut tx, &[run]).await?;
            // It may have been its conversation's head: the next turn is free now.
            notify(&mut *tx, RUN_ENQUEUED, &locked.conversation_id.to_string()).await?;
            Cancelled::Queued
        }
        RunStatus::Running => {
            flag(&mut tx, &[run]).await?;
            Cancelled::Flagged { first: !locked.cancel_requested }
        }
        RunStatus::Waiting => {
            cancel_waiting(&mut tx, run).await?;
            notify(&mut *tx, RUN_ENQUEUED, &locked.conversation_id.to_string()).await?;
            Cancelled::Waiting
        }
        terminal => Cancelled::Terminal(terminal, locked.cancel_requested),
    };
    tx.commit().await?;
    Ok(Some(done))
}

/// For `POST /v1/conversations/{id}/stop`: stops a conversation of
/// `owner_id` in ONE transaction; `None` when missing or someone else's.
/// Every queued and running run is locked `FOR UPDATE`, queued ones first:
/// once they are locked no claim can take one (the claim skips locked rows,
/// and its head-of-conversation check still sees them queued), so the
/// terminal wake of a running turn that finishes mid-stop finds nothing to
/// start. queued -> cancelled with their `complete` events and drafts;
/// running ones are flagged and woken.
pub async fn stop_conversation(
    pool: &PgPool,
    conversation: ConversationId,
    owner_id: &str,
) -> Result<Option<Stopped>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    if !conversations::owned(&mut *tx, conversation, owner_id).await? {
        return Ok(None);
    }
    let stopped = stop_in(&mut tx, conversation).await?;
    tx.commit().await?;
    Ok(Some(stopped))
}

/// The body of [`stop_conversation`], in the caller's transaction.
async fn stop_in(tx: &mut Transaction<'_, Postgres>, conversation: ConversationId) -> Result<Stopped, sqlx::Error> {
    // Rows are locked in the sorted order (LockRows sits above the Sort).
    let active: Vec<(RunId, RunStatus)> = sqlx::query_as(
        "SELECT id, status FROM agent_run
         WHERE conversation_id = $1 AND status IN ('queued', 'running', 'waiting')
         ORDER BY status <> 'queued', queue_pos
         FOR UPDATE",
    )
    .bind(conversation)
    .fetch_all(&mut **tx)
    .await?;
    let of = |status: RunStatus| active.iter().filter(move |(_, s)| *s == status).map(|(id, _)| *id);
    let (queued, running, waiting): (Vec<RunId>, Vec<RunId>, Vec<RunId>) =
        (of(RunStatus::Queued).collect(), of(RunStatus::Running).collect(), of(RunStatus::Waiting).collect());
    let drafts = cancel_queued(tx, &queued).await?;
    flag(tx, &running).await?;
    for run in &waiting {
        cancel_waiting(tx, *run).await?;
    }
    let cancelled = queued.into_iter().chain(waiting).collect();
    Ok(Stopped { cancelled, cancelling: running, drafts })
}

// ---------------------------------------------------------------------------
// (none) -> queued, with a strategy for a busy conversation.

/// What an enqueue does when its conversation already has an active turn
/// (queued, running or waiting).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Busy {
    /// Queue behind it (the default).
    #[default]
    Enqueue,
    /// Refuse: nothing is enqueued.
    Reject,
    /// Stop it as a conversation stop does (running turns flagged, their
    /// partial text kept; queued and waiting ones cancelled) and run this
    /// one next: in one transaction, so nothing else starts in between.
    Interrupt,
}

#[derive(Debug, thiserror::Error)]
pub enum StrategyError {
    /// `reject`, and the conversation's active turn is this run.
    #[error("the conversation has an active turn, run {0}")]
    Busy(RunId),
    #[error(transparent)]
    Enqueue(#[from] super::enqueue::EnqueueError),
    /// The tenant has `max` queued runs, its quota; nothing was written.
    #[error("the tenant has {max} queued runs, its quota")]
    QueueFull { max: u32 },
}

impl From<sqlx::Error> for StrategyError {
    fn from(e: sqlx::Error) -> Self {
        StrategyError::Enqueue(e.into())
    }
}

/// Enqueue (see [`super::enqueue::enqueue`]) with a strategy for a busy
/// conversation. `reject` and `interrupt` lock the conversation row first, so
/// two of them serialise and an enqueue racing them queues behind. With
/// `eager`, the run may start in the enqueue's statement
/// ([`super::enqueue::Eager`]): then it comes back as claimed.
pub async fn enqueue_with(
    pool: &PgPool,
    new: &super::enqueue::NewRun<'_>,
    strategy: Busy,
    tenant_max_queued: Option<u32>,
    eager: Option<&super::enqueue::Eager<'_>>,
) -> Result<(Enqueued, Option<ClaimedRun>), StrategyError> {
    // Queueing behind a busy turn with no quota to count needs no lock and no
    // read first: the enqueue's one statement is the whole transaction (a
    // used idempotency key fails it on its index, as below).
    if strategy == Busy::Enqueue && tenant_max_queued.is_none() {
        return Ok(match eager {
            Some(eager) => super::enqueue::enqueue_eager(pool, new, eager).await?,
            None => (super::enqueue::enqueue(pool, new).await?, None),
        });
    }
    let mut tx = pool.begin().await?;
    // A retry of a request already enqueued is answered as its first was
    // (the enqueue below hits the key): the strategy must not refuse or
    // stop its own run.
    let mut strategy = strategy;
    let mut replay = false;
    if let Some(key) = new.idempotency_key {
        let used: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM agent_run WHERE owner_id = $1 AND idempotency_key = $2)")
                .bind(&new.owner.user_id)
                .bind(key)
                .fetch_one(&mut *tx)
                .await?;
        if used {
            strategy = Busy::Enqueue;
        }
        replay = used;
    }
    // The tenant's queue lock first, before any row lock (the Reject and
    // Interrupt paths lock the conversation; a retry takes it first too), so
    // every path takes the two in one order.
    let quota = tenant_max_queued.filter(|_| !replay);
    if quota.is_some() {
        lock_tenant_queue(&mut tx, &new.owner.tenant_id).await?;
    }
    if let (Some(conversation), Busy::Reject | Busy::Interrupt) = (new.conversation_id, strategy) {
        let owned: Option<bool> = sqlx::query_scalar("SELECT owner_id = $2 FROM conversation WHERE id = $1 FOR UPDATE")
            .bind(conversation)
            .bind(&new.owner.user_id)
            .fetch_optional(&mut *tx)
            .await?;
        if owned != Some(true) {
            return Err(super::enqueue::EnqueueError::ConversationNotFound(conversation).into());
        }
        if strategy == Busy::Reject {
            let active: Option<RunId> = sqlx::query_scalar(
                "SELECT id FROM agent_run WHERE conversation_id = $1 AND status IN ('queued', 'running', 'waiting')
                 ORDER BY queue_pos LIMIT 1",
            )
            .bind(conversation)
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(run) = active {
                return Err(StrategyError::Busy(run));
            }
        } else {
            stop_in(&mut tx, conversation).await?;
        }
    }
    // The tenant's queue quota: counted under the per-tenant lock taken
    // above and held to the commit, so concurrent enqueues (in any process)
    // cannot both take the last place; a refusal rolls back, writing
    // nothing. A replay is answered as its first request was.
    if let Some(max) = quota {
        if !queue_has_room(&mut tx, &new.owner.tenant_id, max).await? {
            return Err(StrategyError::QueueFull { max });
        }
    }
    let enqueued = match eager {
        Some(eager) => super::enqueue::enqueue_eager_in(&mut tx, new, eager).await?,
        None => (super::enqueue::enqueue_in(&mut tx, new).await?, None),
    };
    tx.commit().await?;
    Ok(enqueued)
}

/// Takes the tenant's queue lock (to the commit): the queue quota is
/// counted under it.
async fn lock_tenant_queue(tx: &mut Transaction<'_, Postgres>, tenant: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('agent_run.queued:' || $1, 0))")
        .bind(tenant)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Whether the tenant has fewer than `max` queued runs (ask under its queue lock).
async fn queue_has_room(tx: &mut Transaction<'_, Postgres>, tenant: &str, max: u32) -> Result<bool, sqlx::Error> {
    let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM agent_run WHERE tenant_id = $1 AND status = 'queued'")
        .bind(tenant)
        .fetch_one(&mut **tx)
        .await?;
    Ok(queued < i64::from(max))
}

/// queued -> cancelled, for [`cancel`] and [`stop_conversation`]: status,
/// `finished_at`, the `complete` event, the draft message, tails told; in the
/// caller's transaction, which holds the rows' locks.
async fn cancel_queued(tx: &mut Transaction<'_, Postgres>, runs: &[RunId]) -> Result<Vec<Draft>, sqlx::Error> {
    if runs.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<uuid::Uuid> = runs.iter().map(|r| r.0).collect();
    // A queued run that had started (handed back, or decided after a wait)
    // keeps the text it streamed as a partial answer, as a running one does.
    let started: Vec<(RunId, ConversationId)> = sqlx::query_as(
        "SELECT id, conversation_id FROM agent_run WHERE id = ANY($1) AND status = 'queued' AND attempt > 1",
    )
    .bind(&ids)
    .fetch_all(&mut **tx)
    .await?;
    for (run, conversation) in started {
        keep_partial(tx, run, conversation).await?;
    }
    // No one else writes a queued run's journal, so max(seq)+1 is safe.
    let drafts: Vec<(MessageId, String)> = sqlx::query_as(
        "WITH r AS (
             UPDATE agent_run SET status = 'cancelled', cancel_requested = true, finished_at = clock_timestamp()
             WHERE id = ANY($1) AND status = 'queued'
             RETURNING id, user_message_id, queue_pos, attempt
         ),
         ev AS (
             INSERT INTO run_event (run_id, seq, type, payload)
             SELECT r.id, (SELECT coalesce(max(seq), 0) + 1 FROM run_event e WHERE e.run_id = r.id), $2, $3
             FROM r
         ),
         -- A handed-back run (attempt > 1) had started: its message stays
         -- complete and is no draft.
         m AS (
             UPDATE message SET status = $4 FROM r
             WHERE message.id = r.user_message_id AND r.attempt = 1
             RETURNING message.id, message.content, r.queue_pos
         )
         SELECT id, content FROM m ORDER BY queue_pos",
    )
    .bind(&ids)
    .bind(COMPLETE)
    .bind(complete_payload(RunStatus::Cancelled, None))
    .bind(MessageStatus::Draft)
    .fetch_all(&mut **tx)
    .await?;
    for run in runs {
        notify(&mut **tx, &events_channel(*run), COMPLETE_PAYLOAD).await?;
    }
    Ok(drafts.into_iter().map(|(message_id, content)| Draft { message_id, content }).collect())
}

/// A run nobody holds, ended by a stop: the text it streamed (as a client
/// holds it, rollbacks applied) kept as its partial answer, if any.
async fn keep_partial(
    tx: &mut Transaction<'_, Postgres>,
    run: RunId,
    conversation: ConversationId,
) -> Result<(), sqlx::Error> {
    let text: String = super::calls::journaled(&mut **tx, run).await?.deltas.into_iter().map(|(_, t)| t).collect();
    if !text.is_empty() {
        sqlx::query(
            "INSERT INTO message (id, conversation_id, run_id, role, content, status)
             VALUES ($1, $2, $3, 'assistant', $4, $5)",
        )
        .bind(MessageId::new())
        .bind(conversation)
        .bind(run)
        .bind(&text)
        .bind(MessageStatus::Partial)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

/// waiting -> cancelled, for [`cancel`] and [`stop_conversation`], in the
/// caller's transaction (which holds the row's lock; no one holds the run):
/// status, `finished_at`, the `complete` event, the text it had streamed kept
/// as a partial answer (as a client holds it, rollbacks applied), tails told.
async fn cancel_waiting(tx: &mut Transaction<'_, Postgres>, run: RunId) -> Result<(), sqlx::Error> {
    let conversation: ConversationId = sqlx::query_scalar(
        "UPDATE agent_run SET status = 'cancelled', cancel_requested = true, finished_at = clock_timestamp()
         WHERE id = $1 AND status = 'waiting' RETURNING conversation_id",
    )
    .bind(run)
    .fetch_one(&mut **tx)
    .await?;
    keep_partial(tx, run, conversation).await?;
    write_complete(&mut **tx, run, RunStatus::Cancelled, None).await?;
    notify(&mut **tx, &events_channel(run), COMPLETE_PAYLOAD).await
}

/// The stop flag (no status change): flags running runs and wakes their
/// holders over [`RUN_CANCEL`], in the caller's transaction. The holder's
/// heartbeat and canceller re-read the flag in case the NOTIFY is lost.
async fn flag(tx: &mut Transaction<'_, Postgres>, runs: &[RunId]) -> Result<(), sqlx::Error> {
    if runs.is_empty() {
        return Ok(());
    }
    let ids: Vec<uuid::Uuid> = runs.iter().map(|r| r.0).collect();
    sqlx::query(
        "WITH f AS (UPDATE agent_run SET cancel_requested = true WHERE id = ANY($1) AND status = 'running' RETURNING id)
         SELECT pg_notify($2, id::text) FROM f",
    )
    .bind(&ids)
    .bind(RUN_CANCEL)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

// ---------------------------------------------------------------------------
// (none) -> queued again, on purpose: retry.

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
