//! The journal's SQL: the claim holder's fenced appends, reads from a cursor
//! for tails, the `complete` a finalizer other than the holder writes, the
//! terminal state a tail synthesizes an ending from, and retention's trim.
//! Called by the journal writer (appends), the HTTP tail (reads), the
//! lifecycle (the finalizers' `complete`) and the retention loop (trim).
//!
//! seq ownership: enqueue writes 1-2 (`enqueue::journal_queued`), the
//! claim 3, the claim holder 4..n behind the fence; a finalizer other than the
//! holder takes max(seq)+1 only once the fence has shut the holder out.

use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use sqlx::PgExecutor;

use super::events::{complete_payload, COMPLETE};
use super::notify::{RUN_EVENTS, RUN_EVENTS_ALL, RUN_EVENTS_IDS_MAX};
use super::{ClaimToken, RunId, RunStatus};

/// One journal row, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow, schemars::JsonSchema)]
pub struct Event {
    pub seq: i32,
    #[sqlx(rename = "type")]
    #[serde(rename = "type")]
    pub kind: String,
    pub payload: Value,
}

/// Appends events `first_seq..` to a run's journal, fenced: written only while
/// the run still names this claim token and is running. The run row is taken
/// `FOR SHARE`, so the append serialises with any terminal write and a
/// finalizer's max(seq)+1 never collides with it. All or nothing: a tripped
/// fence inserts no row and, with `notify`, announces nothing (the NOTIFY
/// rides the same statement). Returns false when fenced.
pub async fn append_events(
    db: impl PgExecutor<'_>,
    run: RunId,
    token: ClaimToken,
    first_seq: i32,
    events: &[(&str, Value)],
    notify: Option<&str>,
) -> Result<bool, sqlx::Error> {
    append_numbered(db, run, token, first_seq, events, &vec![None; events.len()], notify).await
}

/// [`append_events`] with each event's append number (`run_event.op`: which
/// host call of the run it followed; see `migrations/0005_durable.sql`).
pub async fn append_numbered(
    db: impl PgExecutor<'_>,
    run: RunId,
    token: ClaimToken,
    first_seq: i32,
    events: &[(&str, Value)],
    ops: &[Option<i64>],
    notify: Option<&str>,
) -> Result<bool, sqlx::Error> {
    debug_assert_eq!(events.len(), ops.len());
    let types: Vec<&str> = events.iter().map(|e| e.0).collect();
    let payloads: Vec<&Value> = events.iter().map(|e| &e.1).collect();
    let (inserted, _notified): (i64, Option<i32>) = sqlx::query_as(
        "WITH ins AS (
             INSERT INTO run_event (run_id, seq, type, payload, op)
             SELECT $1, $3 + e.ord::int - 1, e.type, e.payload, e.op
             FROM (SELECT 1 FROM agent_run
                   WHERE id = $1 AND claim_token = $2 AND status = 'running'   -- the fence
                   FOR SHARE) AS fence,
                  unnest($4::text[], $5::jsonb[], $7::bigint[]) WITH ORDINALITY AS e(type, payload, op, ord)
             RETURNING seq),
         n AS (SELECT count(*) AS n, max(seq) AS last FROM ins)
         SELECT n.n, CASE WHEN n.n > 0 AND $6::text IS NOT NULL
                          THEN (SELECT 1 FROM pg_notify($6, n.last::text)) END
         FROM n",
    )
    .bind(run)
    .bind(token)
    .bind(first_seq)
    .bind(types)
    .bind(payloads)
    .bind(notify)
    .bind(ops)
    .fetch_one(db)
    .await?;
    Ok(inserted as usize == events.len())
}

/// One run's part of a group commit: its events `first_seq..` (kind,
/// payload, append number), fenced by its own claim token.
#[derive(Debug, Clone, Copy)]
pub struct GroupPart<'a> {
    pub run: RunId,
    pub token: ClaimToken,
    pub first_seq: i32,
    pub events: &'a [(String, Value, Option<i64>)],
}

/// What one group commit wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupWritten {
    /// The runs whose rows were written (all of each run's rows); a run of
    /// the group not named here was fenced and wrote nothing.
    pub runs: Vec<RunId>,
    /// Whether the statement NOTIFYed [`RUN_EVENTS`] (once, when it wrote anything).
    pub notified: bool,
}

