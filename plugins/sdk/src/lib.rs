//! The guest side of agent-host: write one function from a turn's input to its
//! answer, and export it with [`export_agent!`]. Built against the
//! `agent-host:plugin@0.2.0` world: a turn may also end with calls of the
//! functions its client runs ([`Turn::client_tools`], [`Turn::call_client`]).
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
        path: "../../wit/0.2.0",
        world: "agent",
        pub_export_macro: true,
        export_macro_name: "__export_agent_world",
        default_bindings_module: "agent_plugin::bindings",
    });
}

use std::cell::RefCell;

use bindings::agent_host::plugin::host;
pub use bindings::agent_host::plugin::types::{ClientCall, ClientTool, HostError, Message, ToolInfo};
pub use serde_json::{json, Value};

/// Client calls a turn ends with; at most this many.
pub const CLIENT_CALLS_MAX: usize = 64;

thread_local! {
    /// The calls of client functions this turn ends with (a guest is one thread).
    static CLIENT_CALLS: RefCell<Vec<ClientCall>> = const { RefCell::new(Vec::new()) };
}

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
    /// Functions the run's client runs itself: offer them to the model, and
    /// end the turn with [`Turn::call_client`] when it calls one.
    pub client_tools: Vec<ClientTool>,
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

    /// The host tools this plugin was granted, with their descriptions and
    /// input schemas (an MCP server's tools among them, as
    /// `<server>.<tool>`): what [`Turn::call_tool`] may reach.
    pub fn granted_tools(&self) -> Vec<ToolInfo> {
        host::list_tools()
    }

    /// Whether `name` is a function the client runs.
    pub fn is_client_tool(&self, name: &str) -> bool {
        self.client_tools.iter().any(|t| t.name == name)
    }

    /// Adds a call of a client's function to the calls this turn ends with
    /// (return soon after: the client answers them in its next turn).
    pub fn call_client(&self, call_id: &str, name: &str, arguments: &str) -> Result<(), Refusal> {
        if !self.is_client_tool(name) {
            return Err(Refusal(HostError::Invalid(format!("{name:?} is not a function the client runs"))));
        }
        CLIENT_CALLS.with(|calls| {
            let mut calls = calls.borrow_mut();
            if calls.len() >= CLIENT_CALLS_MAX {
                return Err(Refusal(HostError::Limit(format!("at most {CLIENT_CALLS_MAX} client calls a turn"))));
            }
            calls.push(ClientCall { call_id: call_id.into(), name: name.into(), arguments: arguments.into() });
            Ok(())
        })
    }

    /// Whether a stop was requested: return soon (the host interrupts a guest
    /// that does not).
    pub fn cancelled(&self) -> bool {
        host::check_cancel()
    }

    /// `Err(cancelled)` when a stop was requested (as the Python and
    /// JavaScript SDKs' `check_cancel`/`checkCancel`): `?` ends the turn.
    pub fn check_cancel(&self) -> Result<(), Refusal> {
        match self.cancelled() {
            true => Err(Refusal(HostError::Cancelled)),
            false => Ok(()),
        }
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
    fn run(
        input: bindings::agent_host::plugin::types::RunInput,
    ) -> Result<bindings::agent_host::plugin::types::TurnOutput, String> {
        let config = serde_json::from_str(&input.config).unwrap_or(Value::Object(Default::default()));
        CLIENT_CALLS.with(|c| c.borrow_mut().clear());
        let text = A::run(Turn {
            run_id: input.run_id,
            conversation_id: input.conversation_id,
            content: input.content,
            history: input.history,
            config,
            client_tools: input.client_tools,
        })?;
        let client_calls = CLIENT_CALLS.with(|c| std::mem::take(&mut *c.borrow_mut()));
        Ok(bindings::agent_host::plugin::types::TurnOutput { text, client_calls })
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
