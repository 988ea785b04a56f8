//! A run's config as the host reads it: the JSON object the client posted
//! (or the Responses API wrote), parsed once when the run is claimed. The
//! agent sees the whole object (it derefs to it); the host's own keys are
//! read here alone: `require_approval` (tool names whose calls wait for a
//! person on this run) and `client_tools` with their descriptions in `tools`
//! (functions the client runs, offered to a 0.2.0 guest).

use serde_json::{json, Map, Value};

/// The key naming the tools whose calls wait for approval on this run.
pub const REQUIRE_APPROVAL: &str = "require_approval";
/// The key naming the client's functions (their descriptions are in `tools`).
pub const CLIENT_TOOLS: &str = "client_tools";
/// The key of the tools offered to the model, client functions among them.
pub const TOOLS: &str = "tools";
/// Names `require_approval` may hold at most (the rest are ignored).
pub const REQUIRE_APPROVAL_MAX: usize = 256;

/// A function the client runs: the turn ends with its calls.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientTool {
    pub name: String,
    pub description: Option<String>,
    /// Its parameters' JSON Schema, as JSON text (`{}` when none was given).
    pub parameters: String,
}

/// A run's config, parsed once.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RunConfig {
    raw: Value,
    pub require_approval: Vec<String>,
    pub client_tools: Vec<ClientTool>,
}

impl RunConfig {
    pub fn parse(raw: Value) -> RunConfig {
        let strings = |key: &str| -> Vec<String> {
            let items = raw.get(key).and_then(Value::as_array).into_iter().flatten();
            items.filter_map(|n| n.as_str().map(str::to_string)).collect()
        };
        let require_approval = strings(REQUIRE_APPROVAL).into_iter().take(REQUIRE_APPROVAL_MAX).collect();
        let described = raw.get(TOOLS).and_then(Value::as_array).cloned().unwrap_or_default();
        let client_tools = strings(CLIENT_TOOLS)
            .into_iter()
            .map(|name| {
                let tool = described.iter().find(|t| t.get("name").and_then(Value::as_str) == Some(name.as_str()));
                let field = |k: &str| tool.and_then(|t| t.get(k));
                ClientTool {
                    description: field("description").and_then(Value::as_str).map(str::to_string),
                    parameters: field("parameters").map_or_else(|| "{}".to_string(), Value::to_string),
                    name,
                }
            })
            .collect();
        RunConfig { raw, require_approval, client_tools }
    }

    /// Writes client functions into a config being made (the Responses
    /// API's `function` tools): their descriptions beside the tools already
    /// offered, their names as the client's.
    pub fn offer_client_tools(
        config: &mut Map<String, Value>,
        described: Vec<Value>,
        names: Vec<String>,
    ) -> Result<(), String> {
        let mut all = match config.get(TOOLS) {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(t)) => t.clone(),
            Some(_) => return Err(format!("config.{TOOLS} must be a list")),
        };
        all.extend(described);
        config.insert(TOOLS.into(), json!(all));
        config.insert(CLIENT_TOOLS.into(), json!(names));
        Ok(())
    }
}

/// The agent sees the config as posted.
impl std::ops::Deref for RunConfig {
    type Target = Value;

    fn deref(&self) -> &Value {
        &self.raw
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hosts_keys_are_read_once_and_the_rest_is_the_agents() {
        let c = RunConfig::parse(json!({
            "steps": 3,
            "require_approval": ["send", 7, "pay"],
            "client_tools": ["lookup", "ghost"],
            "tools": [{ "name": "lookup", "description": "find", "parameters": { "type": "object" } }],
        }));
        assert_eq!(c.require_approval, ["send", "pay"]);
        let lookup = ClientTool {
            name: "lookup".into(),
            description: Some("find".into()),
            parameters: r#"{"type":"object"}"#.into(),
        };
        let ghost = ClientTool { name: "ghost".into(), description: None, parameters: "{}".into() };
        assert_eq!(c.client_tools, [lookup, ghost]);
        assert_eq!(c.get("steps"), Some(&json!(3)));
        let many: Vec<String> = (0..300).map(|i| format!("t{i}")).collect();
        assert_eq!(RunConfig::parse(json!({ "require_approval": many })).require_approval.len(), REQUIRE_APPROVAL_MAX);
        let mut made = Map::new();
        made.insert("tools".into(), json!([{ "name": "own" }]));
        RunConfig::offer_client_tools(&mut made, vec![json!({ "name": "f" })], vec!["f".into()]).unwrap();
        let back = RunConfig::parse(Value::Object(made));
        assert_eq!(back.client_tools.len(), 1);
        assert_eq!(back.get("tools").unwrap().as_array().unwrap().len(), 2);
        let mut bad = Map::new();
        bad.insert("tools".into(), json!("x"));
        assert_eq!(RunConfig::offer_client_tools(&mut bad, vec![], vec![]).unwrap_err(), "config.tools must be a list");
    }
}
