//! The A2A protocol (v1.0, its JSON-RPC binding) for every agent a token
//! may run: `GET /a2a/{plugin}/.well-known/agent-card.json` is the agent's
//! card, `POST /a2a/{plugin}` its JSON-RPC endpoint. A task is a run, its
//! `contextId` the run's conversation; the handlers parse, call the one
//! enqueue service (`service::submit`), the approvals' decision and the
//! stop the native API calls, and encode the A2A view of the run
//! (`stream::a2a`) over the journal tail. Idempotency (a message's
//! `messageId` is its key), quotas, the busy-conversation strategy and
//! approvals apply unchanged; a task is a run any API reads.
//!
//! Methods: `SendMessage` (waits for the task to end or to need input,
//! unless `configuration.returnImmediately`), `SendStreamingMessage` (SSE of
//! JSON-RPC responses: the task, then status and artifact updates),
//! `GetTask` (`historyLength`), `ListTasks` (paged, by `contextId` and
//! state), `CancelTask` (a durable stop; answers the task once it has ended,
//! or as it stands after a bound), `SubscribeToTask` (the task as it stands,
//! then every update after it: rejoin from any process, nothing lost or
//! repeated). A task waiting for a person's approval is `INPUT_REQUIRED`;
//! the next message on it (`taskId` set) carries the decision: a data part
//! `{"decision": "approve"|"reject", "reason"}` or the text `approve` or
//! `reject`. Push notifications (`CreateTaskPushNotificationConfig` and its
//! get, list and delete, or `taskPushNotificationConfig` on a send) go
//! through the completion-webhook outbox: each state change of the task is
//! a `StreamResponse` status update POSTed to each config's URL (under the
//! operator's `--completion-webhook-allow`), signed as a completion webhook
//! is, retried, and never lost to a crash; the config's token comes back as
//! `X-A2A-Notification-Token`, its credentials as `Authorization`. A config
//! is told the task's state when it is made, then every change.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use serde_json::{json, Value};

use crate::db::tasks::{self, TaskRow};
use crate::db::tokens::Principal;
use crate::db::{ConversationId, RunId};
use crate::service::submit::{self, Busy, Submission};
use crate::stream::a2a::{self as view, Folded};
use crate::stream::tail::{Item, Reserved};

use super::approvals::{decide_call, Decided};
use super::jsonrpc::{http_error, rpc_error, RpcError, INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR};
use super::runs::{cancel, owner};
use super::{ApiError, AppState, Auth};

/// The protocol version served.
pub const PROTOCOL_VERSION: &str = "1.0";
/// Tasks a `ListTasks` page holds by default, and at most.
const PAGE_DEFAULT: i64 = 50;
const PAGE_MAX: i64 = 100;
/// How long `CancelTask` waits for the run to wind down before answering it
/// as it stands (still working: the stop is durable and goes on).
const CANCEL_SETTLE_MAX: Duration = Duration::from_secs(10);

// A2A's own error codes (JSON-RPC's are `jsonrpc`'s).
const TASK_NOT_FOUND: i64 = -32001;
const TASK_NOT_CANCELABLE: i64 = -32002;
const PUSH_NOT_SUPPORTED: i64 = -32003;
const UNSUPPORTED_OPERATION: i64 = -32004;
const CONTENT_TYPE_NOT_SUPPORTED: i64 = -32005;
const EXTENDED_CARD_NOT_CONFIGURED: i64 = -32007;
const VERSION_NOT_SUPPORTED: i64 = -32009;

fn error_response(id: &Value, e: RpcError) -> Response {
    match e {
        RpcError::Rpc { code, message } => Json(rpc_error(id, code, &message)).into_response(),
        RpcError::Http(e) => http_error(e),
    }
}

fn result_response(id: &Value, result: Value) -> Response {
    Json(json!({ "jsonrpc": "2.0", "id": id, "result": result })).into_response()
}

