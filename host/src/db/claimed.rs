//! A run as its worker holds it after a claim (the dispatcher's, the
//! finisher's, or an eager start in the enqueue's statement), and the one
//! refusal every claim must read as "claimed nothing": the one-running
//! index. Apart from `lifecycle` so the enqueue's eager start can use them
//! without the two modules importing each other.

use serde_json::Value;

use super::{ClaimToken, ConversationId, MessageId, RunId};

/// A run as a worker holds it after a claim.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ClaimedRun {
    pub id: RunId,
    pub conversation_id: ConversationId,
    pub claim_token: ClaimToken,
    pub user_message_id: MessageId,
    pub owner_id: String,
    pub tenant_id: String,
    pub plugin: String,
    pub plugin_digest: Option<String>,
    pub plugin_manifest: Option<Value>,
    pub config: Value,
    pub content: String,
    /// Seconds from enqueue to this claim (the database's clock).
    pub waited_s: f64,
    /// 1 for the first claim; more for a resumable run handed back, or
    /// resumed after waiting.
    pub attempt: i32,
    /// How often the run waited (resumes after a wait are not lost workers).
    pub waits: i32,
    /// The seed of the guest's random generators, the same for every attempt.
    pub seed: uuid::Uuid,
    /// Whether the run is a fork (`lifecycle::fork`): its first attempt
    /// replays the calls copied from the original. (False where a claim's
    /// statement does not say: an eager start is never a fork.)
    #[sqlx(default)]
    pub forked: bool,
    /// Whether the conversation had any message besides this turn's when it
    /// was claimed; false means its history is empty, no read needed.
    pub has_history: bool,
    /// The run's trace (`migrations/0022_traces.sql`): its id and the run's
    /// root span, the same for every claim (`None`: a run from before them).
    #[sqlx(default)]
    pub trace_id: Option<uuid::Uuid>,
    #[sqlx(default)]
    pub trace_span_id: Option<i64>,
}

/// Whether a claim error was the index turning away a second running turn.
pub fn is_running_conflict(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.constraint() == Some("one_running_per_conversation"))
}
