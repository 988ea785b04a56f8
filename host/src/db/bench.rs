//! SQL used only by the benchmark: bulk enqueue and reset.

use sqlx::PgExecutor;

/// Enqueues `n` runs of `plugin`, each in its own conversation, with the same
/// rows an HTTP enqueue writes (conversation, message, run, seq 1-2), in one
/// statement.
pub async fn bulk_enqueue(db: impl PgExecutor<'_>, n: i64, plugin: &str) -> Result<(), sqlx::Error> {
    sqlx::query(
        "WITH c AS (
             INSERT INTO conversation (id, owner_id, tenant_id)
             SELECT gen_random_uuid(), 'bench', 'bench' FROM generate_series(1, $1)
             RETURNING id),
         m AS (
             INSERT INTO message (id, conversation_id, role, content, status)
             SELECT gen_random_uuid(), id, 'user', 'bench', 'queued' FROM c
             RETURNING id, conversation_id),
         r AS (
             INSERT INTO agent_run (id, conversation_id, owner_id, tenant_id, user_message_id, plugin, request)
             SELECT gen_random_uuid(), conversation_id, 'bench', 'bench', id, $2, '{}' FROM m
             RETURNING id)
         INSERT INTO run_event (run_id, seq, type, payload)
         SELECT r.id, s.seq, s.type, '{}' FROM r,
                (VALUES (1, 'user_message_created'), (2, 'run_queued')) AS s(seq, type)",
    )
    .bind(n)
    .bind(plugin)
    .execute(db)
    .await?;
    Ok(())
}

/// Empties every table the benchmark writes.
pub async fn reset(db: impl PgExecutor<'_>) -> Result<(), sqlx::Error> {
    sqlx::query("TRUNCATE run_event, agent_run, message, conversation").execute(db).await?;
    Ok(())
}

/// Fresh statistics after a bulk load, so the claim's plan is the steady-state one.
pub async fn analyze(db: impl PgExecutor<'_>) -> Result<(), sqlx::Error> {
    sqlx::query("VACUUM ANALYZE agent_run").execute(db).await?;
    Ok(())
}
