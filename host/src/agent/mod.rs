//! The agent interface: what a claimed run executes. Built-in agents
//! ([`builtins`]) and WebAssembly components (the sandbox's `WasmAgent`)
//! implement the same [`Agent`] trait; [`registry::AgentRegistry`] resolves a
//! run's (plugin, digest) to one of them.
//!
//! An agent sees only [`RunHost`], whose imports mirror the WIT host
//! interface (`emit-event`, `call-tool`, `check-cancel`) with the plugin's
//! grants and limits. Every import is fenced: once the claim is lost, they
//! refuse with [`HostError::Fenced`].

pub mod builtins;
pub mod registry;

use async_trait::async_trait;
use serde::Serialize;

use crate::db::{ConversationId, RunId};
pub use crate::error::{AgentError, FailReason, HostError};
pub use crate::run::host::{RunHost, Usage};
pub use builtins::{Echo, Noop, Sleep};
pub use registry::{AgentRegistry, CompileStats, Compiled, Components, Resolved};

/// One message of the conversation before this turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct Message {
    /// `user` or `assistant`.
    pub role: String,
    pub content: String,
}

/// One turn's input: the same for every agent, built-in or Wasm.
#[derive(Debug, Clone)]
pub struct RunInput {
    pub run_id: RunId,
    pub conversation_id: ConversationId,
    /// The user's message this turn answers.
    pub content: String,
    /// The run's config, a JSON object (parsed once: the host's own keys
    /// typed, the whole object the agent's).
    pub config: crate::run::config::RunConfig,
    /// The conversation before this turn, oldest first (complete and partial
    /// messages, the most recent [`registry::HISTORY_MESSAGES_MAX`]).
    pub history: Vec<Message>,
}

#[async_trait]
pub trait Agent: Send + Sync + 'static {
    /// Runs one turn and returns the final assistant text.
    async fn run(&self, host: &RunHost, input: RunInput) -> Result<String, AgentError>;

    /// Whether the agent keeps its manifest's wall time itself (a Wasm
    /// guest's sandbox does, and reports what it was doing); for every
    /// other agent the run task ends the turn at the wall time.
    fn keeps_wall_time(&self) -> bool {
        false
    }
}
