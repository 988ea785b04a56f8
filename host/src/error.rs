//! The run's vocabulary of refusals and failures: a leaf module that every
//! layer on the run's path may import (journal, tools, host, agents, sandbox,
//! worker, metrics) and that imports nothing of the crate.
//!
//! - [`HostError`]: an import refused (the WIT `host-error` variants).
//! - [`AgentError`]: how a turn ends when it does not return text.
//! - [`FailReason`]: the class of a failure, with a stable label for metrics
//!   and for the first word of a run's `error` text. Nothing parses errors
//!   back into reasons: the reason travels with the error.

/// Refusals of the host's imports (the WIT error variants).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    #[error("cancelled: a stop was requested")]
    Cancelled,
    #[error("fenced: this worker no longer holds the run")]
    Fenced,
    #[error("denied: {0}")]
    Denied(String),
    #[error("invalid: {0}")]
    Invalid(String),
    #[error("limit: {0}")]
    Limit(String),
    #[error("tool failed: {0}")]
    ToolFailed(String),
    /// The host could not do it now (the database is unreachable); nothing
    /// of the call was done.
    #[error("host unavailable: {0}")]
    Unavailable(String),
    /// A shared model limit would hold the call longer than its
    /// `suspend_after_ms`: a resumable run suspends for about `wait_ms` and
    /// then asks again. Never reaches a guest (the run host suspends).
    #[error("throttled: limit {limit} frees in about {wait_ms} ms")]
    Throttled { limit: String, wait_ms: u64 },
}

impl HostError {
    /// The refusal's kind, as the WIT names it (`tool_failed`, `limit`, ...):
    /// how the call log keeps it and how a trace names it (`error.type`).
    pub fn kind(&self) -> &'static str {
        match self {
            HostError::Cancelled => "cancelled",
            HostError::Fenced => "fenced",
            HostError::Denied(_) => "denied",
            HostError::Invalid(_) => "invalid",
            HostError::Limit(_) => "limit",
            HostError::ToolFailed(_) => "tool_failed",
            HostError::Unavailable(_) => "unavailable",
            HostError::Throttled { .. } => "throttled",
        }
    }
}

/// Why a run failed: a small, closed set. `label()` is stable: it is the
/// `reason` label of `agent_host_runs_ended_total` and the head of the run's
/// `error` text (`limit: cpu time budget of 300 ms exceeded`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailReason {
    /// A plugin limit (memory, CPU, wall time, payload, events, tool calls).
    Limit,
    /// The guest trapped.
    Trap,
    /// The plugin returned an error of its own.
    Plugin,
    /// A built-in agent failed.
    Agent,
    /// The run could not start here: plugin unknown, missing, invalid or its
    /// manifest unreadable.
    Unavailable,
    /// The reaper ended it: the lease lapsed without a heartbeat.
    WorkerLost,
    /// A drain ran out of budget before the run finished.
    DrainTimeout,
    /// A stop was requested and the run had not returned within the grace.
    Interrupted,
    /// The host itself failed (a task panicked, a terminal write failed).
    Host,
    /// A resumed run's guest made a call other than the one recorded at the
    /// same position of its call log.
    Divergence,
    /// A resumed run reached a call that was in flight when its worker was
    /// lost, to a tool that is not idempotent: it is not called again.
    UnknownOutcome,
    /// A resumable run was handed back more often than the host allows.
    Attempts,
}

impl FailReason {
    pub const ALL: [FailReason; 12] = [
        FailReason::Limit,
        FailReason::Trap,
        FailReason::Plugin,
        FailReason::Agent,
        FailReason::Unavailable,
        FailReason::WorkerLost,
        FailReason::DrainTimeout,
        FailReason::Interrupted,
        FailReason::Host,
        FailReason::Divergence,
        FailReason::UnknownOutcome,
        FailReason::Attempts,
    ];

    pub fn label(self) -> &'static str {
        match self {
            FailReason::Limit => "limit",
            FailReason::Trap => "trap",
            FailReason::Plugin => "plugin",
            FailReason::Agent => "agent",
            FailReason::Unavailable => "unavailable",
            FailReason::WorkerLost => "worker lost",
            FailReason::DrainTimeout => "drain timeout",
            FailReason::Interrupted => "interrupted",
            FailReason::Host => "host error",
            FailReason::Divergence => "replay diverged",
            FailReason::UnknownOutcome => "unknown outcome",
            FailReason::Attempts => "attempts exhausted",
        }
    }

    /// The run's `error` text: the label, then what happened.
    pub fn message(self, what: impl std::fmt::Display) -> String {
        format!("{}: {what}", self.label())
    }
}

impl std::fmt::Display for FailReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

/// How a turn ends when it does not return text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentError {
    /// The run fails, for `reason`; `message` says what happened.
    #[error("{reason}: {message}")]
    Failed { reason: FailReason, message: String },
    /// An import was refused and the agent gave up (cancelled, fenced, ...).
    #[error(transparent)]
    Host(#[from] HostError),
    /// A stop was requested and the agent had not returned within the grace.
    #[error("interrupted: the run had not stopped {0} ms after the stop and was interrupted")]
    Interrupted(u64),
}

impl AgentError {
    pub fn failed(reason: FailReason, message: impl Into<String>) -> Self {
        AgentError::Failed { reason, message: message.into() }
    }

    /// The class of this ending, when it is a failure.
    pub fn reason(&self) -> FailReason {
        match self {
            AgentError::Failed { reason, .. } => *reason,
            AgentError::Host(HostError::Limit(_)) => FailReason::Limit,
            AgentError::Host(HostError::Unavailable(_)) => FailReason::Host,
            AgentError::Host(_) => FailReason::Agent,
            AgentError::Interrupted(_) => FailReason::Interrupted,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_stable_and_distinct() {
        let labels: std::collections::HashSet<_> = FailReason::ALL.iter().map(|r| r.label()).collect();
        assert_eq!(labels.len(), FailReason::ALL.len());
        assert_eq!(FailReason::WorkerLost.message("lease expired"), "worker lost: lease expired");
        let e = AgentError::failed(FailReason::Limit, "cpu time budget of 5 ms exceeded");
        assert_eq!(e.to_string(), "limit: cpu time budget of 5 ms exceeded");
        assert_eq!(e.reason(), FailReason::Limit);
    }
}
