//! Bearer tokens and stream tickets: the secret is shown once at creation;
//! only its sha256 is stored. A token may expire and may be revoked; every
//! request reads the row (no cache), so a revocation holds in every process
//! at once. A stream ticket is a short-lived, run-scoped secret an
//! `EventSource` presents instead of the token (it cannot send headers).

use chrono::{DateTime, Utc};
use rand::RngCore;
use serde::Serialize;
use sha2::{Digest, Sha256};
use sqlx::PgExecutor;
use uuid::Uuid;

use super::RunId;
pub use super::TokenId;

/// Who a valid token speaks for.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Principal {
    pub user_id: String,
    pub tenant_id: String,
    pub admin: bool,
    /// An operator-level admin: every tenant's tokens, published plugins.
    pub operator: bool,
    /// The token's id (never its secret).
    pub token_id: Uuid,
}

/// What `tokens list` shows of a token: never its secret.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, schemars::JsonSchema)]
pub struct TokenInfo {
    pub id: Uuid,
    pub user_id: String,
    pub tenant_id: String,
    pub admin: bool,
    pub operator: bool,
    pub created_at: DateTime<Utc>,
    pub last_used_at: Option<DateTime<Utc>>,
    pub expires_at: Option<DateTime<Utc>>,
    pub revoked_at: Option<DateTime<Utc>>,
}

/// A token to create.
#[derive(Debug, Clone, Default)]
pub struct NewToken<'a> {
    pub user_id: &'a str,
    pub tenant_id: &'a str,
    pub admin: bool,
    pub operator: bool,
    /// Seconds until it expires; `None`: never.
    pub expires_in_s: Option<i64>,
    /// The token creating it (over HTTP): the new one expires no later than
    /// that one does, so an expiring admin cannot mint a lasting token.
    pub expires_by: Option<Uuid>,
}

/// The columns of a [`TokenInfo`], for every query that answers one.
macro_rules! info_columns {
    () => {
        "id, user_id, tenant_id, admin, operator, created_at, last_used_at, expires_at, revoked_at"
    };
}

/// The SQL condition of a [`Scope`], bound as $1 (tenant), $2 (user) and
/// $3 (no operators).
macro_rules! scope_filter {
    () => {
        "($1::text IS NULL OR tenant_id = $1) AND ($2::text IS NULL OR user_id = $2) AND NOT ($3 AND operator)"
    };
}

/// Seconds a stream ticket is good for.
pub const TICKET_TTL_S: i64 = 60;
/// Tokens one `list` answers at most.
pub const LIST_MAX: i64 = 1000;

fn hash(token: &str) -> Vec<u8> {
    Sha256::digest(token.as_bytes()).to_vec()
}

fn secret(prefix: &str) -> String {
    let mut secret = [0u8; 24];
    rand::thread_rng().fill_bytes(&mut secret);
    format!("{prefix}{}", hex::encode(secret))
}

/// Creates a token that never expires and returns its secret (the only time
/// it is visible).
pub async fn create<'a>(
    db: impl sqlx::Acquire<'a, Database = sqlx::Postgres>,
    user_id: &str,
    tenant_id: &str,
    admin: bool,
) -> Result<String, CreateError> {
    let new = NewToken { user_id, tenant_id, admin, ..NewToken::default() };
    Ok(create_with(db, &new).await?.1)
}