/// An agent a token may run: a plugin of its tenant or a published one, or
/// a built-in agent the operator offers.
pub(super) struct Agent {
    pub name: String,
    pub manifest: Value,
    pub digest: Option<String>,
}

pub(super) async fn find_agent(state: &AppState, p: &Principal, name: &str) -> Result<Option<Agent>, sqlx::Error> {
    if state.agents.sandbox().is_some() {
        if let Some(row) = crate::db::plugins::resolve(&state.pool, &p.tenant_id, name).await? {
            return Ok(Some(Agent { name: row.name, manifest: row.manifest, digest: Some(row.digest) }));
        }
    }
    Ok(state.agents.contains(name).then(|| Agent { name: name.to_string(), manifest: json!({}), digest: None }))
}

fn unknown_agent(name: &str) -> ApiError {
    ApiError::not_found(format!("agent {name:?}"))
}

/// The endpoint's URL as the client reached it (`X-Forwarded-Proto` and
/// `X-Forwarded-Host` when a proxy sets them).
fn endpoint_url(headers: &HeaderMap, plugin: &str) -> String {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
    let scheme = match header("x-forwarded-proto").as_deref() {
        Some("https") => "https",
        _ => "http",
    };
    let host = header("x-forwarded-host").or_else(|| header("host")).unwrap_or_else(|| "localhost".into());
    format!("{scheme}://{host}/a2a/{plugin}")
}

/// `GET /a2a/{plugin}/.well-known/agent-card.json`: the agent's card (name,
/// description and skills from its manifest, the JSON-RPC interface,
/// streaming, bearer tokens).
pub async fn card(
    State(state): State<AppState>,
    Auth(p): Auth,
    Path(plugin): Path<String>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let agent = find_agent(&state, &p, &plugin).await?.ok_or_else(|| unknown_agent(&plugin))?;
    let description = agent.manifest["description"]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| format!("The agent {}, run durably by agent-host", agent.name));
    let skills = match agent.manifest["skills"].as_array() {
        Some(skills) if !skills.is_empty() => skills.clone(),
        _ => vec![json!({ "id": agent.name, "name": agent.name, "description": description, "tags": ["agent"] })],
    };
    let card = json!({
        "name": agent.name,
        "description": description,
        "version": agent.digest.as_deref().unwrap_or("builtin"),
        "supportedInterfaces": [{ "url": endpoint_url(&headers, &agent.name), "protocolBinding": "JSONRPC",
                                  "protocolVersion": PROTOCOL_VERSION }],
        "capabilities": { "streaming": true, "pushNotifications": push_served(&state),
                          "extendedAgentCard": false },
        "securitySchemes": { "bearer": { "httpAuthSecurityScheme": {
            "scheme": "Bearer", "description": "an agent-host token (agent-host tokens create)" } } },
        "securityRequirements": [{ "schemes": { "bearer": { "list": [] } } }],
        "defaultInputModes": ["text/plain"],
        "defaultOutputModes": ["text/plain"],
        "skills": skills,
    });
    Ok(Json(card).into_response())
}

/// `POST /a2a/{plugin}`: one JSON-RPC request.
pub async fn rpc(
    State(state): State<AppState>,
    auth: Result<Auth, ApiError>,
    Path(plugin): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Auth(p) = match auth {
        Ok(a) => a,
        Err(e) => return error_response(&Value::Null, e.into()),
    };
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return error_response(&Value::Null, RpcError::new(PARSE_ERROR, "the body is not JSON"));
    };
    let id = match &request["id"] {
        id @ (Value::String(_) | Value::Number(_) | Value::Null) => id.clone(),
        _ => Value::Null,
    };
    match dispatch(&state, &p, &plugin, &headers, &request, &id).await {
        Ok(res) => res,
        Err(e) => error_response(&id, e),
    }
}

