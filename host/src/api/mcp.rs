//! The MCP server (Streamable HTTP, protocol 2025-11-25 and 2025-06-18) at
//! `POST /mcp`: every agent a token may run is a tool. `tools/list` lists
//! them, each with an input schema from its manifest (a `prompt`, optional
//! `config` as `config_schema` says, optional `conversation_id`);
//! `tools/call` enqueues a run through the one enqueue service
//! (`service::submit`) and answers with its final text, as a stream of
//! `notifications/progress` carrying the streamed text first when the
//! client gave a `progressToken`. A call the client asks to be a task (the
//! 2025-11-25 `task` param) answers its task at once; the task id is the run
//! id, so `tasks/get`, `tasks/result` (waits for the end), `tasks/cancel` (a
//! durable stop) and `tasks/list` are reads of the run's row and journal
//! (`stream::mcp`), answered by any process, to a client that comes back on
//! a new connection as well as to the one that asked.
//!
//! The server is stateless: no session id, no server-to-client stream
//! (`GET` is 405), every request authenticated by its bearer token before
//! its body is read. Idempotency (an `Idempotency-Key` header), quotas, the
//! busy-conversation strategy (enqueue) and approvals apply unchanged: a run
//! waiting for a person is `input_required`, decided through the native API.
//! Batches (removed in 2025-06-18) are refused.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use serde_json::{json, Value};

use crate::db::tasks::{self, TaskRow};
use crate::db::tokens::Principal;
use crate::db::{ConversationId, RunId};
use crate::service::submit::{self, Busy, Submission};
use crate::stream::a2a::{fold, Folded};
use crate::stream::mcp as view;
use crate::stream::tail::{Item, Reserved};

use super::a2a::{find_agent, Agent};
use super::jsonrpc::{
    http_error, rpc_error, RpcError, INTERNAL_ERROR, INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR,
};
use super::runs::{cancel, owner};
use super::{ApiError, AppState, Auth, ErrorCode, BODY_BYTES_MAX};

/// The protocol versions served, newest first: the first is offered to a
/// client that asks for another.
pub const PROTOCOL_VERSIONS: [&str; 2] = ["2025-11-25", "2025-06-18"];
/// The version whose `tasks` utility is served.
const TASKS_VERSION: &str = "2025-11-25";
/// Tools a `tools/list` page holds, and tasks a `tasks/list` page.
const TOOLS_PAGE: i64 = 100;
const TASKS_PAGE: i64 = 50;
/// How long `tasks/cancel` waits for the run to wind down before answering
/// its task as it stands (the stop is durable and goes on).
const CANCEL_SETTLE_MAX: Duration = Duration::from_secs(10);

fn error_response(id: &Value, e: RpcError) -> Response {
    match e {
        RpcError::Rpc { code, message } => Json(rpc_error(id, code, &message)).into_response(),
        RpcError::Http(e) => http_error(e),
    }
}

fn result_response(id: &Value, result: Value) -> Response {
    Json(json!({ "jsonrpc": "2.0", "id": id, "result": result })).into_response()
}

/// A malformed message: 400 with a JSON-RPC error (no id to answer).
fn bad_message(code: i64, message: &str) -> Response {
    (StatusCode::BAD_REQUEST, Json(rpc_error(&Value::Null, code, message))).into_response()
}

/// `GET /mcp` and `DELETE /mcp`: no server-to-client stream and no session
/// to end (the server is stateless): 405, after the token is checked.
pub async fn not_served(auth: Result<Auth, ApiError>) -> Response {
    if let Err(e) = auth {
        return http_error(e);
    }
    let mut res =
        ApiError::new(ErrorCode::MethodNotAllowed, "this MCP server is stateless: POST JSON-RPC messages to /mcp")
            .into_response();
    res.headers_mut().insert(header::ALLOW, HeaderValue::from_static("POST"));
    res
}

