//! The one registry that resolves a run's (plugin, digest, manifest) to the
//! agent that executes it: a built-in by name, or a WebAssembly component by
//! digest through [`Components`] (the sandbox implements it; this module does
//! not import the sandbox). It also holds the host's tools, which every run's
//! [`crate::run::host::RunHost`] reaches behind its plugin's grants.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use serde_json::Value;

use super::{Agent, AgentError, Echo, FailReason, Noop, Sleep};
use crate::run::manifest::Manifest;
use crate::tools::ToolRegistry;

/// Messages of history an agent receives at most.
pub const HISTORY_MESSAGES_MAX: i64 = 200;

/// A component that does not fit the host's world.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidComponent(pub String);

/// Agents made from stored WebAssembly components.
#[async_trait]
pub trait Components: Send + Sync + 'static {
    /// The agent for the component `digest`, run under `manifest`.
    async fn agent(&self, digest: &str, manifest: &Manifest) -> Result<Arc<dyn Agent>, AgentError>;
    /// Checks that `bytes` are a component this host can run; the error says
    /// what does not fit.
    fn validate(&self, bytes: &[u8]) -> Result<(), InvalidComponent>;
    /// [`Components::validate`] that also hands back the compiled artifact,
    /// for [`Components::keep`] once the component is stored: an upload's
    /// validation is the digest's one compile.
    fn compile(&self, bytes: &[u8]) -> Result<Compiled, InvalidComponent>;
    /// Keeps a stored component's compiled artifact where every process
    /// finds it (a failure only costs a later compile, and is logged).
    async fn keep(&self, compiled: Compiled);
    /// Guest instances alive right now.
    fn live(&self) -> usize;
    /// Compiles and stored artifacts since start, for `/metrics`.
    fn compile_stats(&self) -> CompileStats {
        CompileStats::default()
    }
}

/// A validated component's compiled code (the engine's serialization).
pub struct Compiled {
    /// The component's digest (`sha256:<hex>` of its bytes).
    pub digest: String,
    pub artifact: Vec<u8>,
}

/// Counters of the sandbox's compiles since the process started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompileStats {
    /// Components compiled by Cranelift (uploads' validations and first runs).
    pub compiles: u64,
    /// Compiled artifacts loaded from the database instead of compiling.
    pub artifacts_loaded: u64,
    /// Stored artifacts refused (their MAC did not match) and recompiled.
    pub artifacts_rejected: u64,
    /// Instantiations that waited for a slot of an exhausted pool.
    pub pool_waits: u64,
}

/// A run's agent with the manifest it runs under.
pub struct Resolved {
    pub agent: Arc<dyn Agent>,
    pub manifest: Manifest,
}

/// Agents by plugin name, components by digest, and the host's tools.
#[derive(Clone, Default)]
pub struct AgentRegistry {
    builtins: HashMap<String, (Arc<dyn Agent>, Manifest)>,
    components: Option<Arc<dyn Components>>,
    tools: ToolRegistry,
}

impl AgentRegistry {
    /// The built-in agents: `noop`, `echo` and `sleep`.
    pub fn with_builtins() -> Self {
        let mut r = AgentRegistry::default();
        r.insert("noop", Arc::new(Noop));
        r.insert("echo", Arc::new(Echo));
        r.insert("sleep", Arc::new(Sleep));
        r
    }

    /// Runs registered WebAssembly plugins with `components` (the sandbox).
    pub fn with_sandbox(mut self, components: Arc<dyn Components>) -> Self {
        self.components = Some(components);
        self
    }

    /// The tools `call-tool` reaches (behind each plugin's grants).
    pub fn with_tools(mut self, tools: ToolRegistry) -> Self {
        self.tools = tools;
        self
    }

    pub fn sandbox(&self) -> Option<&Arc<dyn Components>> {
        self.components.as_ref()
    }

    pub fn tools(&self) -> &ToolRegistry {
        &self.tools
    }

    /// A built-in agent granted nothing (its manifest is the default).
    pub fn insert(&mut self, name: &str, agent: Arc<dyn Agent>) {
        self.insert_with_manifest(name, agent, Manifest::default());
    }

    /// A built-in agent with its grants and limits.
    pub fn insert_with_manifest(&mut self, name: &str, agent: Arc<dyn Agent>, manifest: Manifest) {
        self.builtins.insert(name.to_string(), (agent, manifest));
    }

    pub fn get(&self, name: &str) -> Option<Arc<dyn Agent>> {
        self.builtins.get(name).map(|(a, _)| a.clone())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.builtins.contains_key(name)
    }

    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.builtins.keys().cloned().collect();
        names.sort();
        names
    }

    /// The agent for a run: its pinned digest (with the manifest pinned
    /// beside it) names a component; no digest names a built-in.
    pub async fn resolve(
        &self,
        plugin: &str,
        digest: Option<&str>,
        manifest: Option<&Value>,
    ) -> Result<Resolved, AgentError> {
        let unavailable =
            || AgentError::failed(FailReason::Unavailable, format!("plugin {plugin:?} is not available on this host"));
        match digest {
            Some(digest) => {
                let components = self.components.as_ref().ok_or_else(unavailable)?;
                let manifest = match manifest {
                    Some(m) => Manifest::parse(m).map_err(|e| AgentError::failed(FailReason::Unavailable, e))?,
                    None => Manifest::default(),
                };
                let agent = components.agent(digest, &manifest).await?;
                Ok(Resolved { agent, manifest })
            }
            None => {
                let (agent, registered) = self.builtins.get(plugin).ok_or_else(unavailable)?;
                // A manifest pinned on the run (a resumable built-in's) wins.
                let manifest = match manifest {
                    Some(m) => Manifest::parse(m).map_err(|e| AgentError::failed(FailReason::Unavailable, e))?,
                    None => registered.clone(),
                };
                Ok(Resolved { agent: agent.clone(), manifest })
            }
        }
    }
}
