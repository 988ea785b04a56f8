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
    // The world is the crate's own copy of wit/0.2.0 (a packaged crate
    // carries no path outside itself; tests/projects.rs holds the copy equal
    // to the original, byte for byte).
    wit_bindgen::generate!({
        path: "wit",
        world: "agent",
        pub_export_macro: true,
        export_macro_name: "__export_agent_world",
        default_bindings_module: "agent_plugin::bindings",
    });
}

use std::cell::RefCell;

use bindings::agent_host::plugin::host;
pub use bindings::agent_host::plugin::types::{ClientCall, ClientTool, HostError, Message, ToolInfo};
pub use serde_json::{self, json, Value};

/// Client calls a turn ends with; at most this many.
pub const CLIENT_CALLS_MAX: usize = 64;

/// The longest tool name a model takes (the `llm` tool's bound).
pub const MODEL_NAME_BYTES_MAX: usize = 64;

thread_local! {
    /// The calls of client functions this turn ends with (a guest is one thread).
    static CLIENT_CALLS: RefCell<Vec<ClientCall>> = const { RefCell::new(Vec::new()) };
    /// The names [`Turn::model_tools`] gave the model, each with its host tool's.
    static MODEL_NAMES: RefCell<Vec<(String, String)>> = const { RefCell::new(Vec::new()) };
}

/// A host tool's name as a model takes it: 1-64 letters, digits, `_` and
/// `-`. Another character (the `.` of `<server>.<tool>`) becomes `_`; a
/// longer name is cut and ends with `_` and a hash of the whole name
/// (FNV-1a, 32 bits: the same in every SDK, on every host).
pub fn model_name(name: &str) -> String {
    let clean: String =
        name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '-' { c } else { '_' }).collect();
    if !clean.is_empty() && clean.len() <= MODEL_NAME_BYTES_MAX {
        return clean;
    }
    let hash = name.bytes().fold(0x811c_9dc5u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193));
    let suffix = format!("_{hash:08x}");
    // `clean` is ASCII: any byte index is a character boundary.
    let keep = clean.len().min(MODEL_NAME_BYTES_MAX - suffix.len());
    format!("{}{suffix}", &clean[..keep])
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
    /// `name` is the host's, or the one [`Turn::model_tools`] gave the model.
    pub fn call_tool(&self, name: &str, args: &Value) -> Result<Value, Refusal> {
        let host_name = MODEL_NAMES
            .with(|names| names.borrow().iter().find(|(offered, _)| offered == name).map(|(_, host)| host.clone()));
        let out = host::call_tool(host_name.as_deref().unwrap_or(name), &args.to_string())?;
        serde_json::from_str(&out).map_err(|e| Refusal(HostError::ToolFailed(format!("tool answered non-JSON: {e}"))))
    }

    /// The host tools this plugin was granted, with their descriptions and
    /// input schemas (an MCP server's tools among them, as
    /// `<server>.<tool>`): what [`Turn::call_tool`] may reach.
    pub fn granted_tools(&self) -> Vec<ToolInfo> {
        host::list_tools()
    }

    /// The granted tools to offer a model, as the `llm` tool's `tools` takes
    /// them (`{name, description, parameters}`): every granted tool but the
    /// model itself and `wait`, each named as a model accepts (`py.echo` is
    /// offered as `py_echo`); [`Turn::call_tool`] takes the offered name. Add
    /// [`Turn::client_tools`] for the client's functions.
    pub fn model_tools(&self) -> Vec<Value> {
        let mut offered = Vec::new();
        MODEL_NAMES.with(|names| {
            let mut names = names.borrow_mut();
            // Called again in a turn, it offers the same list (names seen in
            // this call are skipped, not those of an earlier call).
            let mut seen = Vec::new();
            for t in self.granted_tools().into_iter().filter(|t| t.name != "llm" && t.name != "wait") {
                let name = model_name(&t.name);
                if seen.contains(&name) {
                    continue;
                }
                seen.push(name.clone());
                let parameters: Value =
                    serde_json::from_str(&t.input_schema).unwrap_or_else(|_| json!({ "type": "object" }));
                offered.push(json!({ "name": name, "description": t.description, "parameters": parameters }));
                if !names.iter().any(|(n, _)| *n == name) {
                    names.push((name, t.name));
                }
            }
        });
        offered
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

    /// The instructions queued for this turn since the last take
    /// (`POST /v1/runs/{id}/steer`), oldest first, each taken once: append
    /// them to the model's context before its next call. A resumed run takes
    /// the same ones at the same point. Empty when none are queued.
    pub fn take_instructions(&self) -> Result<Vec<String>, Refusal> {
        let out = host::call_tool("take-instructions", "{}")?;
        let taken: Value = serde_json::from_str(&out)
            .map_err(|e| Refusal(HostError::ToolFailed(format!("instructions answered non-JSON: {e}"))))?;
        let list = taken["instructions"].as_array().cloned().unwrap_or_default();
        Ok(list.into_iter().filter_map(|i| i.as_str().map(str::to_string)).collect())
    }

    /// Starts a child run of `plugin` (a sub-agent; the manifest grants
    /// `agent:<plugin>`) with `input` as its user message and `config`, and
    /// answers its run id at once; [`Turn::await_agents`] waits for it. A
    /// resumed run never starts the same child twice.
    pub fn start_agent(&self, plugin: &str, input: &str, config: Option<&Value>) -> Result<String, Refusal> {
        let mut args = serde_json::json!({ "input": input });
        if let Some(config) = config {
            args["config"] = config.clone();
        }
        let out = host::call_tool(&format!("agent:{plugin}"), &args.to_string())?;
        let started: Value = serde_json::from_str(&out)
            .map_err(|e| Refusal(HostError::ToolFailed(format!("agent start answered non-JSON: {e}"))))?;
        Ok(started["run_id"].as_str().unwrap_or_default().to_string())
    }

    /// Waits for child runs this run started (every one when `runs` is
    /// empty): all of them (`any` false) or the first to end (`any` true),
    /// suspended with nothing held meanwhile. Answers each awaited child:
    /// `{run_id, plugin, conversation_id, status, output, error}`; a failed
    /// child is a value here, not this run's failure.
    pub fn await_agents(&self, runs: &[String], any: bool) -> Result<Vec<Value>, Refusal> {
        let args = serde_json::json!({ "runs": runs, "mode": if any { "any" } else { "all" } });
        let out = host::call_tool("await-agents", &args.to_string())?;
        let joined: Value = serde_json::from_str(&out)
            .map_err(|e| Refusal(HostError::ToolFailed(format!("await-agents answered non-JSON: {e}"))))?;
        Ok(joined["runs"].as_array().cloned().unwrap_or_default())
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
        MODEL_NAMES.with(|n| n.borrow_mut().clear());
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

#[cfg(test)]
mod tests {
    use super::model_name;

    #[test]
    fn every_offered_name_is_one_the_llm_tool_accepts() {
        assert_eq!(model_name("docs.search"), "docs_search");
        let long = format!("docs.{}", "x".repeat(120));
        let other = format!("docs.{}y", "x".repeat(119));
        let (a, b) = (model_name(&long), model_name(&other));
        assert_eq!(a.len(), 64);
        assert_ne!(a, b, "two long names stay apart");
        assert!(a.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-'), "{a}");
        assert_eq!(model_name(&long), a, "the same name maps the same way");
        // The same vector as the Python and JavaScript SDKs' model_name.
        assert_eq!(a, format!("docs_{}_9741d434", "x".repeat(50)));
        assert_eq!(model_name("é.x"), "__x");
    }
}
