//! The benchmark's own SQL: its throwaway database, bulk enqueue and reset.
//! Nothing here is the host's production path; the host's statements (claim,
//! finish, journal) are reached through `library`.

use anyhow::Context;
use sqlx::{Connection, PgExecutor};

use crate::library::{MessageStatus, RunId, ENQUEUE_SEQS, OWNER, RUN_QUEUED, RUN_RESUMED, USER_MESSAGE_CREATED};

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
/// enqueue events), in one statement. `manifest` is pinned on each run as
/// enqueue pins it (JSON text; `None`: the built-in's registered one).
pub async fn bulk_enqueue(
    db: impl PgExecutor<'_>,
    n: i64,
    plugin: &str,
    manifest: Option<&str>,
) -> Result<(), sqlx::Error> {
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
             INSERT INTO agent_run (id, conversation_id, owner_id, tenant_id, user_message_id, plugin, request,
                                    plugin_manifest)
             SELECT gen_random_uuid(), conversation_id, $3, $3, id, $2, '{}', $9::text::jsonb FROM m
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
    .bind(manifest)
    .execute(db)
    .await?;
    Ok(())
}

/// Seconds from a resumed run's claim (the claim stamps `last_heartbeat_at`
/// with its statement clock) and from its latest `run_resumed` row to now,
/// by the database's clock.
pub async fn since_resume(db: impl PgExecutor<'_>, run: RunId) -> Result<(f64, f64), sqlx::Error> {
    let (claim, resumed): (Option<f64>, Option<f64>) = sqlx::query_as(
        "SELECT extract(epoch FROM clock_timestamp() - r.last_heartbeat_at)::float8,
                (SELECT extract(epoch FROM clock_timestamp() - e.created_at)::float8
                 FROM run_event e WHERE e.run_id = r.id AND e.type = $2 ORDER BY e.seq DESC LIMIT 1)
         FROM agent_run r WHERE r.id = $1",
    )
    .bind(run)
    .bind(RUN_RESUMED)
    .fetch_one(db)
    .await?;
    Ok((claim.unwrap_or(f64::NAN), resumed.unwrap_or(f64::NAN)))
}

/// Runs of the benchmark's throwaway database in `status` (`waiting`, `running`, ...).
pub async fn count_status(db: impl PgExecutor<'_>, status: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM agent_run WHERE status::text = $1").bind(status).fetch_one(db).await
}

/// Empties every table the benchmark writes.
pub async fn reset(db: impl PgExecutor<'_>) -> Result<(), sqlx::Error> {
    sqlx::query(
        "TRUNCATE stream_ticket, response_deleted, a2a_push_config, webhook_delivery, schedule, run_suspension, run_steer, run_call, run_event, agent_run, message, conversation",
    )
    .execute(db)
    .await?;
    Ok(())
}

/// Fresh statistics after a bulk load, so the claim's plan is the steady-state one.
pub async fn analyze(db: impl PgExecutor<'_>) -> Result<(), sqlx::Error> {
    sqlx::query("VACUUM ANALYZE agent_run").execute(db).await?;
    Ok(())
}

/// The pid of the server's postmaster when the server runs on this machine
/// (see [`crate::figures::local_postmaster`]), for reading its CPU.
pub async fn local_postmaster(db: impl PgExecutor<'_>) -> Result<Option<u32>, sqlx::Error> {
    let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(db).await?;
    Ok(crate::figures::local_postmaster(backend))
}

/// The server's counters and CPU at one moment, read before a measured
/// stretch (a drain, ours or graphile-worker's) and compared after it.
pub struct ServerMarks {
    wal: i64,
    xid: i64,
    postmaster: Option<u32>,
    cpu: Option<f64>,
}

/// What the server did over a measured stretch, per unit of work.
pub struct ServerCosts {
    /// Transactions that wrote (one commit record and one WAL flush each).
    pub commits: f64,
    pub wal_bytes: f64,
    /// The server's CPU, in µs; NaN for a server not on this machine.
    pub cpu_us: f64,
}

impl ServerMarks {
    pub async fn read(pool: &sqlx::PgPool) -> anyhow::Result<ServerMarks> {
        let postmaster = local_postmaster(pool).await?;
        let (wal, xid) = write_marks(pool).await?;
        Ok(ServerMarks { wal, xid, postmaster, cpu: postmaster.and_then(crate::figures::server_cpu) })
    }

    /// What the server did since these marks, per unit of `n` units.
    pub async fn per(&self, pool: &sqlx::PgPool, n: f64) -> anyhow::Result<ServerCosts> {
        let cpu = self.postmaster.and_then(crate::figures::server_cpu);
        let (wal, xid) = write_marks(pool).await?;
        Ok(ServerCosts {
            commits: (xid - self.xid) as f64 / n,
            wal_bytes: (wal - self.wal) as f64 / n,
            cpu_us: self.cpu.zip(cpu).map_or(f64::NAN, |(a, b)| (b - a) * 1e6 / n),
        })
    }
}

/// The server's write position and its next transaction id: the difference
/// of two readings is the WAL written (bytes, every database of the server)
/// and the transactions that wrote (each one commit record, the fsync a
/// commit waits for) in between. Read-only transactions take no id and
/// write no commit. Neither read takes a transaction id itself.
pub async fn write_marks(db: impl PgExecutor<'_>) -> Result<(i64, i64), sqlx::Error> {
    sqlx::query_as(
        "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint,
                pg_snapshot_xmax(pg_current_snapshot())::text::bigint",
    )
    .fetch_one(db)
    .await
}
