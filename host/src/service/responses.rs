//! The Responses API's requests as runs: a `POST /v1/responses` body becomes
//! one [`Submission`] for the enqueue service (`submit`), which every API
//! shares; nothing here enqueues, journals or changes a status itself.
//!
//! The mapping:
//! - `model` names the plugin; `input` (a string, or items: messages,
//!   `function_call` and `function_call_output`) is the turn: the last user
//!   message's text is the transcript's user message, and when the input is
//!   more than one user message the plugin also gets it as chat messages
//!   (config `input`); `instructions` and system or developer messages are
//!   its system prompt (config `system`); `function` tools are offered to
//!   the model (config `tools`, after the plugin config's own; none for
//!   `tool_choice: "none"`) and named as the client's (config
//!   `client_tools`: a call of one ends the turn with a `function_call` item);
//! - `previous_response_id` (the latest response of its conversation: no
//!   branches) or `conversation` continue a conversation (its next turn
//!   queues behind a running one); a `function_call_output` that
//!   answers a call of the previous response gets that call put back before
//!   it, so the model sees its own call and the answer;
//! - `store: false` is refused: every response is a durable run;
//! - `input_image` and `input_file` parts are accepted and given to the plugin
//!   as a marker (`[image]`, `[file]`): plugins take text;
//! - what the response object echoes (instructions, metadata, tools,
//!   tool_choice, previous_response_id, conversation, background) is kept in
//!   config `responses`, which is also what an Idempotency-Key replay compares;
//! - `config` (an agent-host extension, sent with the SDKs' `extra_body`) is
//!   the plugin's own config, beneath the keys above.

use serde::Deserialize;
use serde_json::{json, Map, Value};
use sqlx::PgPool;

use crate::agent::AgentRegistry;
use crate::db::enqueue::Owner;
use crate::db::responses::{self as rows, ResponseRow};
use crate::db::ConversationId;
use crate::run::config::RunConfig;
use crate::stream::responses::{function_calls, parse_response_id, view, REQUEST_KEY};
use crate::stream::tail::{TailError, Tails};
use crate::tools::{valid_tool_name, TOOL_NAME_BYTES_MAX};

use super::submit::{self, Busy, Policy, Submission, SubmitError};

/// Items of one request's `input`.
pub const INPUT_ITEMS_MAX: usize = 256;
/// Function tools of one request.
pub const TOOLS_MAX: usize = 128;
/// Metadata pairs, and the characters of a key and of a value (the
/// specification's bounds).
pub const METADATA_PAIRS_MAX: usize = 16;
pub const METADATA_KEY_CHARS_MAX: usize = 64;
pub const METADATA_VALUE_CHARS_MAX: usize = 512;

/// A `POST /v1/responses` body (fields this host does not use are ignored,
/// as the specification's clients send many).
#[derive(Debug, Clone, Deserialize)]
pub struct CreateResponse {
    pub model: String,
    #[serde(default)]
    pub input: Option<Value>,
    #[serde(default)]
    pub instructions: Option<String>,
    #[serde(default)]
    pub metadata: Option<Map<String, Value>>,
    #[serde(default)]
    pub previous_response_id: Option<String>,
    #[serde(default)]
    pub conversation: Option<Value>,
    #[serde(default)]
    pub store: Option<bool>,
    #[serde(default)]
    pub background: Option<bool>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// An agent-host extension (the SDKs send it with `extra_body`): the
    /// plugin's own config, beneath the keys this mapping sets.
    #[serde(default)]
    pub config: Option<Value>,
}

