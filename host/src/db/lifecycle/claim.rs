//! queued -> running: the claim; and the holder's lease and stop flag (no status change).

use super::*;

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
pub(super) const CLAIM_CTES: &str = "
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
              extract(epoch FROM now() - r.created_at)::float8 AS waited_s, r.attempt, r.waits, r.seed,
              r.forked_from IS NOT NULL AS forked, r.trace_id, r.trace_span_id
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
pub(super) const DRY_SQL: &str = "CASE WHEN (SELECT count(*) FROM claimed) < {limit}
         THEN (SELECT count(*) FROM (SELECT 1 FROM agent_run WHERE status = 'queued' LIMIT {limit} + 1) q)
              <= (SELECT count(*) FROM claimed)
         ELSE false END";

/// The claim on its own (the dispatcher's), which commits without waiting
/// for its WAL flush (see [`claim`]). One row without a run when it claimed
/// none, so `dry` is always answered.
pub(super) const CLAIM_SQL: &str = "
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
pub(super) fn claimed_in(rows: &[PgRow]) -> Result<Vec<ClaimedRun>, sqlx::Error> {
    let mut claimed = Vec::with_capacity(rows.len());
    for row in rows {
        if row.try_get::<Option<uuid::Uuid>, _>("id")?.is_some() {
            claimed.push(ClaimedRun::from_row(row)?);
        }
    }
    Ok(claimed)
}

/// A claim's `dry` answer (see [`DRY_SQL`]).
pub(super) fn dry_in(rows: &[PgRow]) -> Result<bool, sqlx::Error> {
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
pub(super) static CLAIM_TEMPLATE: LazyLock<String> =
    LazyLock::new(|| CLAIM_SQL.replace("{claim_ctes}", CLAIM_CTES).replace("{dry}", DRY_SQL));

/// `sql` (a template: [`CLAIM_TEMPLATE`] or [`TURNOVER_SQL`]) with the
/// claim's values written in (see [`claim_sql`]). Writing them in scans
/// the template's 10 KB once per value, in the host's turn between two
/// batches; a statement that passes over no conversation is made once per
/// shape and kept ([`WRITTEN_MAX`] shapes at most: a process has one per
/// template and slot count).
pub(super) fn write_claim_in(sql: &'static str, claim: &Claim<'_>, except: &[uuid::Uuid]) -> Arc<str> {
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
pub(super) static WRITTEN: LazyLock<Mutex<HashMap<WrittenKey, Arc<str>>>> = LazyLock::new(Default::default);
/// Shapes kept at most; past it the cache starts again.
pub(super) const WRITTEN_MAX: usize = 64;

/// `sql` with the claim's values written in.
pub(super) fn write_claim(sql: &str, claim: &Claim<'_>, except: &[uuid::Uuid]) -> String {
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
/// dropped ([`crate::text::without_nul`]).
pub(super) fn sql_string(text: &str) -> String {
    format!("E'{}'", crate::text::without_nul(text).replace('\\', "\\\\").replace('\'', "''"))
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
pub(super) async fn past_conflicts(
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
pub(super) type PgQuery<'q> = sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>;

/// The conversation a running-conflict names: PostgreSQL's detail reads
/// `Key (conversation_id)=(<uuid>) already exists.`
pub(super) fn conflict_conversation(e: &sqlx::Error) -> Option<uuid::Uuid> {
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
