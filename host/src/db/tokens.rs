//! Bearer tokens: the secret is shown once at creation; only its sha256 is stored.

use rand::RngCore;
use sha2::{Digest, Sha256};
use sqlx::PgExecutor;

/// Who a valid token speaks for.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Principal {
    pub user_id: String,
    pub tenant_id: String,
    pub admin: bool,
}

fn hash(token: &str) -> Vec<u8> {
    Sha256::digest(token.as_bytes()).to_vec()
}

/// Creates a token and returns its secret (the only time it is visible).
pub async fn create(
    db: impl PgExecutor<'_>,
    user_id: &str,
    tenant_id: &str,
    admin: bool,
) -> Result<String, sqlx::Error> {
    let mut secret = [0u8; 24];
    rand::thread_rng().fill_bytes(&mut secret);
    let token = format!("ah_{}", hex::encode(secret));
    sqlx::query("INSERT INTO api_token (token_hash, user_id, tenant_id, admin) VALUES ($1, $2, $3, $4)")
        .bind(hash(&token))
        .bind(user_id)
        .bind(tenant_id)
        .bind(admin)
        .execute(db)
        .await?;
    Ok(token)
}

/// The principal behind a presented token, if it is valid.
pub async fn authenticate(db: impl PgExecutor<'_>, token: &str) -> Result<Option<Principal>, sqlx::Error> {
    sqlx::query_as("SELECT user_id, tenant_id, admin FROM api_token WHERE token_hash = $1")
        .bind(hash(token))
        .fetch_optional(db)
        .await
}