/// Why a request was refused: a message, the request field it names, and
/// whether the field names something missing (404) or is malformed (400).
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("{message}")]
    Invalid { message: String, param: Option<&'static str> },
    #[error("{message}")]
    NotFound { message: String, param: Option<&'static str> },
    #[error(transparent)]
    Submit(#[from] SubmitError),
    #[error(transparent)]
    Tail(#[from] TailError),
}

impl From<sqlx::Error> for RequestError {
    fn from(e: sqlx::Error) -> Self {
        RequestError::Submit(SubmitError::Db(e))
    }
}

fn invalid(param: &'static str, message: impl Into<String>) -> RequestError {
    RequestError::Invalid { message: message.into(), param: Some(param) }
}

/// A created response (or the one its Idempotency-Key created before).
#[derive(Debug, Clone)]
pub struct Created {
    pub row: ResponseRow,
    pub replayed: bool,
}

/// The turn a request asks for, in the plugin's terms.
#[derive(Debug, Default)]
struct Turn {
    system: Vec<String>,
    /// Chat messages (`{role, content}`, `{role: assistant, tool_calls}`,
    /// `{role: tool, tool_call_id, content}`).
    messages: Vec<Value>,
}

/// Enqueues the run a request asks for, through the enqueue service.
pub async fn create(
    pool: &PgPool,
    agents: &AgentRegistry,
    policy: &Policy,
    local: Option<&dyn submit::LocalWorker>,
    tails: &Tails,
    owner: &Owner,
    idempotency_key: Option<String>,
    req: &CreateResponse,
) -> Result<Created, RequestError> {
    if req.store == Some(false) {
        return Err(invalid(
            "store",
            "store: false is not supported: every response is a durable run, stored until retention; omit store \
             or set it to true",
        ));
    }
    if req.model.trim().is_empty() {
        return Err(invalid("model", "model must name a plugin"));
    }
    if req.previous_response_id.is_some() && req.conversation.is_some() {
        return Err(invalid("conversation", "give previous_response_id or conversation, not both"));
    }
    let metadata = metadata(req.metadata.as_ref())?;
    let (tools, mut offered, mut client_tools) = tools(req.tools.as_deref())?;
    // `tool_choice: "none"` is honoured by offering nothing; any other
    // choice is the model's to follow (echoed, not enforced).
    if req.tool_choice.as_ref().and_then(Value::as_str) == Some("none") {
        (offered, client_tools) = (Vec::new(), Vec::new());
    }
    let mut turn = input(req.input.as_ref())?;

    let (conversation_id, conversation) = match (&req.previous_response_id, &req.conversation) {
        (Some(prev), _) => {
            let row = previous(pool, owner, prev).await?;
            if !rows::is_latest_turn(pool, row.id).await? {
                return Err(invalid(
                    "previous_response_id",
                    format!(
                        "{prev} is not the latest response of its conversation: a conversation continues at its \
                         end (branching is not supported); name the latest response"
                    ),
                ));
            }
            put_back_calls(&mut turn, &function_calls(&view(tails, pool, &row).await?));
            (Some(row.conversation_id), Value::Null)
        }
        (None, Some(c)) => {
            let id = conversation_ref(c)?;
            (Some(id), json!({ "id": id }))
        }
        (None, None) => (None, Value::Null),
    };

    let content = transcript_text(&turn)?;
    let mut system = turn.system.clone();
    if let Some(i) = req.instructions.as_deref().filter(|i| !i.trim().is_empty()) {
        system.insert(0, i.to_string());
    }
    let mut config = match &req.config {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(c)) => c.clone(),
        Some(_) => return Err(invalid("config", "config (an agent-host extension) must be a JSON object")),
    };
    if !system.is_empty() {
        config.insert("system".into(), json!(system.join("\n\n")));
    }
    if !offered.is_empty() {
        // Beside any tools the plugin's own config (extra_body) offers.
        RunConfig::offer_client_tools(&mut config, offered, client_tools).map_err(|m| invalid("config", m))?;
    }
    // One user message is the turn's content itself; anything more goes as messages.
    let single_user = turn.messages.len() == 1 && turn.messages[0]["role"] == "user";
    if !single_user {
        config.insert("input".into(), json!(turn.messages));
    }
    config.insert(
        REQUEST_KEY.into(),
        json!({
            "instructions": req.instructions,
            "metadata": metadata,
            "tools": tools,
            "tool_choice": req.tool_choice.clone().unwrap_or_else(|| json!("auto")),
            "previous_response_id": req.previous_response_id,
            "conversation": conversation,
            "background": req.background.unwrap_or(false),
        }),
    );
    let submission = Submission {
        owner: owner.clone(),
        conversation_id,
        content,
        plugin: req.model.clone(),
        config: Some(Value::Object(config)),
        idempotency_key,
        webhook: None,
        strategy: Busy::Enqueue,
        parent: None,
    };
    let submitted = match submit::submit(pool, agents, policy, &submission, local).await {
        Ok(s) => s,
        Err(SubmitError::UnknownPlugin { plugin, available }) => {
            return Err(RequestError::NotFound {
                message: format!("model {plugin:?} not found; available: {}", available.join(", ")),
                param: Some("model"),
            })
        }
        Err(SubmitError::ConversationNotFound(id)) => {
            return Err(RequestError::NotFound {
                message: format!("conversation {id} not found"),
                param: Some("conversation"),
            })
        }
        Err(e) => return Err(e.into()),
    };
    let run = submitted.enqueued().run_id;
    let row = rows::get(pool, run, &owner.user_id)
        .await?
        .ok_or_else(|| RequestError::NotFound { message: format!("response {run} not found"), param: None })?;
    Ok(Created { row, replayed: submitted.replayed() })
}

/// The previous response, as its owner sees it.
async fn previous(pool: &PgPool, owner: &Owner, id: &str) -> Result<ResponseRow, RequestError> {
    let not_found = || RequestError::NotFound {
        message: format!("previous response {id:?} not found"),
        param: Some("previous_response_id"),
    };
    let run = parse_response_id(id).ok_or_else(not_found)?;
    rows::get(pool, run, &owner.user_id).await?.ok_or_else(not_found)
}

/// `conversation`: a conversation id, or `{id}`.
fn conversation_ref(c: &Value) -> Result<ConversationId, RequestError> {
    let raw = match c {
        Value::String(s) => s.as_str(),
        Value::Object(o) => o.get("id").and_then(Value::as_str).unwrap_or_default(),
        _ => "",
    };
    raw.strip_prefix("conv_")
        .unwrap_or(raw)
        .parse()
        .map_err(|_| invalid("conversation", format!("conversation must be a conversation id or {{id}}, not {c}")))
}

fn metadata(m: Option<&Map<String, Value>>) -> Result<Value, RequestError> {
    let Some(m) = m else { return Ok(json!({})) };
    if m.len() > METADATA_PAIRS_MAX {
        return Err(invalid("metadata", format!("metadata has {} pairs; the limit is {METADATA_PAIRS_MAX}", m.len())));
    }
    for (k, v) in m {
        let Some(v) = v.as_str() else {
            return Err(invalid("metadata", format!("metadata value of {k:?} must be a string")));
        };
        if k.chars().count() > METADATA_KEY_CHARS_MAX || v.chars().count() > METADATA_VALUE_CHARS_MAX {
            return Err(invalid(
                "metadata",
                format!(
                    "metadata keys are at most {METADATA_KEY_CHARS_MAX} characters, values {METADATA_VALUE_CHARS_MAX}"
                ),
            ));
        }
    }
    Ok(Value::Object(m.clone()))
}

/// The request's tools: as the response echoes them, as the model is
/// offered them (`{name, description, parameters}`), and their names.
fn tools(tools: Option<&[Value]>) -> Result<(Vec<Value>, Vec<Value>, Vec<String>), RequestError> {
    let tools = tools.unwrap_or_default();
    if tools.len() > TOOLS_MAX {
        return Err(invalid("tools", format!("{} tools; the limit is {TOOLS_MAX}", tools.len())));
    }
    let (mut echoed, mut offered, mut names) = (Vec::new(), Vec::new(), Vec::new());
    for t in tools {
        let kind = t.get("type").and_then(Value::as_str).unwrap_or_default();
        if kind != "function" {
            return Err(invalid("tools", format!("tools of type {kind:?} are not supported; only \"function\"")));
        }
        let name = t.get("name").and_then(Value::as_str).unwrap_or_default();
        if !valid_tool_name(name) {
            return Err(invalid(
                "tools",
                format!("a function's name is 1-{TOOL_NAME_BYTES_MAX} of a-z, A-Z, 0-9, _ and -, not {name:?}"),
            ));
        }
        if names.iter().any(|n| n == name) {
            return Err(invalid("tools", format!("function {name:?} is offered twice")));
        }
        let field = |k: &str| t.get(k).cloned().unwrap_or(Value::Null);
        echoed.push(json!({ "type": "function", "name": name, "description": field("description"),
                            "parameters": field("parameters"), "strict": field("strict") }));
        let mut o = json!({ "name": name });
        if let Some(d) = t.get("description").filter(|d| d.is_string()) {
            o["description"] = d.clone();
        }
        if let Some(p) = t.get("parameters").filter(|p| p.is_object()) {
            o["parameters"] = p.clone();
        }
        offered.push(o);
        names.push(name.to_string());
    }
    Ok((echoed, offered, names))
}

/// `input` as a system prompt and chat messages.
fn input(input: Option<&Value>) -> Result<Turn, RequestError> {
    let mut turn = Turn::default();
    match input {
        None | Some(Value::Null) => return Err(invalid("input", "input is required: a string or a list of items")),
        Some(Value::String(s)) => turn.messages.push(json!({ "role": "user", "content": s })),
        Some(Value::Array(items)) => {
            if items.len() > INPUT_ITEMS_MAX {
                return Err(invalid("input", format!("{} input items; the limit is {INPUT_ITEMS_MAX}", items.len())));
            }
            for item in items {
                item_into(&mut turn, item)?;
            }
        }
        Some(other) => return Err(invalid("input", format!("input must be a string or a list of items, not {other}"))),
    }
    Ok(turn)
}

fn item_into(turn: &mut Turn, item: &Value) -> Result<(), RequestError> {
    let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
    match kind {
        "message" => {
            let role = item.get("role").and_then(Value::as_str).unwrap_or_default();
            let text = message_text(item.get("content"))?;
            match role {
                "system" | "developer" => turn.system.push(text),
                "user" | "assistant" => turn.messages.push(json!({ "role": role, "content": text })),
                other => {
                    return Err(invalid(
                        "input",
                        format!("a message's role is user, assistant, system or developer, not {other:?}"),
                    ))
                }
            }
        }
        "function_call" => {
            let s = |k: &str| item.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
            let (call_id, name) = (s("call_id"), s("name"));
            if call_id.is_empty() || name.is_empty() {
                return Err(invalid("input", "a function_call item needs call_id and name"));
            }
            let call = json!({ "id": call_id, "name": name, "arguments": s("arguments") });
            // Calls of one model answer are one assistant message.
            match turn.messages.last_mut() {
                Some(last) if last["role"] == "assistant" && last.get("tool_calls").is_some() => {
                    last["tool_calls"].as_array_mut().expect("tool_calls is a list").push(call);
                }
                _ => turn.messages.push(json!({ "role": "assistant", "content": "", "tool_calls": [call] })),
            }
        }
        "function_call_output" => {
            let call_id = item.get("call_id").and_then(Value::as_str).unwrap_or_default();
            if call_id.is_empty() {
                return Err(invalid("input", "a function_call_output item needs call_id"));
            }
            let output = match item.get("output") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(_)) => message_text(item.get("output"))?,
                Some(other) => other.to_string(),
                None => return Err(invalid("input", "a function_call_output item needs output")),
            };
            turn.messages.push(json!({ "role": "tool", "tool_call_id": call_id, "content": output }));
        }
        other => return Err(invalid("input", format!("input items of type {other:?} are not supported"))),
    }
    Ok(())
}

