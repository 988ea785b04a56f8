//! The statuses of runs and messages, typed at the database boundary: a
//! column holds one of these words or the CHECK constraint refuses the row,
//! and reading a word outside the enum is a decode error, never a silent
//! default. The transitions between them are owned by [`super::lifecycle`]
//! and enforced by the schema's trigger `agent_run_status_transition`.

use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A Rust enum stored as a `text` column (encoded and decoded as its word).
macro_rules! text_enum {
    ($name:ident { $($variant:ident => $word:literal),+ $(,)? }) => {
        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $word),+ }
            }
        }

        impl FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($word => Ok($name::$variant),)+
                    other => Err(format!(concat!("unknown ", stringify!($name), " {:?}"), other)),
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl sqlx::Type<sqlx::Postgres> for $name {
            fn type_info() -> sqlx::postgres::PgTypeInfo {
                <&str as sqlx::Type<sqlx::Postgres>>::type_info()
            }
            fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
                <&str as sqlx::Type<sqlx::Postgres>>::compatible(ty)
            }
        }

        impl sqlx::Encode<'_, sqlx::Postgres> for $name {
            fn encode_by_ref(
                &self,
                buf: &mut sqlx::postgres::PgArgumentBuffer,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                <&str as sqlx::Encode<sqlx::Postgres>>::encode_by_ref(&self.as_str(), buf)
            }
        }

        impl sqlx::Decode<'_, sqlx::Postgres> for $name {
            fn decode(value: sqlx::postgres::PgValueRef<'_>) -> Result<Self, sqlx::error::BoxDynError> {
                let s = <&str as sqlx::Decode<sqlx::Postgres>>::decode(value)?;
                Ok(s.parse()?)
            }
        }

        impl sqlx::postgres::PgHasArrayType for $name {
            fn array_type_info() -> sqlx::postgres::PgTypeInfo {
                <&str as sqlx::postgres::PgHasArrayType>::array_type_info()
            }
        }
    };
}

/// The status of a run, and who owns each transition (every one of them is a
/// function of [`super::lifecycle`]). The schema's trigger enforces the same
/// table: terminal states are sticky, and nothing re-queues a started run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum RunStatus {
    /// Written by enqueue (and by retry, as a new run). Left by the
    /// dispatcher's claim (-> running) or by a stop sweep or a cancel of a
    /// queued run (-> cancelled).
    Queued,
    /// Written by the claim, or by the eager start (a run written claimed
    /// in its own enqueue, [`super::lifecycle::enqueue_eager`]). Left only by the claim holder's fenced finalize,
    /// by the run task's backstop (fenced), or by the reaper once the lease
    /// has lapsed past the grace (re-checked in the write); a resumable run
    /// also by the hand-back (-> queued) and a suspension (-> waiting).
    Running,
    /// A resumable run suspended until a decision or a time: no lease, no
    /// worker. Left by a decision or the scheduler (-> queued, resumed by
    /// replay) or a stop (-> cancelled).
    Waiting,
    /// Terminal, written by the worker's fenced finalize.
    Completed,
    /// Terminal, written by the worker (agent error, drain timeout), the
    /// backstop, or the reaper (worker lost).
    Failed,
    /// Terminal, written by a stop sweep (queued) or the worker (running).
    Cancelled,
}

text_enum!(RunStatus {
    Queued => "queued",
    Running => "running",
    Waiting => "waiting",
    Completed => "completed",
    Failed => "failed",
    Cancelled => "cancelled",
});

impl RunStatus {
    pub fn is_terminal(self) -> bool {
        matches!(self, RunStatus::Completed | RunStatus::Failed | RunStatus::Cancelled)
    }
}

/// The status of a transcript message. The machine, by role:
///
/// ```text
/// user:      queued --claim--> complete
///            queued --stop sweep / cancel of a queued run--> draft
///            draft|complete --retry (the run failed or was cancelled)--> queued
/// assistant: written once by the run's ending: complete (the run completed)
///            or partial (cancelled or failed with text already streamed)
/// ```
///
/// Only `complete` and `partial` messages are history an agent is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum MessageStatus {
    /// A user message whose run has not started.
    Queued,
    /// A user message whose run started, or a whole assistant answer.
    Complete,
    /// A user message a stop handed back before its run started.
    Draft,
    /// An assistant answer cut off by a cancel or a failure.
    Partial,
}

text_enum!(MessageStatus {
    Queued => "queued",
    Complete => "complete",
    Draft => "draft",
    Partial => "partial",
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip() {
        for s in RunStatus::ALL {
            assert_eq!(s.as_str().parse::<RunStatus>().unwrap(), *s);
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
        }
        for s in MessageStatus::ALL {
            assert_eq!(s.as_str().parse::<MessageStatus>().unwrap(), *s);
        }
        assert!("done".parse::<RunStatus>().is_err());
    }
}