/// `POST /mcp`: one JSON-RPC message. The token is checked before the body
/// is read.
pub async fn post(State(state): State<AppState>, auth: Result<Auth, ApiError>, request: Request) -> Response {
    let Auth(p) = match auth {
        Ok(a) => a,
        Err(e) => return http_error(e),
    };
    let (parts, body) = request.into_parts();
    let body: Bytes = match axum::body::to_bytes(body, BODY_BYTES_MAX).await {
        Ok(b) => b,
        Err(_) => return http_error(ApiError::too_large(format!("a message is at most {BODY_BYTES_MAX} bytes"))),
    };
    let Ok(message) = serde_json::from_slice::<Value>(&body) else {
        return bad_message(PARSE_ERROR, "the body is not JSON");
    };
    if !message.is_object() || message["jsonrpc"] != "2.0" {
        return bad_message(INVALID_REQUEST, "one JSON-RPC 2.0 message is expected (batches are not served)");
    }
    let Some(method) = message["method"].as_str() else {
        // A response to a request of ours: this server sends none.
        return StatusCode::ACCEPTED.into_response();
    };
    let id = match message.get("id") {
        None => return StatusCode::ACCEPTED.into_response(), // a notification
        Some(id @ (Value::String(_) | Value::Number(_))) => id.clone(),
        Some(_) => return bad_message(INVALID_REQUEST, "a request's id is a string or a number"),
    };
    let headers = &parts.headers;
    let version = headers.get("mcp-protocol-version").and_then(|v| v.to_str().ok()).map(str::trim);
    if let Some(v) = version.filter(|_| !matches!(method, "initialize" | "server/discover")) {
        if !PROTOCOL_VERSIONS.contains(&v) {
            let message = format!("MCP-Protocol-Version {v} is not served; {} are", PROTOCOL_VERSIONS.join(" and "));
            return (StatusCode::BAD_REQUEST, Json(rpc_error(&id, INVALID_REQUEST, &message))).into_response();
        }
    }
    let params = match &message["params"] {
        Value::Null => json!({}),
        v @ Value::Object(_) => v.clone(),
        _ => return error_response(&id, RpcError::new(INVALID_PARAMS, "params must be an object")),
    };
    // Without the header a client has not negotiated: it gets what 2025-11-25 offers.
    let tasks = version.is_none_or(|v| v == TASKS_VERSION);
    let calls = Calls { state: &state, p: &p, id: &id, tasks };
    let answer = match method {
        "initialize" => Ok(calls.initialize(&params)),
        "ping" => Ok(result_response(&id, json!({}))),
        "tools/list" => calls.list_tools(&params).await,
        "tools/call" => calls.call_tool(&params, headers).await,
        "tasks/get" if tasks => calls.get_task(&params).await,
        "tasks/result" if tasks => calls.task_result(&params).await,
        "tasks/cancel" if tasks => calls.cancel_task(&params).await,
        "tasks/list" if tasks => calls.list_tasks(&params).await,
        other => Err(RpcError::new(METHOD_NOT_FOUND, format!("method {other:?} not found"))),
    };
    answer.unwrap_or_else(|e| error_response(&id, e))
}

fn optional_str<'a>(v: &'a Value, name: &str) -> Result<Option<&'a str>, RpcError> {
    match &v[name] {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s)),
        _ => Err(RpcError::new(INVALID_PARAMS, format!("{name} must be a string"))),
    }
}

fn task_id(params: &Value) -> Result<RunId, RpcError> {
    let raw = optional_str(params, "taskId")?.ok_or_else(|| RpcError::new(INVALID_PARAMS, "taskId is missing"))?;
    raw.parse().map_err(|_| not_found(raw))
}

fn not_found(task: impl std::fmt::Display) -> RpcError {
    RpcError::new(INVALID_PARAMS, format!("task {task} not found"))
}

/// An agent as a tool: its name, its description, and the arguments a run
/// takes (the config's schema from its manifest when it declares one).
fn tool(agent: &Agent, tasks: bool) -> Value {
    let description = match agent.manifest["description"].as_str() {
        Some(d) => d.to_string(),
        None => format!("The agent {}: the prompt is one turn, the answer its final text", agent.name),
    };
    let config = match &agent.manifest["config_schema"] {
        Value::Object(schema) => Value::Object(schema.clone()),
        _ => json!({ "type": "object", "description": "the run's config, as the agent reads it (at most 16 KiB)" }),
    };
    let mut tool = json!({
        "name": agent.name,
        "title": agent.name,
        "description": description,
        "inputSchema": {
            "type": "object",
            "properties": {
                "prompt": { "type": "string", "minLength": 1, "description": "what to ask the agent: one turn" },
                "config": config,
                "conversation_id": { "type": "string", "format": "uuid",
                    "description": "a conversation to continue (a previous answer's _meta names its own)" },
            },
            "required": ["prompt"],
        },
    });
    if tasks {
        tool["execution"] = json!({ "taskSupport": "optional" });
    }
    tool
}

