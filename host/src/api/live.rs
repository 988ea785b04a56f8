//! A live stream's hold on its caller, shared by the native SSE stream and
//! the Responses API's: the user's place under `--user-max-streams` (taken
//! before anything is written, given back when the stream ends) and the
//! re-check of the caller's token at least once per keepalive interval (a
//! keepalive is sent at least that often when nothing else is), so a stream
//! whose token is revoked or expires ends within one interval.

use std::time::Duration;

use tokio::time::Instant;
use uuid::Uuid;

use crate::db::tokens::Principal;
use crate::service::quota::StreamGuard;

use super::{ApiError, AppState};

pub(crate) struct TokenCheck {
    pool: sqlx::PgPool,
    token: Uuid,
    every: Duration,
    checked_at: Instant,
    _guard: StreamGuard,
}

impl TokenCheck {
    /// Takes `p`'s stream place: 429 past the per-user bound.
    pub(crate) fn open(state: &AppState, p: &Principal) -> Result<Self, ApiError> {
        let guard = state.policy.quotas.stream(&p.tenant_id, &p.user_id)?;
        Ok(TokenCheck {
            pool: state.pool.clone(),
            token: p.token_id,
            every: state.keepalive,
            checked_at: Instant::now(),
            _guard: guard,
        })
    }

    /// Whether the stream may send its next item: re-checks the token at a
    /// keepalive, and at any item an interval after the last check. `false`
    /// (the stream ends) once the token is revoked or expired, or cannot be
    /// re-checked.
    pub(crate) async fn still_valid(&mut self, keepalive: bool, stream: &str) -> bool {
        if !keepalive && self.checked_at.elapsed() < self.every {
            return true;
        }
        match crate::db::tokens::is_valid(&self.pool, self.token).await {
            Ok(true) => {
                self.checked_at = Instant::now();
                true
            }
            Ok(false) => {
                tracing::info!(stream, "stream ended: its token was revoked or expired");
                false
            }
            Err(e) => {
                tracing::warn!(stream, error = %e, "stream ended: its token could not be re-checked");
                false
            }
        }
    }
}
