//! Sub-agents as a service: a run's agent starts a child run through the
//! same door as every API ([`super::submit`]: the plugin pinned, the
//! tenant's quotas), under its parent's owner and tenant, within the
//! parent's manifest limits, and reads its children back. The run host
//! ([`crate::run::host::RunHost`]) records the start as a tool call and
//! suspends the parent while it awaits them.

use std::sync::Arc;

use async_trait::async_trait;
use sqlx::PgPool;

use crate::agent::AgentRegistry;
use crate::db::children::{self, Child};
use crate::db::RunId;
use crate::error::HostError;
use crate::run::host::{ChildStart, Children, StartedChild};

use super::submit::{submit, Busy, Policy, Submission, SubmitError};

/// Starts and reads child runs for every run of a process.
pub struct Starter {
    pool: PgPool,
    agents: Arc<AgentRegistry>,
    policy: Arc<Policy>,
}

impl Starter {
    pub fn new(pool: PgPool, agents: Arc<AgentRegistry>, policy: Arc<Policy>) -> Self {
        Starter { pool, agents, policy }
    }
}

fn unavailable(e: sqlx::Error) -> HostError {
    tracing::warn!(error = %e, "reading or starting a child run failed");
    HostError::Unavailable("the run's child runs could not be read or started now".into())
}

#[async_trait]
impl Children for Starter {
    async fn start(&self, c: &ChildStart<'_>) -> Result<StartedChild, HostError> {
        // A re-issued start (the parent's worker died in it) finds its child.
        if let Some((run_id, conversation_id)) =
            children::started_by(&self.pool, c.parent, c.call).await.map_err(unavailable)?
        {
            return Ok(StartedChild { run_id, conversation_id });
        }
        let census = children::census(&self.pool, c.parent).await.map_err(unavailable)?;
        let limits = c.limits;
        if census.started as u64 >= limits.children_max {
            return Err(HostError::Denied(format!(
                "this run started {} child runs, the most its manifest allows (limits.children_max)",
                census.started
            )));
        }
        if census.active as u64 >= limits.children_active_max {
            return Err(HostError::Denied(format!(
                "this run has {} child runs active, the most its manifest allows at once \
                 (limits.children_active_max): await some first",
                census.active
            )));
        }
        let depth = census.depth as u64 + 1;
        if depth > limits.agent_depth_max {
            return Err(HostError::Denied(format!(
                "a child of this run would be {depth} deep, deeper than its manifest allows (limits.agent_depth_max {})",
                limits.agent_depth_max
            )));
        }
        let s = Submission {
            owner: c.owner.clone(),
            conversation_id: None,
            content: c.input.to_string(),
            plugin: c.plugin.to_string(),
            config: c.config.clone(),
            idempotency_key: None,
            webhook: None,
            strategy: Busy::Enqueue,
            parent: Some((c.parent, c.call)),
        };
        match submit(&self.pool, &self.agents, &self.policy, &s, None).await {
            Ok(done) => {
                let e = done.enqueued();
                Ok(StartedChild { run_id: e.run_id, conversation_id: e.conversation_id })
            }
            Err(SubmitError::Db(e)) => Err(unavailable(e)),
            Err(e @ (SubmitError::Quota(_) | SubmitError::UnknownPlugin { .. })) => {
                Err(HostError::Denied(e.to_string()))
            }
            Err(e) => Err(HostError::Invalid(e.to_string())),
        }
    }

    async fn read(&self, parent: RunId, runs: &[RunId]) -> Result<Vec<Child>, HostError> {
        children::of(&self.pool, parent, runs).await.map_err(unavailable)
    }
}