async fn dispatch(
    state: &AppState,
    p: &Principal,
    plugin: &str,
    headers: &HeaderMap,
    request: &Value,
    id: &Value,
) -> Result<Response, RpcError> {
    if request["jsonrpc"] != "2.0" || !request.is_object() {
        return Err(RpcError::new(INVALID_REQUEST, "a JSON-RPC 2.0 request object is expected"));
    }
    let method = request["method"].as_str().ok_or_else(|| RpcError::new(INVALID_REQUEST, "method is missing"))?;
    if let Some(v) = headers.get("a2a-version").and_then(|v| v.to_str().ok()) {
        let v = v.trim();
        if !v.is_empty() && v != PROTOCOL_VERSION && v != "1" {
            return Err(RpcError::new(VERSION_NOT_SUPPORTED, format!("A2A-Version {v} is not served; 1.0 is")));
        }
    }
    let params = match &request["params"] {
        Value::Null => json!({}),
        v @ Value::Object(_) => v.clone(),
        _ => return Err(RpcError::new(INVALID_PARAMS, "params must be an object")),
    };
    let agent = find_agent(state, p, plugin).await?.ok_or_else(|| RpcError::Http(unknown_agent(plugin)))?;
    let calls = Calls { state, p, agent: &agent, id };
    match method {
        "SendMessage" => calls.send(&params, false).await,
        "SendStreamingMessage" => calls.send(&params, true).await,
        "GetTask" => calls.get_task(&params).await,
        "ListTasks" => calls.list_tasks(&params).await,
        "CancelTask" => calls.cancel_task(&params).await,
        "SubscribeToTask" => calls.subscribe(&params).await,
        "GetExtendedAgentCard" => Err(RpcError::new(EXTENDED_CARD_NOT_CONFIGURED, "this agent has no extended card")),
        "CreateTaskPushNotificationConfig" => calls.create_push(&params).await,
        "GetTaskPushNotificationConfig" => calls.get_push(&params).await,
        "ListTaskPushNotificationConfigs" => calls.list_push(&params).await,
        "DeleteTaskPushNotificationConfig" => calls.delete_push(&params).await,
        other => Err(RpcError::new(METHOD_NOT_FOUND, format!("method {other:?} not found"))),
    }
}

/// Whether this host sends push notifications: it signs webhooks and the
/// operator allows some URLs.
fn push_served(state: &AppState) -> bool {
    state.policy.webhook_secret.is_some() && !state.policy.webhook_allow.is_empty()
}

/// Bytes of a push config's id, token, scheme or credentials.
const PUSH_FIELD_BYTES_MAX: usize = 1000;

/// A config as the protocol answers it (its credentials never).
fn push_json(run: RunId, c: &tasks::PushConfig) -> Value {
    let mut v = json!({ "taskId": run, "id": c.id, "url": c.url });
    if let Some(token) = &c.token {
        v["token"] = token.clone().into();
    }
    if let Some(scheme) = &c.auth_scheme {
        v["authentication"] = json!({ "scheme": scheme });
    }
    v
}

/// A field of a proto-JSON object, by its JSON name or its proto name.
fn field<'a>(v: &'a Value, json_name: &str, proto_name: &str) -> &'a Value {
    match &v[json_name] {
        Value::Null => &v[proto_name],
        found => found,
    }
}

fn optional_str<'a>(v: &'a Value, json_name: &str, proto_name: &str) -> Result<Option<&'a str>, RpcError> {
    match field(v, json_name, proto_name) {
        Value::Null => Ok(None),
        Value::String(s) if s.is_empty() => Ok(None),
        Value::String(s) => Ok(Some(s)),
        _ => Err(RpcError::new(INVALID_PARAMS, format!("{json_name} must be a string"))),
    }
}

fn history_length(params: &Value) -> Result<Option<usize>, RpcError> {
    match field(params, "historyLength", "history_length") {
        Value::Null => Ok(None),
        v => v
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| RpcError::new(INVALID_PARAMS, "historyLength must be a non-negative integer")),
    }
}

fn task_id(params: &Value, name: &str) -> Result<RunId, RpcError> {
    let raw =
        optional_str(params, name, name)?.ok_or_else(|| RpcError::new(INVALID_PARAMS, format!("{name} is missing")))?;
    raw.parse().map_err(|_| RpcError::new(TASK_NOT_FOUND, format!("task {raw:?} not found")))
}