/// Why a token was not created.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// A user id belongs to one tenant: its first token's. Ownership checks
    /// compare the user id alone, so a token for the same id in another
    /// tenant would act on that user's runs.
    #[error("user {user_id} belongs to tenant {tenant_id}; a user id names one user of one tenant")]
    OtherTenant { user_id: String, tenant_id: String },
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Creates a token; its id and its secret (the only time it is visible).
/// Refused when the user id already has a token in another tenant (checked
/// under a per-user lock, so two concurrent creates cannot both pass).
pub async fn create_with<'a>(
    db: impl sqlx::Acquire<'a, Database = sqlx::Postgres>,
    new: &NewToken<'_>,
) -> Result<(TokenInfo, String), CreateError> {
    let mut tx = db.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('api_token.user_id:' || $1, 0))")
        .bind(new.user_id)
        .execute(&mut *tx)
        .await?;
    let other: Option<String> =
        sqlx::query_scalar("SELECT tenant_id FROM api_token WHERE user_id = $1 AND tenant_id <> $2 LIMIT 1")
            .bind(new.user_id)
            .bind(new.tenant_id)
            .fetch_optional(&mut *tx)
            .await?;
    if let Some(tenant_id) = other {
        return Err(CreateError::OtherTenant { user_id: new.user_id.to_string(), tenant_id });
    }
    let token = secret("ah_");
    let info = sqlx::query_as(concat!(
        "INSERT INTO api_token (token_hash, user_id, tenant_id, admin, operator, expires_at)
         VALUES ($1, $2, $3, $4, $5, least(now() + make_interval(secs => $6::float8),
                                           (SELECT expires_at FROM api_token WHERE id = $7)))
         RETURNING ",
        info_columns!()
    ))
    .bind(hash(&token))
    .bind(new.user_id)
    .bind(new.tenant_id)
    .bind(new.admin || new.operator)
    .bind(new.operator)
    .bind(new.expires_in_s.map(|s| s as f64))
    .bind(new.expires_by)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok((info, token))
}

/// The principal behind a presented token, if it is valid now (not revoked,
/// not expired, by the database's clock). Marks it used, at most once a
/// second per token, so a busy token does not write on every request.
pub async fn authenticate(db: impl PgExecutor<'_>, token: &str) -> Result<Option<Principal>, sqlx::Error> {
    sqlx::query_as(
        "WITH t AS (
             SELECT id, user_id, tenant_id, admin, operator, last_used_at FROM api_token
             WHERE token_hash = $1 AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())
         ), used AS (
             UPDATE api_token a SET last_used_at = now() FROM t
             WHERE a.id = t.id AND (t.last_used_at IS NULL OR t.last_used_at < now() - interval '1 second')
         )
         SELECT user_id, tenant_id, admin, operator, id AS token_id FROM t",
    )
    .bind(hash(token))
    .fetch_optional(db)
    .await
}

/// Whether the token `id` is still valid (an open stream asks this at each
/// keepalive).
pub async fn is_valid(db: impl PgExecutor<'_>, id: Uuid) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM api_token
                        WHERE id = $1 AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now()))",
    )
    .bind(id)
    .fetch_one(db)
    .await
}

/// Of `users`, those holding at least one valid token (neither revoked nor expired).
pub async fn users_with_valid_tokens(
    db: impl PgExecutor<'_>,
    users: &[String],
) -> Result<std::collections::HashSet<String>, sqlx::Error> {
    let rows: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT user_id FROM api_token
         WHERE user_id = ANY($1) AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())",
    )
    .bind(users)
    .fetch_all(db)
    .await?;
    Ok(rows.into_iter().collect())
}

/// Tokens within `scope`, oldest first; at most `limit` (callers ask
/// [`LIST_MAX`]` + 1` to tell a truncated list).
pub async fn list(db: impl PgExecutor<'_>, scope: Scope<'_>, limit: i64) -> Result<Vec<TokenInfo>, sqlx::Error> {
    sqlx::query_as(concat!(
        "SELECT ",
        info_columns!(),
        " FROM api_token WHERE ",
        scope_filter!(),
        " ORDER BY created_at, id LIMIT $4"
    ))
    .bind(scope.tenant)
    .bind(scope.user)
    .bind(scope.no_operators)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// Which tokens a caller may see and manage: of `tenant` and of `user`,
/// each when given, and no operator's when `no_operators`. The default:
/// every token (the command line).
#[derive(Debug, Clone, Copy, Default)]
pub struct Scope<'a> {
    pub tenant: Option<&'a str>,
    pub user: Option<&'a str>,
    pub no_operators: bool,
}

