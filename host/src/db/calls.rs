//! The recorded call log of resumable runs (`run_call`): every
//! nondeterministic host call in order, written by the claim holder behind the
//! same fence as the journal, read back by the process that resumes the run.
//! Called by `run::record` only (and retention's trim, in [`super::journal`]).

use sqlx::PgExecutor;

use super::{ClaimToken, RunId};

/// One recorded host call, as stored.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Call {
    pub position: i32,
    pub import: String,
    pub name: Option<String>,
    pub args_hash: Option<String>,
    pub ops_before: i64,
    pub ops_after: Option<i64>,
    /// `None`: the call was made and its outcome is unknown.
    pub outcome: Option<String>,
    pub result: Option<String>,
}

/// A run's call log, in order.
pub async fn log(db: impl PgExecutor<'_>, run: RunId) -> Result<Vec<Call>, sqlx::Error> {
    sqlx::query_as(
        "SELECT position, import, name, args_hash, ops_before, ops_after, outcome, result
         FROM run_call WHERE run_id = $1 ORDER BY position",
    )
    .bind(run)
    .fetch_all(db)
    .await
}

/// Inserts calls (completed ones, and at most one started one last), fenced
/// like a journal append: written only while the run names this claim token
/// and is running (the row taken `FOR SHARE`). Returns false when fenced.
pub async fn insert(
    db: impl PgExecutor<'_>,
    run: RunId,
    token: ClaimToken,
    attempt: i32,
    calls: &[Call],
) -> Result<bool, sqlx::Error> {
    let col = |f: fn(&Call) -> Option<String>| calls.iter().map(f).collect::<Vec<_>>();
    let positions: Vec<i32> = calls.iter().map(|c| c.position).collect();
    let imports: Vec<String> = calls.iter().map(|c| c.import.clone()).collect();
    let ops_before: Vec<i64> = calls.iter().map(|c| c.ops_before).collect();
    let ops_after: Vec<Option<i64>> = calls.iter().map(|c| c.ops_after).collect();
    let inserted: i64 = sqlx::query_scalar(
        "WITH ins AS (
             INSERT INTO run_call (run_id, position, import, name, args_hash, ops_before, ops_after,
                                   outcome, result, attempt)
             SELECT $1, c.position, c.import, c.name, c.args_hash, c.ops_before, c.ops_after,
                    c.outcome, c.result, $3
             FROM (SELECT 1 FROM agent_run
                   WHERE id = $1 AND claim_token = $2 AND status = 'running'   -- the fence
                   FOR SHARE) AS fence,
                  unnest($4::int[], $5::text[], $6::text[], $7::text[], $8::bigint[], $9::bigint[],
                         $10::text[], $11::text[])
                      AS c(position, import, name, args_hash, ops_before, ops_after, outcome, result)
             RETURNING 1)
         SELECT count(*) FROM ins",
    )
    .bind(run)
    .bind(token)
    .bind(attempt)
    .bind(positions)
    .bind(imports)
    .bind(col(|c| c.name.clone()))
    .bind(col(|c| c.args_hash.clone()))
    .bind(ops_before)
    .bind(ops_after)
    .bind(col(|c| c.outcome.clone()))
    .bind(col(|c| c.result.clone()))
    .fetch_one(db)
    .await?;
    Ok(inserted as usize == calls.len())
}

/// Records the outcome of a started call, fenced. Returns false when fenced.
pub async fn complete(
    db: impl PgExecutor<'_>,
    run: RunId,
    token: ClaimToken,
    position: i32,
    ops_after: i64,
    outcome: &str,
    result: &str,
) -> Result<bool, sqlx::Error> {
    // Written, or already written by an earlier try whose answer was lost
    // (its outcome is there): either way true while the claim is ours.
    let done = sqlx::query(
        "WITH fence AS (SELECT 1 FROM agent_run
                        WHERE id = $1 AND claim_token = $2 AND status = 'running'   -- the fence
                        FOR SHARE),
         upd AS (UPDATE run_call c SET ops_after = $4, outcome = $5, result = $6
                 FROM fence WHERE c.run_id = $1 AND c.position = $3 AND c.outcome IS NULL
                 RETURNING 1)
         SELECT 1 FROM fence
         WHERE EXISTS (SELECT 1 FROM upd)
            OR EXISTS (SELECT 1 FROM run_call WHERE run_id = $1 AND position = $3 AND outcome IS NOT NULL)",
    )
    .bind(run)
    .bind(token)
    .bind(position)
    .bind(ops_after)
    .bind(outcome)
    .bind(result)
    .fetch_optional(db)
    .await?;
    Ok(done.is_some())
}