/// The journal group commit: the events of many runs in ONE statement (so
/// one commit, and at most one NOTIFY), each run's rows fenced by its own
/// claim token exactly as [`append_numbered`] fences one run's: a run whose
/// token no longer matches (or that is no longer running) inserts none of
/// its rows and is left out of [`GroupWritten::runs`], while its neighbours'
/// rows are written. The fenced runs' rows are taken `FOR SHARE` (in id
/// order), so each run's part serialises with its terminal writes.
///
/// The one NOTIFY on [`RUN_EVENTS`] lists the runs written (32 hex digits
/// each, comma separated), or is [`RUN_EVENTS_ALL`] past
/// [`RUN_EVENTS_IDS_MAX`] runs; it fires on commit, or never.
///
/// A unique violation on `run_event_pkey` (a part was committed by an
/// earlier attempt whose answer was lost) fails the whole statement: the
/// caller then writes the parts one by one ([`append_numbered`]), which
/// tells which part it was.
pub async fn append_group(db: impl PgExecutor<'_>, parts: &[GroupPart<'_>]) -> Result<GroupWritten, sqlx::Error> {
    let rows: usize = parts.iter().map(|p| p.events.len()).sum();
    let mut fence_runs = Vec::with_capacity(parts.len());
    let mut fence_tokens = Vec::with_capacity(parts.len());
    let (mut runs, mut seqs, mut types, mut payloads, mut ops) = (
        Vec::with_capacity(rows),
        Vec::with_capacity(rows),
        Vec::with_capacity(rows),
        Vec::with_capacity(rows),
        Vec::with_capacity(rows),
    );
    for p in parts {
        fence_runs.push(p.run.0);
        fence_tokens.push(p.token.0);
        for (i, (kind, payload, op)) in p.events.iter().enumerate() {
            runs.push(p.run.0);
            seqs.push(p.first_seq + i as i32);
            types.push(kind.as_str());
            payloads.push(payload);
            ops.push(*op);
        }
    }
    let (written, notified): (Vec<uuid::Uuid>, Option<i32>) = sqlx::query_as(
        "WITH fence AS (
             SELECT r.id FROM agent_run r
             JOIN unnest($1::uuid[], $2::uuid[]) AS f(id, token)
               ON r.id = f.id AND r.claim_token = f.token      -- the fence, per run
             WHERE r.status = 'running'
             ORDER BY r.id
             FOR SHARE OF r),
         ins AS (
             INSERT INTO run_event (run_id, seq, type, payload, op)
             SELECT e.run_id, e.seq, e.type, e.payload, e.op
             FROM unnest($3::uuid[], $4::int[], $5::text[], $6::jsonb[], $7::bigint[])
                  AS e(run_id, seq, type, payload, op)
             JOIN fence ON fence.id = e.run_id
             RETURNING run_id),
         written AS (SELECT DISTINCT run_id FROM ins),
         payload AS (
             SELECT CASE WHEN count(*) > $9 THEN $10
                         ELSE string_agg(replace(run_id::text, '-', ''), ',') END AS p
             FROM written)
         SELECT coalesce((SELECT array_agg(run_id) FROM written), '{}'::uuid[]),
                (SELECT CASE WHEN p IS NOT NULL THEN (SELECT 1 FROM pg_notify($8, p)) END FROM payload)",
    )
    .bind(fence_runs)
    .bind(fence_tokens)
    .bind(runs)
    .bind(seqs)
    .bind(types)
    .bind(payloads)
    .bind(ops)
    .bind(RUN_EVENTS)
    .bind(RUN_EVENTS_IDS_MAX as i64)
    .bind(RUN_EVENTS_ALL)
    .fetch_one(db)
    .await?;
    Ok(GroupWritten { runs: written.into_iter().map(RunId).collect(), notified: notified.is_some() })
}

/// Journal rows of a run after `after_seq`, in order, at most `limit`.
pub async fn events_after(
    db: impl PgExecutor<'_>,
    run: RunId,
    after_seq: i32,
    limit: i64,
) -> Result<Vec<Event>, sqlx::Error> {
    sqlx::query_as("SELECT seq, type, payload FROM run_event WHERE run_id = $1 AND seq > $2 ORDER BY seq LIMIT $3")
        .bind(run)
        .bind(after_seq)
        .bind(limit)
        .fetch_all(db)
        .await
}