/// A message's content as text: a string, or its parts' text joined.
fn message_text(content: Option<&Value>) -> Result<String, RequestError> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = Vec::new();
            for p in parts {
                match p.get("type").and_then(Value::as_str).unwrap_or_default() {
                    "input_text" | "output_text" | "text" | "summary_text" | "reasoning_text" | "refusal" => {
                        let t = p.get("text").or_else(|| p.get("refusal")).and_then(Value::as_str).unwrap_or_default();
                        out.push(t.to_string());
                    }
                    "input_image" => out.push("[image]".into()),
                    "input_file" => out.push("[file]".into()),
                    other => {
                        return Err(invalid("input", format!("content parts of type {other:?} are not supported")))
                    }
                }
            }
            Ok(out.join("\n"))
        }
        _ => Err(invalid("input", "a message's content is a string or a list of parts")),
    }
}

/// Before a `function_call_output` whose call is not in the input, the
/// call itself from the previous response (so the model sees both).
fn put_back_calls(turn: &mut Turn, previous: &[(String, String, String)]) {
    let given: Vec<String> = turn
        .messages
        .iter()
        .flat_map(|m| m.get("tool_calls").and_then(Value::as_array).cloned().unwrap_or_default())
        .filter_map(|c| c["id"].as_str().map(str::to_string))
        .collect();
    let answered: Vec<&str> = turn
        .messages
        .iter()
        .filter(|m| m["role"] == "tool")
        .filter_map(|m| m["tool_call_id"].as_str())
        .filter(|id| !given.iter().any(|g| g == id))
        .collect();
    let calls: Vec<Value> = previous
        .iter()
        .filter(|(id, _, _)| answered.contains(&id.as_str()))
        .map(|(id, name, args)| json!({ "id": id, "name": name, "arguments": args }))
        .collect();
    if calls.is_empty() {
        return;
    }
    let at = turn.messages.iter().position(|m| m["role"] == "tool").unwrap_or(0);
    turn.messages.insert(at, json!({ "role": "assistant", "content": "", "tool_calls": calls }));
}

