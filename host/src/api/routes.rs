//! Every route, once: the router is built from this table and `/openapi.json`
//! is generated from it, so the document cannot drift from what is served.

use axum::routing::{delete, get, post, MethodRouter};
use schemars::{JsonSchema, SchemaGenerator};
use serde_json::{json, Map, Value};

use crate::db::conversations::{ConversationSummary, ConversationView, MessageView};
use crate::db::enqueue::Enqueued;
use crate::db::lifecycle::suspensions::Pending;
use crate::db::lifecycle::Stopped;
use crate::db::runs::{RunSummary, RunView};
use crate::db::steer::SteerView;
use crate::db::{audit::AuditEvent, schedules::Schedule, tokens::TokenInfo};
use crate::db::{ConversationId, RunId, RunStatus};

use super::paging::LIMIT_MAX;
use super::{
    a2a, approvals, audit, conversations, events, metrics, plugins, responses, runs, schedules, tokens, tools, usage,
    webhooks, AppState, ErrorCode,
};

/// Builds a JSON schema.
pub type Schema = fn() -> Value;

/// One operation of the API.
pub struct Route {
    pub method: &'static str,
    /// axum's syntax (`{id}`), which is also OpenAPI's.
    pub path: &'static str,
    pub summary: &'static str,
    /// Needs `Authorization: Bearer`.
    pub auth: bool,
    /// (status, what the body holds) of the success answer.
    pub ok: (u16, &'static str),
    /// Other success statuses, with the same body (a cancel of a run that
    /// had already ended answers 200, not 202).
    pub also: &'static [u16],
    /// Error statuses this operation answers besides 401 (with auth) and 5xx.
    pub errors: &'static [u16],
    /// Query parameters.
    pub query: &'static [Param],
    /// Request body: (content type, its JSON schema).
    pub body: Option<(&'static str, Schema)>,
    /// What the success answer's body is (its schema derived from the type
    /// the handler answers with, where there is one).
    pub answer: Answer,
    pub handler: fn() -> MethodRouter<AppState>,
}

/// The JSON Schema of an answer, from a generator that collects the types'
/// definitions into `components/schemas`.
pub type Response = fn(&mut SchemaGenerator) -> Value;

/// A success answer's body.
pub enum Answer {
    Json(Response),
    /// JSON, or `text/event-stream` when the client asks for a stream.
    JsonOrSse(Response),
    /// Not JSON: its content type.
    Text(&'static str),
    /// No body (204).
    Empty,
}

/// The schema of `T`: a reference into `components/schemas` for a named type.
fn of<T: JsonSchema>(g: &mut SchemaGenerator) -> Value {
    g.subschema_for::<T>().to_value()
}

/// An object with every one of `props` required (a nullable one says so in
/// its own schema).
fn object(props: Vec<(&str, Value)>) -> Value {
    let required: Vec<&str> = props.iter().map(|(k, _)| *k).collect();
    let properties: Map<String, Value> = props.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    json!({ "type": "object", "required": required, "properties": properties })
}

/// A page of a list: `{<key>: [T], next_cursor}`.
fn page<T: JsonSchema>(g: &mut SchemaGenerator, key: &str) -> Value {
    object(vec![(key, json!({ "type": "array", "items": of::<T>(g) })), ("next_cursor", nullable("string"))])
}

fn nullable(kind: &str) -> Value {
    json!({ "type": [kind, "null"] })
}

fn string() -> Value {
    json!({ "type": "string" })
}

fn boolean() -> Value {
    json!({ "type": "boolean" })
}

fn timestamp() -> Value {
    json!({ "type": "string", "format": "date-time" })
}

/// A Responses API object (`object: "response"`): the fields every answer
/// carries; the rest follow OpenAI's shape.
fn response_object(_: &mut SchemaGenerator) -> Value {
    json!({ "type": "object", "required": ["id", "object", "status", "model", "output"], "properties": {
        "id": { "type": "string" }, "object": { "const": "response" }, "status": { "type": "string" },
        "model": { "type": "string" }, "output": { "type": "array" }, "created_at": { "type": "integer" } } })
}

/// A plugin as the API shows it (an upload's answer, a list's item).
fn plugin(_: &mut SchemaGenerator) -> Value {
    json!({ "type": "object", "required": ["name", "digest", "language", "manifest"], "properties": {
        "name": { "type": "string" }, "digest": { "type": ["string", "null"] }, "language": { "type": "string" },
        "manifest": {}, "tenant_id": { "type": ["string", "null"] }, "published": { "type": "boolean" },
        "builtin": { "type": "boolean" } } })
}

/// One query parameter: name, JSON type, what it means.
pub type Param = (&'static str, &'static str, &'static str);

/// The paging parameters every list route takes.
const PAGING: &[Param] = &[
    ("limit", "integer", "items on this page, 1 to 1000 (default: the list's page size)"),
    ("after", "string", "the next_cursor of the previous page"),
];

fn run_body() -> Value {
    json!({ "type": "object", "required": ["content", "plugin"], "additionalProperties": false, "properties": {
        "content": { "type": "string", "minLength": 1, "maxLength": 65536 },
        "plugin": { "type": "string" },
        "conversation_id": { "type": "string", "format": "uuid" },
        "config": { "type": "object", "description": "at most 16 KiB of JSON" },
        "webhook": { "type": "string", "description": "told when the run ends; under a prefix the operator allows" },
        "multitask_strategy": { "type": "string", "enum": ["enqueue", "reject", "interrupt", "steer"],
            "description": "when the conversation has an active turn: queue behind it (default), 409, stop it \
                            and run this one next, or steer it (the content becomes an instruction its agent \
                            takes; no run is enqueued)" } } })
}

fn fork_body() -> Value {
    json!({ "type": "object", "additionalProperties": false, "properties": {
        "after_call": { "type": "integer", "minimum": 0,
            "description": "the recorded calls replayed: positions 1 to this of the run's call log (0: none); \
                            or after_tool_call" },
        "after_tool_call": { "type": "integer", "minimum": 1,
            "description": "the recorded calls replayed: up to the run's tool call with this call_index" },
        "tool_answer": { "description": "the answer call after_call (a tool call) gives instead of the recorded one" },
        "content": { "type": "string", "minLength": 1, "maxLength": 65536,
            "description": "the turn's user message instead of the original's (with after_call 0)" } } })
}

/// An enqueue's answer: the run, or (the strategy `steer` on a busy
/// conversation) the instruction its active turn was given.
fn enqueued_or_steered(g: &mut SchemaGenerator) -> Value {
    let steered = object(vec![
        ("steered", json!({ "const": true })),
        ("run_id", of::<RunId>(g)),
        ("conversation_id", of::<ConversationId>(g)),
        ("steer", of::<SteerView>(g)),
    ]);
    json!({ "anyOf": [of::<Enqueued>(g), steered] })
}

fn steer_body() -> Value {
    json!({ "type": "object", "required": ["content"], "additionalProperties": false, "properties": {
        "content": { "type": "string", "minLength": 1, "maxLength": 65536,
            "description": "the instruction; the agent's next take-instructions answers it" } } })
}

fn responses_body() -> Value {
    json!({ "type": "object", "required": ["model", "input"], "properties": {
        "model": { "type": "string", "description": "the plugin that answers" },
        "input": { "description": "a string, or items: messages, function_call, function_call_output" },
        "instructions": { "type": "string" },
        "metadata": { "type": "object", "description": "at most 16 string pairs" },
        "previous_response_id": { "type": "string" },
        "conversation": { "description": "a conversation id, or {id}" },
        "store": { "type": "boolean", "description": "false is refused: every response is stored" },
        "background": { "type": "boolean" },
        "stream": { "type": "boolean" },
        "tools": { "type": "array", "description": "function tools the client runs" },
        "tool_choice": {} } })
}

fn schedule_body() -> Value {
    json!({ "type": "object", "required": ["plugin", "content", "cron"], "additionalProperties": false, "properties": {
        "plugin": { "type": "string" },
        "content": { "type": "string", "minLength": 1, "maxLength": 65536 },
        "config": { "type": "object" },
        "conversation_id": { "type": "string", "format": "uuid" },
        "cron": { "type": "string", "description": "min hour day month weekday, or with seconds first" },
        "timezone": { "type": "string", "description": "IANA name, default UTC" },
        "webhook": { "type": "string", "description": "told when each run ends; under an allowed prefix" } } })
}

fn decision_body() -> Value {
    json!({ "type": "object", "required": ["decision"], "additionalProperties": false, "properties": {
        "decision": { "type": "string", "enum": ["approve", "reject", "edit"] },
        "args": { "type": "object", "description": "edit only: the arguments the call runs with" },
        "reason": { "type": "string", "maxLength": 2000, "description": "told to the agent on a reject" } } })
}

fn turn_body() -> Value {
    let mut b = run_body();
    b["properties"].as_object_mut().unwrap().remove("conversation_id");
    b
}

fn plugin_form() -> Value {
    json!({ "type": "object", "required": ["name", "component"], "properties": {
        "name": { "type": "string" },
        "component": { "type": "string", "format": "binary" },
        "manifest": { "type": "string", "description": "JSON: {tools, limits}" },
        "published": { "type": "string", "enum": ["true", "false"],
            "description": "operator tokens only: publish to every tenant (default: the caller's tenant alone)" } } })
}

fn token_body() -> Value {
    json!({ "type": "object", "required": ["user_id"], "additionalProperties": false, "properties": {
        "user_id": { "type": "string", "minLength": 1, "maxLength": 200 },
        "tenant_id": { "type": "string", "description": "default: the caller's; only an operator names another" },
        "admin": { "type": "boolean" },
        "operator": { "type": "boolean", "description": "operator tokens only" },
        "expires_in_s": { "type": "integer", "minimum": 1, "maximum": 315360000 } } })
}

/// The console's policy: its own files only, no inline script, no framing.
pub const CONSOLE_CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                               img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// One of the console's files with its type and the policy.
fn console_file(content_type: &'static str, body: &'static str) -> MethodRouter<AppState> {
    use axum::http::header;
    get(move || async move {
        (
            [
                (header::CONTENT_TYPE, content_type),
                (header::CONTENT_SECURITY_POLICY, CONSOLE_CSP),
                (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
                (header::REFERRER_POLICY, "no-referrer"),
            ],
            body,
        )
    })
}

/// The console: one page, its script and its style, no build step, shipped
/// inside the binary.
const CONSOLE_HTML: &str = include_str!("console.html");
const CONSOLE_JS: &str = include_str!("console.js");
const CONSOLE_CSS: &str = include_str!("console.css");

pub const ROUTES: &[Route] = &[
    Route {
        method: "post",
        path: "/v1/runs",
        summary: "Enqueue a run (creates the conversation when absent); optional Idempotency-Key",
        auth: true,
        ok: (
            202,
            "{run_id, status: queued, conversation_id, user_message_id}, or {steered, run_id, conversation_id, steer}",
        ),
        errors: &[400, 404, 409, 413, 415, 422, 429],
        also: &[],
        query: &[],
        body: Some(("application/json", run_body)),
        answer: Answer::Json(enqueued_or_steered),
        handler: || post(runs::create_run),
    },
    Route {
        method: "get",
        path: "/v1/runs/{id}",
        summary: "A run",
        auth: true,
        ok: (
            200,
            "{id, conversation_id, status, plugin, plugin_digest, cancel_requested, error, created_at, started_at, \
             finished_at, last_seq, attempt, pending_approval, usage}",
        ),
        errors: &[400, 404],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(of::<RunView>),
        handler: || get(runs::get_run),
    },
    Route {
        method: "get",
        path: "/v1/runs/{id}/events",
        summary: "The run's events after ?from=N or Last-Event-ID: SSE (text/event-stream) until the run's ending, \
                  or one JSON page; a cursor at or past the ending gets no events (an empty terminal page, or an \
                  SSE stream that ends at once); 503 too_many_streams with Retry-After past the process's bound",
        auth: true,
        ok: (200, "SSE frames, or {events, next_from, terminal}"),
        errors: &[400, 404, 429, 503],
        also: &[],
        query: &[
            ("from", "integer", "the last seq seen (default 0); Last-Event-ID, when sent, wins"),
            (
                "ticket",
                "string",
                "a stream ticket for this run (POST /v1/runs/{id}/stream-ticket), for an \
                                  EventSource (which cannot send headers); a token in the URL is refused",
            ),
        ],
        body: None,
        answer: Answer::JsonOrSse(|_| {
            object(vec![
                (
                    "events",
                    json!({ "type": "array", "items": { "type": "object", "required": ["seq", "type"], "properties": { "seq": { "type": "integer" }, "type": { "type": "string" } } } }),
                ),
                ("next_from", json!({ "type": "integer" })),
                ("terminal", boolean()),
            ])
        }),
        handler: || get(events::events),
    },
    Route {
        method: "post",
        path: "/v1/runs/{id}/cancel",
        summary: "Ask a run to stop (idempotent); 200 with the status when it had already ended",
        auth: true,
        ok: (202, "{id, status, cancel_requested}"),
        errors: &[400, 404],
        also: &[200],
        query: &[],
        body: None,
        answer: Answer::Json(|g| {
            object(vec![("id", of::<RunId>(g)), ("status", of::<RunStatus>(g)), ("cancel_requested", boolean())])
        }),
        handler: || post(runs::cancel_run),
    },
    Route {
        method: "get",
        path: "/a2a/{plugin}/.well-known/agent-card.json",
        summary: "The A2A agent card of an agent the token may run: its name, description and skills (from its \
                  manifest), its JSON-RPC interface (POST /a2a/{plugin}), streaming, bearer tokens",
        auth: true,
        ok: (200, "the agent card (A2A v1.0)"),
        errors: &[404],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(
            |_| json!({ "type": "object", "required": ["name", "supportedInterfaces", "capabilities", "skills"] }),
        ),
        handler: || get(a2a::card),
    },
    Route {
        method: "post",
        path: "/a2a/{plugin}",
        summary: "A2A v1.0, the JSON-RPC binding: SendMessage, SendStreamingMessage (SSE of JSON-RPC responses), \
                  GetTask, ListTasks, CancelTask, SubscribeToTask; a task is a run, its contextId the run's \
                  conversation; protocol errors answer 200 with a JSON-RPC error",
        auth: true,
        ok: (200, "a JSON-RPC response, or text/event-stream of them for the streaming methods"),
        errors: &[403, 404, 413, 429, 503],
        also: &[],
        query: &[],
        body: Some(("application/json", || {
            json!({ "type": "object", "required": ["jsonrpc", "method"], "properties": {
                "jsonrpc": { "const": "2.0" }, "id": { "type": ["string", "integer", "null"] },
                "method": { "type": "string" }, "params": { "type": "object" } } })
        })),
        answer: Answer::JsonOrSse(|_| json!({ "type": "object", "required": ["jsonrpc"] })),
        handler: || post(a2a::rpc),
    },
    Route {
        method: "post",
        path: "/v1/responses",
        summary: "The Responses API: create a response (a run; `model` names the plugin). background: true \
                  answers the queued object at once, stream: true streams its events (SSE, then [DONE]), neither \
                  waits for its end; optional Idempotency-Key; errors as {error: {message, type, param, code}}",
        auth: true,
        ok: (200, "the response object, or text/event-stream of response.* events"),
        errors: &[400, 404, 409, 413, 415, 503],
        also: &[],
        query: &[],
        body: Some(("application/json", responses_body)),
        answer: Answer::JsonOrSse(response_object),
        handler: || post(responses::create),
    },
    Route {
        method: "post",
        path: "/v1/responses/compact",
        summary: "The specification's compaction endpoint, which this host does not serve: 404 in the \
                  specification's error shape",
        auth: true,
        ok: (404, "{error: {message, type, param, code}}"),
        errors: &[],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(|_| json!({ "type": "object" })),
        handler: || post(responses::compact),
    },
    Route {
        method: "get",
        path: "/v1/responses/{id}",
        summary: "A response; ?stream=true streams its events from the start, or those numbered after \
                  ?starting_after=N, live until its end",
        auth: true,
        ok: (200, "the response object, or text/event-stream"),
        errors: &[400, 404, 503],
        also: &[],
        query: &[
            ("stream", "boolean", "stream the response's events (SSE)"),
            ("starting_after", "integer", "with stream: only the events whose sequence_number is greater"),
        ],
        body: None,
        answer: Answer::JsonOrSse(response_object),
        handler: || get(responses::get),
    },
    Route {
        method: "delete",
        path: "/v1/responses/{id}",
        summary: "Delete a response (cancelled first while it runs); later reads do not find it",
        auth: true,
        ok: (200, "{id, object: response, deleted: true}"),
        errors: &[400, 404],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(|_| {
            object(vec![
                ("id", string()),
                ("object", json!({ "const": "response" })),
                ("deleted", json!({ "const": true })),
            ])
        }),
        handler: || delete(responses::delete),
    },
    Route {
        method: "post",
        path: "/v1/responses/{id}/cancel",
        summary: "Cancel a response: 200 with the object, also when it had already ended (never 409)",
        auth: true,
        ok: (200, "the response object"),
        errors: &[400, 404],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(response_object),
        handler: || post(responses::cancel),
    },
    Route {
        method: "get",
        path: "/v1/responses/{id}/input_items",
        summary: "A response's input, as items",
        auth: true,
        ok: (200, "{object: list, data: [items], first_id, last_id, has_more}"),
        errors: &[400, 404],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(|_| {
            object(vec![
                ("object", json!({ "const": "list" })),
                ("data", json!({ "type": "array" })),
                ("first_id", nullable("string")),
                ("last_id", nullable("string")),
                ("has_more", boolean()),
            ])
        }),
        handler: || get(responses::input_items),
    },
    Route {
        method: "post",
        path: "/v1/schedules",
        summary: "Create a schedule: runs of plugin with content (and config) on a cron expression (5 fields, or 6-7 \
                  with seconds) in a time zone (default UTC); each firing is one run however many processes are up",
        auth: true,
        ok: (
            201,
            "{id, plugin, content, config, conversation_id, cron, timezone, webhook, paused, next_fire_at, \
                   last_fired_at, last_run_id, created_at}",
        ),
        errors: &[400, 415, 422],
        also: &[],
        query: &[],
        body: Some(("application/json", schedule_body)),
        answer: Answer::Json(of::<Schedule>),
        handler: || post(schedules::create),
    },
    Route {
        method: "get",
        path: "/v1/schedules",
        summary: "The caller's schedules, oldest first (with all=true, an admin's: every schedule of its tenant)",
        auth: true,
        ok: (200, "{schedules: [...], next_cursor}"),
        errors: &[400, 403],
        also: &[],
        query: &[
            ("limit", "integer", "1-1000 (default 1000)"),
            ("after", "string", "the next_cursor of the previous page"),
            ("all", "boolean", "true: every schedule the caller may change (admins: the tenant's; operators: all)"),
        ],
        body: None,
        answer: Answer::Json(|g| page::<Schedule>(g, "schedules")),
        handler: || get(schedules::list),
    },
    Route {
        method: "post",
        path: "/v1/schedules/{id}/pause",
        summary: "Pause a schedule",
        auth: true,
        ok: (200, "the schedule"),
        errors: &[400, 404],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(of::<Schedule>),
        handler: || post(schedules::pause),
    },
    Route {
        method: "post",
        path: "/v1/schedules/{id}/resume",
        summary: "Resume a schedule: it fires next at its next time after now",
        auth: true,
        ok: (200, "the schedule"),
        errors: &[400, 404],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(of::<Schedule>),
        handler: || post(schedules::resume),
    },
    Route {
        method: "get",
        path: "/v1/schedules/{id}",
        summary: "One schedule the caller may change (its own; an admin's: its tenant's)",
        auth: true,
        ok: (200, "the schedule"),
        errors: &[400, 404],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(of::<Schedule>),
        handler: || get(schedules::get_one),
    },
    Route {
        method: "delete",
        path: "/v1/schedules/{id}",
        summary: "Delete a schedule (runs it started are not touched)",
        auth: true,
        ok: (204, "nothing"),
        errors: &[400, 404],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Empty,
        handler: || delete(schedules::delete),
    },
    Route {
        method: "get",
        path: "/v1/approvals",
        summary: "The caller's pending approvals (tool calls a waiting run asks a person to decide), oldest first \
                  (with all=true, an admin's: its tenant's)",
        auth: true,
        ok: (
            200,
            "{approvals: [{run_id, conversation_id, call_id, tool, args, requested_at, expires_at}], next_cursor}",
        ),
        errors: &[400, 403],
        also: &[],
        query: &[
            ("limit", "integer", "1-1000 (default 1000)"),
            ("after", "string", "the next_cursor of the previous page"),
            ("all", "boolean", "true: the pending approvals the caller may decide (admins: its tenant's)"),
        ],
        body: None,
        answer: Answer::Json(|g| page::<Pending>(g, "approvals")),
        handler: || get(approvals::list_approvals),
    },
    Route {
        method: "post",
        path: "/v1/runs/{id}/approvals/{call_id}",
        summary: "Decide a waiting run's tool call: approve, reject (the agent gets denied with the reason) or edit \
                  (approve with other args); recorded once with the run re-queued; a second decision answers 409 \
                  with the first",
        auth: true,
        ok: (200, "{run_id, status: queued, decision: {call_id, decision, args?, reason?, decided_at}}"),
        errors: &[400, 403, 404, 409, 422],
        also: &[],
        query: &[],
        body: Some(("application/json", decision_body)),
        answer: Answer::Json(|g| {
            object(vec![
                ("run_id", of::<RunId>(g)),
                ("status", json!({ "const": "queued" })),
                ("decision", json!({ "type": "object" })),
            ])
        }),
        handler: || post(approvals::decide),
    },
    Route {
        method: "post",
        path: "/v1/runs/{id}/retry",
        summary: "A new run for the same message: only for a failed or cancelled latest turn",
        auth: true,
        ok: (202, "{run_id, status: queued, conversation_id, user_message_id}"),
        errors: &[400, 404, 409],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(of::<Enqueued>),
        handler: || post(runs::retry_run),
    },
    Route {
        method: "post",
        path: "/v1/runs/{id}/fork",
        summary: "A new conversation whose first turn replays this run's recorded calls up to a point (an edited \
                  tool answer there, or an edited message from the start), then runs live; the original is untouched",
        auth: true,
        ok: (202, "{run_id, status: queued, conversation_id, user_message_id}"),
        errors: &[400, 404, 409, 413, 415, 422, 429],
        also: &[],
        query: &[],
        body: Some(("application/json", fork_body)),
        answer: Answer::Json(of::<Enqueued>),
        handler: || post(runs::fork_run),
    },
    Route {
        method: "post",
        path: "/v1/runs/{id}/steer",
        summary: "Queue an instruction for the run's turn: its agent takes it at its next host-call boundary \
                  (take-instructions); refused once the run has ended",
        auth: true,
        ok: (202, "{id, run_id, content, source, created_at, announced_at, taken_at}"),
        errors: &[400, 404, 409, 413, 415, 422],
        also: &[],
        query: &[],
        body: Some(("application/json", steer_body)),
        answer: Answer::Json(of::<SteerView>),
        handler: || post(runs::steer_run),
    },
    Route {
        method: "get",
        path: "/v1/runs/{id}/steers",
        summary: "The run's instructions, oldest first: when each was queued, announced and taken",
        auth: true,
        ok: (200, "{steers: [{id, run_id, content, source, created_at, announced_at, taken_at}]}"),
        errors: &[400, 404],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(|g| object(vec![("steers", json!({ "type": "array", "items": of::<SteerView>(g) }))])),
        handler: || get(runs::list_steers),
    },
    Route {
        method: "get",
        path: "/v1/runs",
        summary: "The caller's runs, newest first, 100 a page unless ?limit says otherwise",
        auth: true,
        ok: (
            200,
            "{runs: [{id, conversation_id, status, plugin, error, created_at, started_at, finished_at}], next_cursor}",
        ),
        errors: &[400],
        also: &[],
        query: &[
            ("limit", "integer", "items on this page, 1 to 1000 (default: the list's page size)"),
            ("after", "string", "the next_cursor of the previous page"),
            ("status", "string", "only runs in this status"),
        ],
        body: None,
        answer: Answer::Json(|g| page::<RunSummary>(g, "runs")),
        handler: || get(runs::list_runs),
    },
    Route {
        method: "post",
        path: "/v1/conversations",
        summary: "Create a conversation",
        auth: true,
        ok: (201, "{id, created_at}"),
        errors: &[],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(|g| object(vec![("id", of::<ConversationId>(g)), ("created_at", timestamp())])),
        handler: || post(conversations::create_conversation),
    },
    Route {
        method: "get",
        path: "/v1/conversations",
        summary: "The caller's conversations, newest first, 100 a page unless ?limit says otherwise",
        auth: true,
        ok: (200, "{conversations: [{id, created_at, title, latest_run_id, latest_status}], next_cursor}"),
        errors: &[400],
        also: &[],
        query: PAGING,
        body: None,
        answer: Answer::Json(|g| page::<ConversationSummary>(g, "conversations")),
        handler: || get(conversations::list_conversations),
    },
    Route {
        method: "get",
        path: "/v1/conversations/{id}",
        summary: "A conversation with its active and queued runs",
        auth: true,
        ok: (200, "{id, created_at, active_run_id, queued_run_ids, usage}"),
        errors: &[400, 404],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(of::<ConversationView>),
        handler: || get(conversations::get_conversation),
    },
    Route {
        method: "get",
        path: "/v1/conversations/{id}/messages",
        summary: "The transcript in turn order, 1000 a page unless ?limit says otherwise",
        auth: true,
        ok: (200, "{messages: [{id, role, content, status, run_id, created_at}], next_cursor}"),
        errors: &[400, 404],
        also: &[],
        query: PAGING,
        body: None,
        answer: Answer::Json(|g| page::<MessageView>(g, "messages")),
        handler: || get(conversations::conversation_messages),
    },
    Route {
        method: "post",
        path: "/v1/conversations/{id}/runs",
        summary: "Enqueue the conversation's next turn; optional Idempotency-Key",
        auth: true,
        ok: (
            202,
            "{run_id, status: queued, conversation_id, user_message_id}, or {steered, run_id, conversation_id, steer}",
        ),
        errors: &[400, 404, 409, 413, 415, 422, 429],
        also: &[],
        query: &[],
        body: Some(("application/json", turn_body)),
        answer: Answer::Json(enqueued_or_steered),
        handler: || post(runs::create_run_in_conversation),
    },
    Route {
        method: "post",
        path: "/v1/conversations/{id}/stop",
        summary: "Stop every queued and running turn in one transaction",
        auth: true,
        ok: (200, "{cancelled: [run ids], cancelling: [run ids], drafts: [{message_id, content}]}"),
        errors: &[400, 404],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(of::<Stopped>),
        handler: || post(conversations::stop_conversation),
    },
    Route {
        method: "get",
        path: "/v1/plugins",
        summary: "The plugins the caller may run (its tenant's, then published ones) and built-in agents, by name, \
                  100 a page unless ?limit says otherwise",
        auth: true,
        ok: (
            200,
            "{plugins: [{name, digest, language, manifest, size_bytes, updated_at, tenant_id, builtin}], next_cursor}",
        ),
        errors: &[400],
        also: &[],
        query: PAGING,
        body: None,
        answer: Answer::Json(|g| {
            object(vec![
                ("plugins", json!({ "type": "array", "items": plugin(g) })),
                ("next_cursor", nullable("string")),
            ])
        }),
        handler: || get(plugins::list),
    },
    Route {
        method: "post",
        path: "/v1/plugins",
        summary: "Register a WebAssembly component under a name in the caller's tenant (admin tokens only), or \
                  published to every tenant (operator tokens, published=true)",
        auth: true,
        ok: (201, "{name, digest, language, manifest}"),
        errors: &[400, 403, 413, 415, 422],
        also: &[],
        query: &[],
        body: Some(("multipart/form-data", plugin_form)),
        answer: Answer::Json(plugin),
        handler: || {
            post(plugins::upload)
                .layer(axum::extract::DefaultBodyLimit::max(crate::service::plugins::COMPONENT_BYTES_MAX + 64 * 1024))
        },
    },
    Route {
        method: "get",
        path: "/v1/tools",
        summary: "The host tools the caller's tenant may grant its plugins and call (the model, the durable wait, \
                  webhooks, the http tool, each MCP server's tools as SERVER.TOOL), with descriptions and input \
                  schemas, as a plugin granted them sees them, by name, 1000 a page unless ?limit says otherwise; \
                  MCP servers that cannot be listed now are named in unavailable",
        auth: true,
        ok: (200, "{tools: [{name, kind, description, input_schema}], unavailable: [server names], next_cursor}"),
        errors: &[400],
        also: &[],
        query: PAGING,
        body: None,
        answer: Answer::Json(|_| {
            let tool = json!({ "type": "object", "required": ["name", "kind", "description", "input_schema"],
                "properties": {
                    "name": { "type": "string" },
                    "kind": { "type": "string", "enum": ["model", "wait", "http", "webhook", "mcp", "host"] },
                    "description": { "type": ["string", "null"] },
                    "input_schema": { "type": "object" } } });
            object(vec![
                ("tools", json!({ "type": "array", "items": tool })),
                ("unavailable", json!({ "type": "array", "items": { "type": "string" } })),
                ("next_cursor", nullable("string")),
            ])
        }),
        handler: || get(tools::list),
    },
    Route {
        method: "post",
        path: "/v1/runs/{id}/stream-ticket",
        summary: "A short-lived ticket that opens this run's event stream alone (?ticket=), so no token rides in a URL",
        auth: true,
        ok: (201, "{ticket, expires_at, url}"),
        errors: &[400, 404],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(|_| object(vec![("ticket", string()), ("expires_at", timestamp()), ("url", string())])),
        handler: || post(tokens::stream_ticket),
    },
    Route {
        method: "get",
        path: "/v1/tokens",
        summary: "Tokens (admins: their tenant's; operators: all): id, user, tenant, admin, created, last used, \
                  expiry, revoked; never a secret",
        auth: true,
        ok: (
            200,
            "{tokens: [{id, user_id, tenant_id, admin, operator, created_at, last_used_at, expires_at, revoked_at}]}",
        ),
        errors: &[403],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(|g| {
            object(vec![("tokens", json!({ "type": "array", "items": of::<TokenInfo>(g) })), ("truncated", boolean())])
        }),
        handler: || get(tokens::list),
    },
    Route {
        method: "post",
        path: "/v1/tokens",
        summary: "Create a token (admins: in their tenant; operators: anywhere); the secret is shown this once",
        auth: true,
        ok: (201, "{id, user_id, tenant_id, admin, operator, created_at, expires_at, token}"),
        errors: &[400, 403, 415, 422],
        also: &[],
        query: &[],
        body: Some(("application/json", token_body)),
        answer: Answer::Json(|g| {
            let mut t = of::<TokenInfo>(g);
            t = json!({ "allOf": [t, { "type": "object", "required": ["token"], "properties": { "token": { "type": "string" } } }] });
            t
        }),
        handler: || post(tokens::create),
    },
    Route {
        method: "post",
        path: "/v1/tokens/{id}/revoke",
        summary: "Revoke a token (operators: any; admins: their tenant's; others: their own): every process refuses \
                  it at once, and its open streams end within a keepalive",
        auth: true,
        ok: (200, "{id, revoked: true}"),
        errors: &[400, 404],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(|_| object(vec![("id", string()), ("revoked", json!({ "const": true }))])),
        handler: || post(tokens::revoke),
    },
    Route {
        method: "get",
        path: "/v1/webhooks/signing-key",
        summary: "The key the caller's tenant's completion webhooks are signed with (admins), whsec_<base64>",
        auth: true,
        ok: (200, "{tenant_id, key}"),
        errors: &[403, 404],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(|_| object(vec![("tenant_id", string()), ("key", string())])),
        handler: || get(webhooks::signing_key),
    },
    Route {
        method: "get",
        path: "/v1/audit",
        summary: "The audit trail, oldest first (admins: their tenant's and operator-wide rows; operators: all)",
        auth: true,
        ok: (
            200,
            "{events: [{id, at, actor_user, actor_tenant, actor_token, tenant_id, action, target, detail}], \
                   next_cursor}",
        ),
        errors: &[400, 403],
        also: &[],
        query: &[
            ("limit", "integer", "1-1000 (default 1000)"),
            ("after", "integer", "the next_cursor of the previous page"),
        ],
        body: None,
        answer: Answer::Json(|g| page::<AuditEvent>(g, "events")),
        handler: || get(audit::list),
    },
    Route {
        method: "get",
        path: "/v1/usage",
        summary: "Model tokens and cost (USD, by the tools file's [[price]] table) by tenant, UTC day, provider \
                  and model, as the providers reported them, newest day first (admins: their tenant's; operators: \
                  every tenant's)",
        auth: true,
        ok: (
            200,
            "{usage: [{tenant_id, day, user_id (by=user), provider, model, calls, prompt_tokens, completion_tokens, \
             cached_tokens, cost_usd}]}",
        ),
        errors: &[400, 403],
        also: &[],
        query: &[
            ("days", "integer", "1-366 (default 31): today and the days before it"),
            ("by", "string", "user: a row per user too (user_id, the run owner)"),
        ],
        body: None,
        answer: Answer::Json(|g| {
            object(vec![("usage", json!({ "type": "array", "items": of::<crate::db::model_limits::UsageDay>(g) }))])
        }),
        handler: || get(usage::list),
    },
    Route {
        method: "get",
        path: "/healthz",
        summary: "Liveness",
        auth: false,
        ok: (200, "{status: ok}"),
        errors: &[],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(|_| object(vec![("status", json!({ "const": "ok" }))])),
        handler: || get(|| async { axum::Json(json!({ "status": "ok" })) }),
    },
    Route {
        method: "get",
        path: "/readyz",
        summary: "Readiness: the database answers and migrations are applied",
        auth: false,
        ok: (200, "{status: ready}"),
        errors: &[503],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(|_| object(vec![("status", json!({ "const": "ready" }))])),
        handler: || get(super::readyz),
    },
    Route {
        method: "get",
        path: "/metrics",
        summary: "Prometheus text",
        auth: false,
        ok: (200, "text/plain; version=0.0.4"),
        errors: &[],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Text("text/plain"),
        handler: || get(metrics::metrics),
    },
    Route {
        method: "get",
        path: "/",
        summary: "The web console",
        auth: false,
        ok: (200, "text/html"),
        errors: &[],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Text("text/html"),
        handler: || console_file("text/html; charset=utf-8", CONSOLE_HTML),
    },
    Route {
        method: "get",
        path: "/console.js",
        summary: "The console's script",
        auth: false,
        ok: (200, "text/javascript"),
        errors: &[],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Text("text/javascript"),
        handler: || console_file("text/javascript; charset=utf-8", CONSOLE_JS),
    },
    Route {
        method: "get",
        path: "/console.css",
        summary: "The console's style",
        auth: false,
        ok: (200, "text/css"),
        errors: &[],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Text("text/css"),
        handler: || console_file("text/css; charset=utf-8", CONSOLE_CSS),
    },
    Route {
        method: "get",
        path: "/openapi.json",
        summary: "This document",
        auth: false,
        ok: (200, "OpenAPI 3.1"),
        errors: &[],
        also: &[],
        query: &[],
        body: None,
        answer: Answer::Json(|_| json!({ "type": "object", "required": ["openapi", "paths"] })),
        handler: || get(|| async { axum::Json(openapi()) }),
    },
];

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        400 => "malformed body or id",
        401 => "no or unknown token",
        403 => "not allowed",
        429 => "past a quota or rate limit (see Retry-After)",
        404 => "unknown, or someone else's",
        409 => "conflict",
        413 => "too large",
        415 => "wrong content type",
        422 => "invalid",
        503 => "not available now: not ready, or too many live streams (see Retry-After)",
        _ => "see the error's message",
    }
}

/// The OpenAPI 3.1 document of [`ROUTES`]: every path parameter declared,
/// every answer's schema (named types under `components/schemas`, derived
/// from the Rust types the handlers answer with), every error the Error shape.
pub fn openapi() -> Value {
    let mut g = schemars::generate::SchemaSettings::draft2020_12()
        .with(|s| s.definitions_path = "/components/schemas".into())
        .into_generator();
    let error = json!({ "description": "", "content": { "application/json": { "schema": { "$ref": "#/components/schemas/Error" } } } });
    let codes: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
    let mut paths = Map::new();
    for r in ROUTES {
        let mut responses = Map::new();
        let ok = success(&mut g, r);
        for status in r.also {
            responses.insert(status.to_string(), ok.clone());
        }
        responses.insert(r.ok.0.to_string(), ok);
        let auth_errors: &[u16] = if r.auth { &[401] } else { &[] };
        // A body a handler cannot parse is refused before it runs.
        let body_errors: &[u16] = if r.body.is_some() { &[400, 413, 415, 422] } else { &[] };
        for status in r.errors.iter().chain(auth_errors).chain(body_errors) {
            let mut e = error.clone();
            e["description"] = json!(reason(*status));
            responses.insert(status.to_string(), e);
        }
        let mut op = json!({
            "summary": r.summary,
            "operationId": format!("{}{}", r.method, r.path.replace(['/', '{', '}', '.'], "_")),
            "responses": responses,
        });
        if r.auth {
            op["security"] = json!([{ "bearer": [] }]);
        }
        let mut parameters = path_parameters(r.path);
        for (name, kind, description) in r.query {
            let mut schema = json!({ "type": kind });
            if *name == "limit" {
                schema = json!({ "type": kind, "minimum": 1, "maximum": LIMIT_MAX });
            }
            parameters.push(
                json!({ "name": name, "in": "query", "required": false, "description": description, "schema": schema }),
            );
        }
        if !parameters.is_empty() {
            op["parameters"] = json!(parameters);
        }
        if let Some((content_type, schema)) = r.body {
            op["requestBody"] = json!({ "required": true, "content": { content_type: { "schema": schema() } } });
        }
        let item = paths.entry(r.path).or_insert_with(|| json!({}));
        item[r.method] = op;
    }
    let mut schemas = g.take_definitions(true);
    schemas.insert(
        "Error".to_string(),
        json!({ "type": "object", "required": ["error"], "properties": { "error": {
            "type": "object", "required": ["code", "message"],
            "properties": { "code": { "type": "string", "enum": codes }, "message": { "type": "string" } } } } }),
    );
    json!({
        "openapi": "3.1.0",
        "info": { "title": "agent-host", "version": env!("CARGO_PKG_VERSION") },
        "paths": paths,
        "components": {
            "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer" } },
            "schemas": schemas,
        }
    })
}

/// The success answer of `r`: its description and content.
fn success(g: &mut SchemaGenerator, r: &Route) -> Value {
    let json_of = |schema: Value| json!({ "application/json": { "schema": schema } });
    let content = match &r.answer {
        Answer::Json(schema) => json_of(schema(g)),
        Answer::JsonOrSse(schema) => {
            let mut c = json_of(schema(g));
            // Each event as a reader sees it: its name, data and id.
            c["text/event-stream"] = json!({ "schema": { "type": "object", "properties": {
                "event": { "type": "string" }, "data": { "type": "string" }, "id": { "type": "string" } } } });
            c
        }
        Answer::Text(content_type) => json!({ *content_type: { "schema": { "type": "string" } } }),
        Answer::Empty => return json!({ "description": r.ok.1 }),
    };
    json!({ "description": r.ok.1, "content": content })
}

/// Every `{name}` of `path`, declared: a response id is `resp_` and hex (a
/// run id is accepted too), an approval's `call_id` a non-negative integer,
/// any other id a UUID.
fn path_parameters(path: &str) -> Vec<Value> {
    path.split('/')
        .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
        .map(|name| {
            let schema = match name {
                "call_id" => json!({ "type": "integer", "minimum": 0, "maximum": i32::MAX }),
                "plugin" => json!({ "type": "string", "pattern": "^[a-z][a-z0-9_-]{0,63}$" }),
                _ if path.starts_with("/v1/responses/") => {
                    json!({ "type": "string", "pattern": "^(resp_)?[0-9a-fA-F-]{32,36}$" })
                }
                _ => json!({ "type": "string", "format": "uuid" }),
            };
            json!({ "name": name, "in": "path", "required": true, "schema": schema })
        })
        .collect()
}
