//! The guest side of agent-host: write one function from a turn's input to its
//! answer, and export it with [`export_agent!`].
//!
//! ```ignore
//! struct Echo;
//! impl agent_plugin::Agent for Echo {
//!     fn run(turn: agent_plugin::Turn) -> Result<String, String> {
//!         turn.delta(&turn.content).map_err(|e| e.to_string())?;
//!         Ok(turn.content.clone())
//!     }
//! }
//! agent_plugin::export_agent!(Echo);
//! ```

#[doc(hidden)]
pub mod bindings {
    wit_bindgen::generate!({
        path: "../../wit/0.1.0",
        world: "agent",
        pub_export_macro: true,
        export_macro_name: "__export_agent_world",
        default_bindings_module: "agent_plugin::bindings",
    });
}

use bindings::agent_host::plugin::host;
pub use bindings::agent_host::plugin::types::{HostError, Message};
pub use serde_json::{json, Value};

/// A refusal from the host, with a readable message.
#[derive(Debug, Clone)]
pub struct Refusal(pub HostError);

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            HostError::Cancelled => write!(f, "cancelled"),
            HostError::Fenced => write!(f, "fenced"),
            HostError::Denied(m) => write!(f, "denied: {m}"),
            HostError::Invalid(m) => write!(f, "invalid: {m}"),
            HostError::Limit(m) => write!(f, "limit: {m}"),
            HostError::ToolFailed(m) => write!(f, "tool failed: {m}"),
        }
    }
}

impl std::error::Error for Refusal {}

impl From<HostError> for Refusal {
    fn from(e: HostError) -> Self {
        Refusal(e)
    }
}

impl From<Refusal> for String {
    fn from(r: Refusal) -> Self {
        r.to_string()
    }
}

/// One turn, with the host's imports as methods.
pub struct Turn {
    pub run_id: String,
    pub conversation_id: String,
    /// The user's message this turn answers.
    pub content: String,
    /// The conversation before this turn, oldest first.
    pub history: Vec<Message>,
    /// The run's config.
    pub config: Value,
}

impl Turn {
    /// Streams a piece of the answer.
    pub fn delta(&self, text: &str) -> Result<(), Refusal> {
        self.emit("content_delta", &json!({ "delta": text }))
    }

    /// Emits an event of the plugin's own kind (reserved kinds are refused).
    pub fn emit(&self, kind: &str, payload: &Value) -> Result<(), Refusal> {
        Ok(host::emit_event(kind, &payload.to_string())?)
    }

    /// Calls a granted host tool with JSON arguments; returns its JSON answer.
    pub fn call_tool(&self, name: &str, args: &Value) -> Result<Value, Refusal> {
        let out = host::call_tool(name, &args.to_string())?;
        serde_json::from_str(&out).map_err(|e| Refusal(HostError::ToolFailed(format!("tool answered non-JSON: {e}"))))
    }

    /// Whether a stop was requested: return soon (the host interrupts a guest
    /// that does not).
    pub fn cancelled(&self) -> bool {
        host::check_cancel()
    }

    /// A config value, or a default.
    pub fn config_u64(&self, key: &str, default: u64) -> u64 {
        self.config.get(key).and_then(Value::as_u64).unwrap_or(default)
    }
}

/// What a plugin implements.
pub trait Agent {
    fn run(turn: Turn) -> Result<String, String>;
}

#[doc(hidden)]
pub struct Adapter<A>(std::marker::PhantomData<A>);

impl<A: Agent> bindings::Guest for Adapter<A> {
    fn run(input: bindings::agent_host::plugin::types::RunInput) -> Result<String, String> {
        let config = serde_json::from_str(&input.config).unwrap_or(Value::Object(Default::default()));
        A::run(Turn {
            run_id: input.run_id,
            conversation_id: input.conversation_id,
            content: input.content,
            history: input.history,
            config,
        })
    }
}

/// Exports `$agent` (a type implementing [`Agent`]) as the component's `run`.
#[macro_export]
macro_rules! export_agent {
    ($agent:ty) => {
        type __AgentPluginAdapter = $crate::Adapter<$agent>;
        $crate::bindings::__export_agent_world!(__AgentPluginAdapter with_types_in $crate::bindings);
    };
}
