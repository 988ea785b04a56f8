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
    let done = sqlx::query(
        "UPDATE run_call c SET ops_after = $4, outcome = $5, result = $6
         FROM (SELECT 1 FROM agent_run
               WHERE id = $1 AND claim_token = $2 AND status = 'running'   -- the fence
               FOR SHARE) AS fence
         WHERE c.run_id = $1 AND c.position = $3 AND c.outcome IS NULL",
    )
    .bind(run)
    .bind(token)
    .bind(position)
    .bind(ops_after)
    .bind(outcome)
    .bind(result)
    .execute(db)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// What an earlier attempt journaled, for the attempt that resumes it: the
/// next seq, the last append number journaled, and every streamed piece of
/// text with the append number it ended at (in order).
#[derive(Debug, Clone, Default)]
pub struct Journaled {
    pub next_seq: i32,
    pub last_op: i64,
    pub deltas: Vec<(i64, String)>,
}

pub async fn journaled(db: impl PgExecutor<'_> + Copy, run: RunId) -> Result<Journaled, sqlx::Error> {
    let (max_seq, last_op): (Option<i32>, Option<i64>) =
        sqlx::query_as("SELECT max(seq), max(op) FROM run_event WHERE run_id = $1").bind(run).fetch_one(db).await?;
    let deltas: Vec<(i64, String)> = sqlx::query_as(
        "SELECT op, payload ->> 'delta' FROM run_event
         WHERE run_id = $1 AND type = $2 AND op IS NOT NULL AND payload ? 'delta'
         ORDER BY seq",
    )
    .bind(run)
    .bind(super::events::CONTENT_DELTA)
    .fetch_all(db)
    .await?;
    Ok(Journaled { next_seq: max_seq.unwrap_or(0) + 1, last_op: last_op.unwrap_or(0), deltas })
}
