//! The benchmark's own SQL: its throwaway database, bulk enqueue and reset.
//! Nothing here is the host's production path; the host's statements (claim,
//! finish, journal) are reached through `library`.

use anyhow::Context;
use sqlx::{Connection, PgExecutor};

use crate::library::{MessageStatus, ENQUEUE_SEQS, OWNER, RUN_QUEUED, USER_MESSAGE_CREATED};

/// Bound on a database name (PostgreSQL truncates identifiers at 63 bytes).
const DATABASE_NAME_BYTES_MAX: usize = 63;

/// A fresh database `name` beside the one in `url`, so the benchmark never
/// touches real data. Returns its URL.
pub async fn fresh_database(url: &str, name: &str) -> anyhow::Result<String> {
    anyhow::ensure!(
        !name.is_empty()
            && name.len() <= DATABASE_NAME_BYTES_MAX
            && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
        "--bench-database must be 1-{DATABASE_NAME_BYTES_MAX} characters of a-z, 0-9 and _"
    );
    let (base, _) = url.rsplit_once('/').context("database URL without a database name")?;
    let mut admin = sqlx::PgConnection::connect(&format!("{base}/postgres")).await?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).execute(&mut admin).await?;
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut admin).await?;
    admin.close().await?;
    Ok(format!("{base}/{name}"))
}

/// Enqueues `n` runs of `plugin`, each in its own conversation, with the same
/// rows an HTTP enqueue writes (conversation, message, run, and the journal's
/// enqueue events), in one statement.
pub async fn bulk_enqueue(db: impl PgExecutor<'_>, n: i64, plugin: &str) -> Result<(), sqlx::Error> {
    sqlx::query(
        "WITH c AS (
             INSERT INTO conversation (id, owner_id, tenant_id)
             SELECT gen_random_uuid(), $3, $3 FROM generate_series(1, $1)
             RETURNING id),
         m AS (
             INSERT INTO message (id, conversation_id, role, content, status)
             SELECT gen_random_uuid(), id, 'user', 'bench', $4 FROM c
             RETURNING id, conversation_id),
         r AS (
             INSERT INTO agent_run (id, conversation_id, owner_id, tenant_id, user_message_id, plugin, request)
             SELECT gen_random_uuid(), conversation_id, $3, $3, id, $2, '{}' FROM m
             RETURNING id)
         INSERT INTO run_event (run_id, seq, type, payload)
         SELECT r.id, s.seq, s.type, '{}' FROM r,
                (VALUES ($7::int, $5::text), ($8::int, $6::text)) AS s(seq, type)",
    )
    .bind(n)
    .bind(plugin)
    .bind(OWNER)
    .bind(MessageStatus::Queued)
    .bind(USER_MESSAGE_CREATED)
    .bind(RUN_QUEUED)
    .bind(*ENQUEUE_SEQS.start())
    .bind(*ENQUEUE_SEQS.end())
    .execute(db)
    .await?;
    Ok(())
}

/// Empties every table the benchmark writes.
pub async fn reset(db: impl PgExecutor<'_>) -> Result<(), sqlx::Error> {
    sqlx::query("TRUNCATE run_call, run_event, agent_run, message, conversation").execute(db).await?;
    Ok(())
}

/// Fresh statistics after a bulk load, so the claim's plan is the steady-state one.
pub async fn analyze(db: impl PgExecutor<'_>) -> Result<(), sqlx::Error> {
    sqlx::query("VACUUM ANALYZE agent_run").execute(db).await?;
    Ok(())
}