/// One run's bounded page (`seq, type, payload, cut`, unordered) as SQL: its
/// rows after `$after`, at most `$limit`, and as many more as fit in
/// `$bytes` of payload past the first (always the first: a reader moves on);
/// `cut` says rows were left for the bytes. The arguments are SQL
/// expressions: parameters for one run, a lateral join's columns for many.
macro_rules! bounded_page_sql {
    ($run:literal, $after:literal, $limit:literal, $bytes:literal) => {
        concat!(
            "SELECT seq, type, payload, cut FROM (
                 SELECT seq, type, payload, before, bool_or(before >= ",
            $bytes,
            ") OVER () AS cut
                 FROM (
                     SELECT seq, type, payload,
                            coalesce(sum(octet_length(payload::text)) OVER (ORDER BY seq
                                ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS before
                     FROM (SELECT seq, type, payload FROM run_event
                           WHERE run_id = ",
            $run,
            " AND seq > ",
            $after,
            " ORDER BY seq LIMIT ",
            $limit,
            ") r
                 ) w
             ) x
             WHERE before < ",
            $bytes,
            " OR before = 0"
        )
    };
}

/// Journal rows of a run after `after_seq`, in order, at most `limit` and
/// at most about `bytes_max` bytes of payload (always the first row, however
/// large: a reader moves on), and whether rows were left for the bytes: a
/// tail's one read of a long journal holds a bounded amount of memory.
pub async fn events_after_bounded(
    db: impl PgExecutor<'_>,
    run: RunId,
    after_seq: i32,
    limit: i64,
    bytes_max: i64,
) -> Result<(Vec<Event>, bool), sqlx::Error> {
    let rows: Vec<(i32, String, Value, bool)> =
        sqlx::query_as(concat!(bounded_page_sql!("$1", "$2", "$3", "$4"), " ORDER BY seq"))
            .bind(run)
            .bind(after_seq)
            .bind(limit)
            .bind(bytes_max)
            .fetch_all(db)
            .await?;
    let cut = rows.first().is_some_and(|r| r.3);
    Ok((rows.into_iter().map(|(seq, kind, payload, _)| Event { seq, kind, payload }).collect(), cut))
}

/// What one statement of [`pages_after`] found for one run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Page {
    /// Its events after the cursor, bounded as [`events_after_bounded`]'s.
    pub events: Vec<Event>,
    /// The byte bound cut the page short.
    pub cut: bool,
    /// The run is terminal: its status, error and last seq (as
    /// [`terminal_state`]), read in the same snapshot as `events`.
    pub ended: Option<(RunStatus, Option<String>, i32)>,
}

/// One run's page asked of [`pages_after`]: its events after `after`, at
/// most `events_max` of them and `bytes_max` payload bytes past the first.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PageAsk {
    pub run: RunId,
    pub after: i32,
    pub events_max: i64,
    pub bytes_max: i64,
}

/// [`events_after_bounded`] and [`terminal_state`] for many runs in one
/// statement; the answer has one page per ask, in order. The live feeds of
/// a process read through this, so a wake of a thousand runs costs a
/// statement, not a thousand (and a thousand more asking whether each run
/// ended).
pub async fn pages_after(db: impl PgExecutor<'_>, asks: &[PageAsk]) -> Result<Vec<Page>, sqlx::Error> {
    let ids: Vec<RunId> = asks.iter().map(|a| a.run).collect();
    let heads: Vec<i32> = asks.iter().map(|a| a.after).collect();
    let limits: Vec<i64> = asks.iter().map(|a| a.events_max).collect();
    let bytes: Vec<i64> = asks.iter().map(|a| a.bytes_max).collect();
    type Row =
        (i64, Option<i32>, Option<String>, Option<Value>, Option<bool>, Option<RunStatus>, Option<String>, Option<i32>);
    let rows: Vec<Row> = sqlx::query_as(concat!(
        "SELECT c.i, e.seq, e.type, e.payload, e.cut, t.status, t.error, t.last_seq
         FROM unnest($1::uuid[], $2::int4[], $3::int8[], $4::int8[]) WITH ORDINALITY AS c(run_id, head, lim, bytes_max, i)
         LEFT JOIN LATERAL (",
        bounded_page_sql!("c.run_id", "c.head", "c.lim", "c.bytes_max"),
        ") e ON true
         LEFT JOIN LATERAL (
             SELECT r.status, r.error,
                    coalesce((SELECT max(seq) FROM run_event m WHERE m.run_id = r.id), 0) AS last_seq
             FROM agent_run r
             WHERE r.id = c.run_id AND r.status IN ('completed', 'failed', 'cancelled')
         ) t ON true
         ORDER BY c.i, e.seq"
    ))
    .bind(&ids)
    .bind(&heads)
    .bind(&limits)
    .bind(&bytes)
    .fetch_all(db)
    .await?;
    let mut pages = vec![Page::default(); asks.len()];
    for (i, seq, kind, payload, cut, status, error, last_seq) in rows {
        let Some(page) = usize::try_from(i - 1).ok().and_then(|i| pages.get_mut(i)) else {
            continue;
        };
        if let (Some(status), Some(last)) = (status, last_seq) {
            page.ended = Some((status, error, last));
        }
        if let (Some(seq), Some(kind), Some(payload)) = (seq, kind, payload) {
            page.cut |= cut.unwrap_or(false);
            page.events.push(Event { seq, kind, payload });
        }
    }
    Ok(pages)
}

/// The `complete` event written by a finalizer other than the claim holder
/// (the reaper), in the transaction that flipped the status: seq is
/// max(seq)+1, read in its own statement after the status flip locked the
/// row, so it sees every append that committed before the fence shut (an
/// append in flight holds the row `FOR SHARE`, so the flip waited for it).
pub(crate) async fn write_complete(
    db: impl PgExecutor<'_>,
    run: RunId,
    status: RunStatus,
    error: Option<&str>,
) -> Result<(), sqlx::Error> {
    write_event(db, run, COMPLETE, &complete_payload(status, error)).await
}

/// One event at max(seq)+1, for a writer other than a claim holder (a
/// finalizer, a decision on a waiting run): only while no holder can
/// append, i.e. with the run row locked and not running.
pub(crate) async fn write_event(
    db: impl PgExecutor<'_>,
    run: RunId,
    kind: &str,
    payload: &Value,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO run_event (run_id, seq, type, payload)
         SELECT $1, coalesce(max(seq), 0) + 1, $2, $3 FROM run_event WHERE run_id = $1",
    )
    .bind(run)
    .bind(kind)
    .bind(payload)
    .execute(db)
    .await?;
    Ok(())
}

/// A terminal run's (status, error, last seq in its journal); `None` while
/// the run is not terminal. A tail synthesizes the `complete` from this when
/// the journal lacks it.
pub async fn terminal_state(
    db: impl PgExecutor<'_>,
    id: RunId,
) -> Result<Option<(RunStatus, Option<String>, i32)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT r.status, r.error, coalesce((SELECT max(seq) FROM run_event e WHERE e.run_id = r.id), 0)
         FROM agent_run r WHERE r.id = $1 AND r.status IN ('completed', 'failed', 'cancelled')",
    )
    .bind(id)
    .fetch_optional(db)
    .await
}