/// The text the transcript keeps as this turn's user message: the last user
/// message, else the function outputs the turn answers with.
fn transcript_text(turn: &Turn) -> Result<String, RequestError> {
    if let Some(m) = turn.messages.iter().rev().find(|m| m["role"] == "user") {
        return Ok(m["content"].as_str().unwrap_or_default().to_string());
    }
    let outputs: Vec<String> = turn
        .messages
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            format!(
                "function_call_output {}: {}",
                m["tool_call_id"].as_str().unwrap_or_default(),
                m["content"].as_str().unwrap_or_default()
            )
        })
        .collect();
    if outputs.is_empty() {
        return Err(invalid("input", "input needs a user message or a function_call_output"));
    }
    Ok(outputs.join("\n"))
}

/// A response's input as items (`GET /v1/responses/{id}/input_items`), rebuilt
/// from what the run keeps: its config's messages, or its user message.
pub fn input_items(row: &ResponseRow) -> Vec<Value> {
    let hex = row.id.0.simple();
    let messages = match row.config.get("input").and_then(Value::as_array) {
        Some(m) => m.clone(),
        None => vec![json!({ "role": "user", "content": row.content })],
    };
    let mut items = Vec::new();
    for m in messages {
        let n = items.len();
        match m["role"].as_str().unwrap_or_default() {
            "tool" => items.push(json!({ "type": "function_call_output", "id": format!("fco_{hex}_{n}"),
                "call_id": m["tool_call_id"], "output": m["content"], "status": "completed" })),
            "assistant" if m.get("tool_calls").is_some() => {
                for c in m["tool_calls"].as_array().cloned().unwrap_or_default() {
                    let n = items.len();
                    items.push(json!({ "type": "function_call", "id": format!("fc_{hex}_in_{n}"),
                        "call_id": c["id"], "name": c["name"], "arguments": c["arguments"], "status": "completed" }));
                }
            }
            role => {
                let part = if role == "assistant" { "output_text" } else { "input_text" };
                items.push(json!({ "type": "message", "id": format!("msg_{hex}_in_{n}"), "role": role,
                    "status": "completed", "content": [{ "type": part, "text": m["content"] }] }));
            }
        }
    }
    items
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_items_become_a_system_prompt_and_messages() {
        let turn = input(Some(&json!([
            { "type": "message", "role": "developer", "content": "be brief" },
            { "role": "user", "content": [{ "type": "input_text", "text": "look" }, { "type": "input_image", "image_url": "data:," }] },
            { "type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}" },
            { "type": "function_call_output", "call_id": "c1", "output": "42" },
        ])))
        .unwrap();
        assert_eq!(turn.system, ["be brief"]);
        assert_eq!(turn.messages[0], json!({ "role": "user", "content": "look\n[image]" }));
        assert_eq!(turn.messages[1]["tool_calls"][0]["id"], "c1");
        assert_eq!(turn.messages[2], json!({ "role": "tool", "tool_call_id": "c1", "content": "42" }));
        assert_eq!(transcript_text(&turn).unwrap(), "look\n[image]");
    }

    #[test]
    fn an_answer_to_the_previous_responses_call_gets_the_call_put_back() {
        let mut turn =
            input(Some(&json!([{ "type": "function_call_output", "call_id": "call_1", "output": "sunny" }]))).unwrap();
        put_back_calls(&mut turn, &[("call_1".into(), "weather".into(), "{\"input\":\"x\"}".into())]);
        assert_eq!(turn.messages[0]["role"], "assistant");
        assert_eq!(turn.messages[0]["tool_calls"][0]["name"], "weather");
        assert_eq!(turn.messages[1]["role"], "tool");
        assert_eq!(transcript_text(&turn).unwrap(), "function_call_output call_1: sunny");
    }

    #[test]
    fn bad_input_names_its_field() {
        for (bad, param) in [
            (json!(7), "input"),
            (json!([{ "type": "reasoning" }]), "input"),
            (json!([{ "role": "critic", "content": "x" }]), "input"),
        ] {
            match input(Some(&bad)) {
                Err(RequestError::Invalid { param: p, .. }) => assert_eq!(p, Some(param)),
                other => panic!("{bad}: {other:?}"),
            }
        }
        assert!(tools(Some(&[json!({ "type": "web_search" })])).is_err());
        assert!(tools(Some(&[json!({ "type": "function", "name": "a b" })])).is_err());
    }
}