/// Takes a call whose outcome is unknown for this attempt before it is made
/// again, fenced: a stale process resuming the same run cannot re-send it.
pub async fn retake(
    db: impl PgExecutor<'_>,
    run: RunId,
    token: ClaimToken,
    position: i32,
    attempt: i32,
) -> Result<bool, sqlx::Error> {
    let taken = sqlx::query(
        "UPDATE run_call c SET attempt = $4
         FROM (SELECT 1 FROM agent_run
               WHERE id = $1 AND claim_token = $2 AND status = 'running'   -- the fence
               FOR SHARE) AS fence
         WHERE c.run_id = $1 AND c.position = $3 AND c.outcome IS NULL",
    )
    .bind(run)
    .bind(token)
    .bind(position)
    .bind(attempt)
    .execute(db)
    .await?;
    Ok(taken.rows_affected() == 1)
}

/// What an earlier attempt journaled, for the attempt that resumes it: the
/// next seq, the last append number journaled, and the streamed text as a
/// client holds it (every `content_rollback` applied), piece by piece with
/// the append number each piece ended at, in order.
#[derive(Debug, Clone, Default)]
pub struct Journaled {
    pub next_seq: i32,
    pub last_op: i64,
    pub deltas: Vec<(i64, String)>,
}

pub async fn journaled(db: &mut sqlx::PgConnection, run: RunId) -> Result<Journaled, sqlx::Error> {
    let (max_seq, last_op): (Option<i32>, Option<i64>) =
        sqlx::query_as("SELECT max(seq), max(op) FROM run_event WHERE run_id = $1")
            .bind(run)
            .fetch_one(&mut *db)
            .await?;
    // Deltas (with their op) and rollbacks (with the characters they keep), in seq order.
    let rows: Vec<(String, Option<i64>, Option<String>, Option<i64>)> = sqlx::query_as(
        "SELECT type, op, payload ->> 'delta', (payload ->> 'keep_chars')::bigint FROM run_event
         WHERE run_id = $1 AND ((type = $2 AND op IS NOT NULL AND payload ? 'delta') OR type = $3)
         ORDER BY seq",
    )
    .bind(run)
    .bind(super::events::CONTENT_DELTA)
    .bind(super::events::CONTENT_ROLLBACK)
    .fetch_all(&mut *db)
    .await?;
    let mut deltas: Vec<(i64, String)> = Vec::new();
    for (kind, op, delta, keep) in rows {
        match (op, delta) {
            (Some(op), Some(text)) if kind == super::events::CONTENT_DELTA => deltas.push((op, text)),
            _ => rollback(&mut deltas, keep.unwrap_or(0).max(0) as usize),
        }
    }
    Ok(Journaled { next_seq: max_seq.unwrap_or(0) + 1, last_op: last_op.unwrap_or(0), deltas })
}

/// Cuts the pieces to their first `keep` characters, as a client does.
fn rollback(pieces: &mut Vec<(i64, String)>, keep: usize) {
    let mut left = keep;
    let mut n = 0;
    for (_, text) in pieces.iter_mut() {
        let chars = text.chars().count();
        if chars > left {
            *text = text.chars().take(left).collect();
            n += 1;
            break;
        }
        left -= chars;
        n += 1;
    }
    pieces.truncate(n);
    pieces.retain(|(_, t)| !t.is_empty());
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_rollback_cuts_the_pieces_as_a_client_cuts_its_text() {
        let mut pieces = vec![(3, "Hello ".to_string()), (4, "wörld".to_string()), (5, "!".to_string())];
        super::rollback(&mut pieces, 8);
        assert_eq!(pieces, vec![(3, "Hello ".to_string()), (4, "wö".to_string())]);
        super::rollback(&mut pieces, 0);
        assert!(pieces.is_empty());
    }
}