impl<'a> Scope<'a> {
    /// What `p` may manage: an operator every token; an admin its tenant's
    /// but no operator's; anyone else their own.
    pub fn of(p: &'a Principal) -> Scope<'a> {
        Scope { tenant: p.tenant_scope(), user: (!p.admin).then_some(p.user_id.as_str()), no_operators: !p.operator }
    }
}

impl Principal {
    /// The tenant this principal's admin views are limited to: its own, or
    /// `None` (every tenant) for an operator.
    pub fn tenant_scope(&self) -> Option<&str> {
        (!self.operator).then_some(self.tenant_id.as_str())
    }
}

/// One token's row, if it exists within `scope`.
pub async fn get(db: impl PgExecutor<'_>, id: Uuid, scope: Scope<'_>) -> Result<Option<TokenInfo>, sqlx::Error> {
    sqlx::query_as(concat!("SELECT ", info_columns!(), " FROM api_token WHERE id = $4 AND ", scope_filter!()))
        .bind(scope.tenant)
        .bind(scope.user)
        .bind(scope.no_operators)
        .bind(id)
        .fetch_optional(db)
        .await
}

/// Revokes the token `id` within `scope`: `Some(true)` when this call
/// revoked it, `Some(false)` when it already was, `None` when there is no
/// such token.
pub async fn revoke(db: impl PgExecutor<'_>, id: Uuid, scope: Scope<'_>) -> Result<Option<bool>, sqlx::Error> {
    sqlx::query_scalar(concat!(
        "WITH t AS (SELECT id, revoked_at FROM api_token WHERE id = $4 AND ",
        scope_filter!(),
        " FOR UPDATE),
              done AS (UPDATE api_token a SET revoked_at = now() FROM t
                       WHERE a.id = t.id AND t.revoked_at IS NULL RETURNING a.id)
         SELECT EXISTS (SELECT 1 FROM done) FROM t"
    ))
    .bind(scope.tenant)
    .bind(scope.user)
    .bind(scope.no_operators)
    .bind(id)
    .fetch_optional(db)
    .await
}

/// Mints a ticket for `run`'s stream on behalf of the token `token_id`; the
/// caller has checked the run is the token user's. Drops the token's expired
/// tickets (so they cannot pile up).
pub async fn mint_ticket(
    db: &sqlx::PgPool,
    token_id: Uuid,
    run: RunId,
) -> Result<(String, DateTime<Utc>), sqlx::Error> {
    let ticket = secret("st_");
    let mut tx = db.begin().await?;
    sqlx::query("DELETE FROM stream_ticket WHERE token_id = $1 AND expires_at < now()")
        .bind(token_id)
        .execute(&mut *tx)
        .await?;
    let expires_at = sqlx::query_scalar(
        "INSERT INTO stream_ticket (ticket_hash, token_id, run_id, expires_at)
         VALUES ($1, $2, $3, now() + make_interval(secs => $4::float8)) RETURNING expires_at",
    )
    .bind(hash(&ticket))
    .bind(token_id)
    .bind(run)
    .bind(TICKET_TTL_S as f64)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok((ticket, expires_at))
}

/// The principal behind a stream ticket, if it is for `run`, not expired,
/// and its token is still valid.
pub async fn authenticate_ticket(
    db: impl PgExecutor<'_>,
    ticket: &str,
    run: RunId,
) -> Result<Option<Principal>, sqlx::Error> {
    sqlx::query_as(
        "SELECT a.user_id, a.tenant_id, a.admin, a.operator, a.id AS token_id
         FROM stream_ticket s JOIN api_token a ON a.id = s.token_id
         WHERE s.ticket_hash = $1 AND s.run_id = $2 AND s.expires_at > now()
           AND a.revoked_at IS NULL AND (a.expires_at IS NULL OR a.expires_at > now())",
    )
    .bind(hash(ticket))
    .bind(run)
    .fetch_optional(db)
    .await
}