/// `v` with each whole number written as an integer: metadata is a
/// protobuf `Struct`, whose numbers are all doubles (`3` arrives as `3.0`),
/// and a run's config is read as JSON, where a count is an integer.
fn integral(v: Value) -> Value {
    match v {
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() < 9.0e15 => json!(f as i64),
            _ => Value::Number(n),
        },
        Value::Array(a) => Value::Array(a.into_iter().map(integral).collect()),
        Value::Object(o) => Value::Object(o.into_iter().map(|(k, v)| (k, integral(v))).collect()),
        other => other,
    }
}

/// One request's calls.
struct Calls<'a> {
    state: &'a AppState,
    p: &'a Principal,
    agent: &'a Agent,
    id: &'a Value,
}

impl Calls<'_> {
    async fn row(&self, run: RunId) -> Result<TaskRow, RpcError> {
        tasks::get(&self.state.pool, run, &self.p.user_id, Some(&self.agent.name))
            .await?
            .ok_or_else(|| RpcError::new(TASK_NOT_FOUND, format!("task {run} not found")))
    }

    /// The answer's text so far (the transcript's once the run ended).
    async fn folded(&self, row: &TaskRow) -> Result<Folded, RpcError> {
        Ok(view::fold(self.state.tails().catch_up(row.id, 0)).await?)
    }

    async fn snapshot(&self, row: &TaskRow, history: Option<usize>) -> Result<Value, RpcError> {
        let folded = self.folded(row).await?;
        Ok(view::task(row, &folded.text, history))
    }

    async fn send(&self, params: &Value, stream: bool) -> Result<Response, RpcError> {
        let message = &params["message"];
        if !message.is_object() {
            return Err(RpcError::new(INVALID_PARAMS, "message is missing"));
        }
        let parts = message["parts"].as_array().map(Vec::as_slice).unwrap_or_default();
        let text: Vec<&str> = parts.iter().filter_map(|p| p["text"].as_str()).collect();
        let data = parts.iter().find_map(|p| p.get("data").filter(|d| d.is_object()));
        if text.is_empty() && data.is_none() {
            return Err(RpcError::new(
                CONTENT_TYPE_NOT_SUPPORTED,
                "a message needs a text part (or, answering an approval, a data part)",
            ));
        }
        let text = text.join("\n");
        let config = &params["configuration"];
        let immediately = field(config, "returnImmediately", "return_immediately").as_bool().unwrap_or(false);
        let history = history_length(config)?;
        let push = match field(config, "taskPushNotificationConfig", "task_push_notification_config") {
            Value::Null => None,
            v => {
                let default_id = optional_str(message, "messageId", "message_id")?.unwrap_or("default");
                Some(self.push_config(v, default_id)?)
            }
        };
        // A place under the bound of live tails first (a stream or a wait):
        // once the run is enqueued, nothing answers 5xx.
        let place = match stream || !immediately {
            true => Some(self.state.tails().reserve()?),
            false => None,
        };
        let check = match stream {
            true => Some(super::live::TokenCheck::open(self.state, self.p)?),
            false => None,
        };
        let _waiting = match !stream && !immediately {
            true => Some(self.state.policy.quotas.stream(&self.p.tenant_id, &self.p.user_id).map_err(ApiError::from)?),
            false => None,
        };
        let row = match optional_str(message, "taskId", "task_id")? {
            Some(task) => {
                let run =
                    task.parse().map_err(|_| RpcError::new(TASK_NOT_FOUND, format!("task {task:?} not found")))?;
                self.answer_input(run, &text, data).await?
            }
            None => self.start(message, text).await?,
        };
        if let Some(push) = &push {
            self.put_push(row.id, push).await?;
        }
        match (place, stream) {
            (Some(place), true) => {
                // The fold first, then the row: the snapshot's state is at
                // least as new as its text, and the updates start after it.
                let folded = self.folded(&row).await?;
                let row = self.row(row.id).await?;
                let first = json!({ "task": view::task(&row, &folded.text, history) });
                Ok(self.sse(row, folded, Some(first), place, check.expect("a stream's check")))
            }
            (Some(place), false) => {
                let row = self.settle(row, place).await?;
                Ok(result_response(self.id, json!({ "task": self.snapshot(&row, history).await? })))
            }
            (None, _) => Ok(result_response(self.id, json!({ "task": self.snapshot(&row, history).await? }))),
        }
    }

    /// A new run (a new task) through the enqueue service: the message's
    /// `messageId` is its idempotency key, so a client's retry is the same task.
    async fn start(&self, message: &Value, text: String) -> Result<TaskRow, RpcError> {
        let message_id = optional_str(message, "messageId", "message_id")?
            .ok_or_else(|| RpcError::new(INVALID_PARAMS, "message.messageId is missing"))?;
        let conversation = match optional_str(message, "contextId", "context_id")? {
            None => None,
            Some(c) => Some(c.parse::<ConversationId>().map_err(|_| {
                RpcError::new(
                    INVALID_PARAMS,
                    format!("context {c:?} not found: a contextId is one this agent answered"),
                )
            })?),
        };
        let config = match &message["metadata"]["config"] {
            Value::Null => None,
            c => Some(integral(c.clone())),
        };
        let submission = Submission {
            owner: owner(self.p),
            conversation_id: conversation,
            content: text,
            plugin: self.agent.name.clone(),
            config,
            idempotency_key: Some(format!("a2a:{message_id}")),
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
        self.row(submitted.enqueued().run_id).await
    }

    /// A message on a task that needs input: the decision on the approval
    /// it waits for.
    async fn answer_input(&self, run: RunId, text: &str, data: Option<&Value>) -> Result<TaskRow, RpcError> {
        let row = self.row(run).await?;
        let Some(call) = row.pending_approval.clone() else {
            if row.status.is_terminal() {
                return Err(RpcError::new(
                    UNSUPPORTED_OPERATION,
                    format!("task {run} has ended: send the next message in its context (contextId), without taskId"),
                ));
            }
            return Err(RpcError::new(INVALID_PARAMS, format!("task {run} takes no input now: it is working")));
        };
        let said = data.and_then(|d| d["decision"].as_str()).unwrap_or(text.trim()).to_ascii_lowercase();
        let decision = match said.as_str() {
            "approve" | "approved" | "yes" => "approve",
            "reject" | "rejected" | "no" => "reject",
            _ => {
                return Err(RpcError::new(
                    INVALID_PARAMS,
                    format!("task {run} waits for a decision: answer \"approve\" or \"reject\", not {said:?}"),
                ))
            }
        };
        let reason = data.and_then(|d| d["reason"].as_str());
        let reason = match (decision, reason) {
            ("reject", None) => Some("rejected over A2A"),
            (_, r) => r,
        };
        let call_id = call["call_id"].as_i64().unwrap_or_default() as i32;
        match decide_call(self.state, self.p, run, call_id, decision, None, reason).await? {
            Decided::Now(_) | Decided::Already(_) => {}
        }
        self.row(run).await
    }

    /// Follows the run until its task ends or needs input; the row then.
    async fn settle(&self, row: TaskRow, place: Reserved) -> Result<TaskRow, RpcError> {
        let mut folded = self.folded(&row).await?;
        let row = self.row(row.id).await?;
        if view::stream_ends_at(view::state_of(row.status, row.pending_approval.is_some())) {
            return Ok(row);
        }
        let mut tail = self.state.tails().follow_reserved(row.id, folded.seq, place);
        while let Some(item) = tail.next().await {
            match item? {
                Item::Event(e) => {
                    let (_, state) = view::updates(&row, &mut folded, &e);
                    if state.is_some_and(view::stream_ends_at) {
                        break;
                    }
                }
                Item::Keepalive => {}
                Item::End(_) => break,
            }
        }
        self.row(row.id).await
    }

    /// A push config from the protocol's `TaskPushNotificationConfig`: its
    /// URL under the operator's allow-list, each header value one a
    /// request can carry.
    fn push_config(&self, v: &Value, default_id: &str) -> Result<tasks::NewPushConfig, RpcError> {
        if !push_served(self.state) {
            return Err(RpcError::new(
                PUSH_NOT_SUPPORTED,
                "this host sends no push notifications (its operator allows no webhook URLs)",
            ));
        }
        if !v.is_object() {
            return Err(RpcError::new(INVALID_PARAMS, "a push notification config is an object"));
        }
        let header_safe = |name: &str, s: &str| {
            if s.len() > PUSH_FIELD_BYTES_MAX || HeaderValue::from_str(s).is_err() {
                return Err(RpcError::new(
                    INVALID_PARAMS,
                    format!("{name} must be at most {PUSH_FIELD_BYTES_MAX} bytes of visible ASCII"),
                ));
            }
            Ok(s.to_string())
        };
        let url = optional_str(v, "url", "url")?
            .ok_or_else(|| RpcError::new(INVALID_PARAMS, "a push notification config needs a url"))?;
        if !self.state.policy.allows_webhook(url) {
            return Err(RpcError::new(
                INVALID_PARAMS,
                format!("url {url:?} is not under a URL prefix the operator allows for webhooks"),
            ));
        }
        let id = header_safe("id", optional_str(v, "id", "id")?.unwrap_or(default_id))?;
        let token = optional_str(v, "token", "token")?.map(|t| header_safe("token", t)).transpose()?;
        let authentication = match &v["authentication"] {
            Value::Null => None,
            auth => {
                let scheme = optional_str(auth, "scheme", "scheme")?
                    .ok_or_else(|| RpcError::new(INVALID_PARAMS, "authentication needs a scheme"))?;
                let credentials = optional_str(auth, "credentials", "credentials")?.ok_or_else(|| {
                    RpcError::new(INVALID_PARAMS, "authentication needs credentials (sent as Authorization)")
                })?;
                Some((header_safe("scheme", scheme)?, header_safe("credentials", credentials)?))
            }
        };
        Ok(tasks::NewPushConfig { id, url: url.to_string(), token, authentication })
    }

    async fn put_push(&self, run: RunId, config: &tasks::NewPushConfig) -> Result<tasks::PushConfig, RpcError> {
        match tasks::put_push(&self.state.pool, run, config).await? {
            tasks::PushPut::Made(made) => Ok(made),
            tasks::PushPut::TooMany => Err(RpcError::new(
                INVALID_PARAMS,
                format!("task {run} holds {} push notification configs, the most it may", tasks::PUSH_CONFIGS_MAX),
            )),
        }
    }

    async fn create_push(&self, params: &Value) -> Result<Response, RpcError> {
        let row = self.row(task_id(params, "taskId")?).await?;
        let default_id = uuid::Uuid::new_v4().to_string();
        let config = self.push_config(params, &default_id)?;
        let made = self.put_push(row.id, &config).await?;
        Ok(result_response(self.id, push_json(row.id, &made)))
    }

    async fn get_push(&self, params: &Value) -> Result<Response, RpcError> {
        let row = self.row(task_id(params, "taskId")?).await?;
        let id = optional_str(params, "id", "id")?.ok_or_else(|| RpcError::new(INVALID_PARAMS, "id is missing"))?;
        let configs = tasks::push_configs(&self.state.pool, row.id).await?;
        let found = configs.iter().find(|c| c.id == id).ok_or_else(|| {
            RpcError::new(TASK_NOT_FOUND, format!("task {} has no push notification config {id:?}", row.id))
        })?;
        Ok(result_response(self.id, push_json(row.id, found)))
    }

    async fn list_push(&self, params: &Value) -> Result<Response, RpcError> {
        let row = self.row(task_id(params, "taskId")?).await?;
        // At most PUSH_CONFIGS_MAX: one page.
        let configs = tasks::push_configs(&self.state.pool, row.id).await?;
        let configs: Vec<Value> = configs.iter().map(|c| push_json(row.id, c)).collect();
        Ok(result_response(self.id, json!({ "configs": configs, "nextPageToken": "" })))
    }

    async fn delete_push(&self, params: &Value) -> Result<Response, RpcError> {
        let row = self.row(task_id(params, "taskId")?).await?;
        let id = optional_str(params, "id", "id")?.ok_or_else(|| RpcError::new(INVALID_PARAMS, "id is missing"))?;
        if !tasks::delete_push(&self.state.pool, row.id, id).await? {
            return Err(RpcError::new(
                TASK_NOT_FOUND,
                format!("task {} has no push notification config {id:?}", row.id),
            ));
        }
        Ok(result_response(self.id, Value::Null))
    }

    async fn get_task(&self, params: &Value) -> Result<Response, RpcError> {
        let row = self.row(task_id(params, "id")?).await?;
        Ok(result_response(self.id, self.snapshot(&row, history_length(params)?).await?))
    }

    async fn list_tasks(&self, params: &Value) -> Result<Response, RpcError> {
        let conversation = match optional_str(params, "contextId", "context_id")? {
            None => None,
            Some(c) => match c.parse::<ConversationId>() {
                Ok(c) => Some(c),
                Err(_) => {
                    return Ok(result_response(
                        self.id,
                        json!({ "tasks": [], "nextPageToken": "", "pageSize": 0, "totalSize": 0 }),
                    ))
                }
            },
        };
        let statuses: Option<&[&str]> = match optional_str(params, "status", "status")? {
            None | Some("TASK_STATE_UNSPECIFIED") => None,
            Some(view::SUBMITTED) => Some(&["queued"]),
            Some(view::WORKING) => Some(&["running", "waiting"]),
            Some(view::INPUT_REQUIRED) => Some(&["waiting"]),
            Some(view::COMPLETED) => Some(&["completed"]),
            Some(view::FAILED) => Some(&["failed"]),
            Some(view::CANCELED) => Some(&["cancelled"]),
            Some("TASK_STATE_REJECTED" | "TASK_STATE_AUTH_REQUIRED") => Some(&[]),
            Some(other) => return Err(RpcError::new(INVALID_PARAMS, format!("status {other:?} is not a task state"))),
        };
        let size = match field(params, "pageSize", "page_size") {
            Value::Null => PAGE_DEFAULT,
            v => match v.as_i64() {
                Some(n) if (0..=PAGE_MAX).contains(&n) => n.max(1),
                _ => return Err(RpcError::new(INVALID_PARAMS, format!("pageSize is 1 to {PAGE_MAX}"))),
            },
        };
        let after =
            match optional_str(params, "pageToken", "page_token")? {
                None => None,
                Some(t) => Some(t.parse::<RunId>().map_err(|_| {
                    RpcError::new(INVALID_PARAMS, "pageToken must be a nextPageToken this list answered")
                })?),
            };
        let history = history_length(params)?;
        let artifacts = field(params, "includeArtifacts", "include_artifacts").as_bool().unwrap_or(false);
        let (pool, user, plugin) = (&self.state.pool, &self.p.user_id, &self.agent.name);
        let mut rows = tasks::list(pool, user, Some(plugin), conversation, statuses, after, size + 1).await?;
        let more = rows.len() as i64 > size;
        rows.truncate(size as usize);
        let total = tasks::count(pool, user, plugin, conversation, statuses).await?;
        let next = match more {
            true => rows.last().map(|r| r.id.to_string()).unwrap_or_default(),
            false => String::new(),
        };
        let tasks: Vec<Value> = rows
            .iter()
            .map(|r| {
                let mut t = view::task(r, "", history);
                if !artifacts {
                    t.as_object_mut().map(|o| o.remove("artifacts"));
                }
                t
            })
            .collect();
        let page = json!({ "tasks": tasks, "nextPageToken": next, "pageSize": rows.len(), "totalSize": total });
        Ok(result_response(self.id, page))
    }

    async fn cancel_task(&self, params: &Value) -> Result<Response, RpcError> {
        let row = self.row(task_id(params, "id")?).await?;
        if row.status.is_terminal() {
            return Err(RpcError::new(
                TASK_NOT_CANCELABLE,
                format!("task {} has ended ({})", row.id, row.status.as_str()),
            ));
        }
        cancel(self.state, self.p, row.id).await?;
        // The stop is durable: answer once the run has wound down, or as it
        // stands after a bound (the worker honours the stop meanwhile).
        let place = self.state.tails().reserve()?;
        let row = match tokio::time::timeout(CANCEL_SETTLE_MAX, self.settle(row.clone(), place)).await {
            Ok(settled) => settled?,
            Err(_) => self.row(row.id).await?,
        };
        Ok(result_response(self.id, self.snapshot(&row, None).await?))
    }

    async fn subscribe(&self, params: &Value) -> Result<Response, RpcError> {
        let row = self.row(task_id(params, "id")?).await?;
        if row.status.is_terminal() {
            return Err(RpcError::new(
                UNSUPPORTED_OPERATION,
                format!("task {} has ended ({}): GetTask reads it", row.id, row.status.as_str()),
            ));
        }
        let place = self.state.tails().reserve()?;
        let check = super::live::TokenCheck::open(self.state, self.p)?;
        let folded = self.folded(&row).await?;
        let row = self.row(row.id).await?;
        let first = json!({ "task": view::task(&row, &folded.text, None) });
        Ok(self.sse(row, folded, Some(first), place, check))
    }

    /// The task's stream: `first`, then an update for each journal event
    /// after the fold, until the task ends or needs input. Each frame is a
    /// JSON-RPC response to this request.
    fn sse(
        &self,
        row: TaskRow,
        folded: Folded,
        first: Option<Value>,
        place: Reserved,
        check: super::live::TokenCheck,
    ) -> Response {
        let tail = self.state.tails().follow_reserved(row.id, folded.seq, place);
        let ended =
            first.as_ref().is_some_and(|f| f["task"]["status"]["state"].as_str().is_some_and(view::stream_ends_at));
        let id = self.id.clone();
        let frame = move |result: Value| {
            SseEvent::default().data(json!({ "jsonrpc": "2.0", "id": id, "result": result }).to_string())
        };
        struct S {
            tail: crate::stream::tail::TailStream,
            row: TaskRow,
            folded: Folded,
            ready: std::collections::VecDeque<Value>,
            done: bool,
            check: super::live::TokenCheck,
        }
        let state = S { tail, row, folded, ready: first.into_iter().collect(), done: ended, check };
        let frames = futures::stream::unfold(state, move |mut s| {
            let frame = frame.clone();
            async move {
                loop {
                    if let Some(v) = s.ready.pop_front() {
                        return Some((Ok::<_, Infallible>(frame(v)), s));
                    }
                    if s.done {
                        return None;
                    }
                    let item = s.tail.next().await;
                    if !s.check.still_valid(matches!(item, Some(Ok(Item::Keepalive))), "a2a task").await {
                        return None;
                    }
                    match item {
                        Some(Ok(Item::Event(e))) => {
                            let (updates, state) = view::updates(&s.row, &mut s.folded, &e);
                            s.ready.extend(updates);
                            if state.is_some_and(view::stream_ends_at) {
                                s.done = true;
                            }
                        }
                        Some(Ok(Item::Keepalive)) => {
                            return Some((Ok(SseEvent::default().comment("keepalive")), s));
                        }
                        Some(Ok(Item::End(_))) | None => s.done = true,
                        Some(Err(e)) => {
                            tracing::warn!(error = %e, "an A2A task stream ended early; SubscribeToTask rejoins it");
                            return None;
                        }
                    }
                }
            }
        });
        Sse::new(frames).into_response()
    }
}