/// One request's calls.
struct Calls<'a> {
    state: &'a AppState,
    p: &'a Principal,
    id: &'a Value,
    /// Whether the client speaks the `tasks` utility (2025-11-25).
    tasks: bool,
}

impl Calls<'_> {
    fn initialize(&self, params: &Value) -> Response {
        let asked = params["protocolVersion"].as_str().unwrap_or_default();
        let version = PROTOCOL_VERSIONS.iter().find(|v| **v == asked).unwrap_or(&PROTOCOL_VERSIONS[0]);
        let mut capabilities = json!({ "tools": { "listChanged": false } });
        if *version == TASKS_VERSION {
            capabilities["tasks"] = json!({ "list": {}, "cancel": {}, "requests": { "tools": { "call": {} } } });
        }
        result_response(
            self.id,
            json!({
                "protocolVersion": version,
                "capabilities": capabilities,
                "serverInfo": { "name": "agent-host", "title": "agent-host", "version": env!("CARGO_PKG_VERSION") },
                "instructions": "Each tool is an agent this token may run. A call is one durable run: its prompt \
                                 is the turn, its answer the run's final text. Long calls may be tasks (the task \
                                 id is the run id, readable through GET /v1/runs/{id} too).",
            }),
        )
    }

    async fn row(&self, run: RunId) -> Result<TaskRow, RpcError> {
        tasks::get(&self.state.pool, run, &self.p.user_id, None).await?.ok_or_else(|| not_found(run))
    }

    async fn list_tools(&self, params: &Value) -> Result<Response, RpcError> {
        let after = optional_str(params, "cursor")?;
        let mut agents: Vec<Agent> = Vec::new();
        if self.state.agents.sandbox().is_some() {
            let rows =
                crate::db::plugins::list(&self.state.pool, Some(&self.p.tenant_id), after, TOOLS_PAGE + 1).await?;
            agents.extend(rows.into_iter().map(|r| Agent {
                name: r.name,
                manifest: r.manifest,
                digest: Some(r.digest),
            }));
        }
        for name in self.state.agents.names() {
            if after.is_none_or(|a| name.as_str() > a) && !agents.iter().any(|a| a.name == name) {
                agents.push(Agent { name, manifest: json!({}), digest: None });
            }
        }
        agents.sort_by(|a, b| a.name.cmp(&b.name));
        let more = agents.len() as i64 > TOOLS_PAGE;
        agents.truncate(TOOLS_PAGE as usize);
        let tools: Vec<Value> = agents.iter().map(|a| tool(a, self.tasks)).collect();
        let mut result = json!({ "tools": tools });
        if more {
            result["nextCursor"] = json!(agents.last().map(|a| a.name.clone()));
        }
        Ok(result_response(self.id, result))
    }

    /// A result that is the tool's own error (bad arguments): the caller's
    /// model reads it and may try again.
    fn tool_error(&self, message: String) -> Response {
        result_response(self.id, json!({ "content": [{ "type": "text", "text": message }], "isError": true }))
    }

    async fn call_tool(&self, params: &Value, headers: &HeaderMap) -> Result<Response, RpcError> {
        let name = optional_str(params, "name")?.ok_or_else(|| RpcError::new(INVALID_PARAMS, "name is missing"))?;
        let agent = find_agent(self.state, self.p, name)
            .await?
            .ok_or_else(|| RpcError::new(INVALID_PARAMS, format!("unknown tool {name:?}")))?;
        let args = match &params["arguments"] {
            Value::Null => json!({}),
            v @ Value::Object(_) => v.clone(),
            _ => return Ok(self.tool_error("arguments must be an object".into())),
        };
        let prompt = match &args["prompt"] {
            Value::String(s) if !s.trim().is_empty() => s.clone(),
            _ => return Ok(self.tool_error("prompt is missing: a non-empty string, the turn to run".into())),
        };
        let config = match &args["config"] {
            Value::Null => None,
            c @ Value::Object(_) => Some(c.clone()),
            _ => return Ok(self.tool_error("config must be an object".into())),
        };
        let conversation = match &args["conversation_id"] {
            Value::Null => None,
            Value::String(c) => match c.parse::<ConversationId>() {
                Ok(c) => Some(c),
                Err(_) => return Ok(self.tool_error(format!("conversation_id {c:?} is not a conversation id"))),
            },
            _ => return Ok(self.tool_error("conversation_id must be a string".into())),
        };
        let task = match &params["task"] {
            Value::Null => false,
            Value::Object(_) if self.tasks => true,
            Value::Object(_) => return Err(RpcError::new(INVALID_PARAMS, "tasks are served with protocol 2025-11-25")),
            _ => return Err(RpcError::new(INVALID_PARAMS, "task must be an object")),
        };
        let progress = match &params["_meta"]["progressToken"] {
            t @ (Value::String(_) | Value::Number(_)) => Some(t.clone()),
            _ => None,
        };
        let key = match headers.get("idempotency-key").map(|v| v.to_str()) {
            None => None,
            Some(Ok(k)) if !k.is_empty() && k.len() <= 255 => Some(format!("mcp:{k}")),
            Some(_) => return Err(ApiError::bad_request("Idempotency-Key must be 1-255 visible characters").into()),
        };
        // A place under the bound of live tails first (a stream or a wait):
        // once the run is enqueued, nothing answers 5xx.
        let place = match task {
            true => None,
            false => Some(self.state.tails().reserve()?),
        };
        let check = match (task, &progress) {
            (false, Some(_)) => Some(super::live::TokenCheck::open(self.state, self.p)?),
            _ => None,
        };
        let _waiting = match (task, &progress) {
            (false, None) => {
                Some(self.state.policy.quotas.stream(&self.p.tenant_id, &self.p.user_id).map_err(ApiError::from)?)
            }
            _ => None,
        };
        let submission = Submission {
            owner: owner(self.p),
            conversation_id: conversation,
            content: prompt,
            plugin: agent.name.clone(),
            config,
            idempotency_key: key,
            webhook: None,
            strategy: Busy::Enqueue,
            parent: None,
        };
        let submitted = submit::submit(
            &self.state.pool,
            &self.state.agents,
            &self.state.policy,
            &submission,
            self.state.local_worker(),
        )
        .await
        .map_err(ApiError::from)?;
        let run = submitted.enqueued().run_id;
        match (place, progress, check) {
            (None, _, _) => {
                let row = self.row(run).await?;
                Ok(result_response(self.id, json!({ "task": view::task(&row) })))
            }
            (Some(place), Some(token), Some(check)) => Ok(self.progress_stream(run, token, place, check)),
            (Some(place), _, _) => {
                let (row, text) = self.settle(run, place, false).await?;
                Ok(result_response(self.id, view::call_result(&row, &text)))
            }
        }
    }

    /// Follows the run until its answer is due (it ended; or, unless
    /// `to_end`, it waits for a person): the row then, and the text said.
    async fn settle(&self, run: RunId, place: Reserved, to_end: bool) -> Result<(TaskRow, String), RpcError> {
        let mut folded: Folded = fold(self.state.tails().catch_up(run, 0)).await?;
        let row = self.row(run).await?;
        let due = row.status.is_terminal() || (!to_end && row.pending_approval.is_some());
        if !due {
            let mut tail = self.state.tails().follow_reserved(run, folded.seq, place);
            while let Some(item) = tail.next().await {
                match item? {
                    Item::Event(e) => {
                        let (_, answer_due) = view::follow(&mut folded, &e);
                        if answer_due && (!to_end || e.kind == crate::db::events::COMPLETE) {
                            break;
                        }
                    }
                    Item::Keepalive => {}
                    Item::End(_) => break,
                }
            }
        }
        Ok((self.row(run).await?, folded.text))
    }

    /// The call's answer as a stream: a `notifications/progress` for each
    /// piece of text the run says, then the result, on one SSE response.
    fn progress_stream(&self, run: RunId, token: Value, place: Reserved, check: super::live::TokenCheck) -> Response {
        let tail = self.state.tails().follow_reserved(run, 0, place);
        struct S {
            tail: crate::stream::tail::TailStream,
            folded: Folded,
            sent: u64,
            done: bool,
            check: super::live::TokenCheck,
            state: AppState,
            user: String,
        }
        let s = S {
            tail,
            folded: Folded::default(),
            sent: 0,
            done: false,
            check,
            state: self.state.clone(),
            user: self.p.user_id.clone(),
        };
        let id = self.id.clone();
        let frames = futures::stream::unfold(s, move |mut s| {
            let (id, token) = (id.clone(), token.clone());
            async move {
                if s.done {
                    return None;
                }
                let frame = |v: Value| Ok::<_, Infallible>(SseEvent::default().event("message").data(v.to_string()));
                loop {
                    let item = s.tail.next().await;
                    if !s.check.still_valid(matches!(item, Some(Ok(Item::Keepalive))), "mcp call").await {
                        return None;
                    }
                    let due = match item {
                        Some(Ok(Item::Event(e))) => match view::follow(&mut s.folded, &e) {
                            (Some(text), _) if !text.is_empty() => {
                                s.sent += 1;
                                return Some((frame(view::progress(&token, s.sent, &text)), s));
                            }
                            (_, due) => due,
                        },
                        Some(Ok(Item::Keepalive)) => return Some((Ok(SseEvent::default().comment("keepalive")), s)),
                        Some(Ok(Item::End(_))) | None => true,
                        Some(Err(e)) => {
                            tracing::warn!(error = %e, "an MCP call's stream ended early; tasks/get reads its run");
                            return None;
                        }
                    };
                    if due {
                        s.done = true;
                        let answer = match tasks::get(&s.state.pool, run, &s.user, None).await {
                            Ok(Some(row)) => {
                                json!({ "jsonrpc": "2.0", "id": id, "result": view::call_result(&row, &s.folded.text) })
                            }
                            Ok(None) => rpc_error(&id, INVALID_PARAMS, &format!("task {run} not found")),
                            Err(e) => {
                                tracing::warn!(error = %e, "an MCP call's answer could not be read");
                                rpc_error(&id, INTERNAL_ERROR, "the run's answer could not be read")
                            }
                        };
                        return Some((frame(answer), s));
                    }
                }
            }
        });
        Sse::new(frames).into_response()
    }

    async fn get_task(&self, params: &Value) -> Result<Response, RpcError> {
        let row = self.row(task_id(params)?).await?;
        Ok(result_response(self.id, view::task(&row)))
    }

    /// The call's result once its run has ended (waiting until it does).
    async fn task_result(&self, params: &Value) -> Result<Response, RpcError> {
        let run = self.row(task_id(params)?).await?.id;
        let place = self.state.tails().reserve()?;
        let _waiting = self.state.policy.quotas.stream(&self.p.tenant_id, &self.p.user_id).map_err(ApiError::from)?;
        let (row, text) = self.settle(run, place, true).await?;
        let mut result = view::call_result(&row, &text);
        result["_meta"][view::RELATED_TASK] = json!({ "taskId": run });
        Ok(result_response(self.id, result))
    }

    async fn cancel_task(&self, params: &Value) -> Result<Response, RpcError> {
        let row = self.row(task_id(params)?).await?;
        if row.status.is_terminal() {
            return Err(RpcError::new(
                INVALID_PARAMS,
                format!("task {} cannot be cancelled: it has ended ({})", row.id, row.status.as_str()),
            ));
        }
        cancel(self.state, self.p, row.id).await?;
        // The stop is durable: answer once the run has wound down, or as it
        // stands after a bound (the worker honours the stop meanwhile).
        let place = self.state.tails().reserve()?;
        let row = match tokio::time::timeout(CANCEL_SETTLE_MAX, self.settle(row.id, place, true)).await {
            Ok(settled) => settled?.0,
            Err(_) => self.row(row.id).await?,
        };
        Ok(result_response(self.id, view::task(&row)))
    }

    async fn list_tasks(&self, params: &Value) -> Result<Response, RpcError> {
        let after = match optional_str(params, "cursor")? {
            None => None,
            Some(c) => Some(
                c.parse::<RunId>()
                    .map_err(|_| RpcError::new(INVALID_PARAMS, "cursor must be a nextCursor this list answered"))?,
            ),
        };
        let mut rows = tasks::list(&self.state.pool, &self.p.user_id, None, None, None, after, TASKS_PAGE + 1).await?;
        let more = rows.len() as i64 > TASKS_PAGE;
        rows.truncate(TASKS_PAGE as usize);
        let mut result = json!({ "tasks": rows.iter().map(view::task).collect::<Vec<_>>() });
        if more {
            result["nextCursor"] = json!(rows.last().map(|r| r.id.to_string()));
        }
        Ok(result_response(self.id, result))
    }
}