/// Retention: the journal is a delivery buffer. Deletes the events of up to
/// `batch_runs` runs terminal for longer than `older_than`, nulls their
/// request snapshots (the transcript in `message` stays) and marks them
/// trimmed. Returns how many runs it trimmed; call again until it returns
/// less than `batch_runs`.
pub async fn trim_terminal(db: impl PgExecutor<'_>, older_than: Duration, batch_runs: i64) -> Result<u64, sqlx::Error> {
    let trimmed: i64 = sqlx::query_scalar(
        "WITH victims AS (
             SELECT id FROM agent_run
             WHERE finished_at < now() - make_interval(secs => $1) AND trimmed_at IS NULL
             ORDER BY finished_at LIMIT $2
             FOR UPDATE SKIP LOCKED),
         del AS (DELETE FROM run_event e USING victims v WHERE e.run_id = v.id),
         calls AS (DELETE FROM run_call c USING victims v WHERE c.run_id = v.id),
         susp AS (DELETE FROM run_suspension s USING victims v WHERE s.run_id = v.id),
         push AS (DELETE FROM a2a_push_config p USING victims v WHERE p.run_id = v.id),
         upd AS (UPDATE agent_run r SET request = NULL, trimmed_at = now() FROM victims v WHERE r.id = v.id RETURNING r.id)
         SELECT count(*) FROM upd",
    )
    .bind(older_than.as_secs_f64())
    .bind(batch_runs)
    .fetch_one(db)
    .await?;
    Ok(trimmed as u64)
}
