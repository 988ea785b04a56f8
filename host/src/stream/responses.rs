//! The Responses API's view of a run: its response object and its stream of
//! `response.*` events, both derived from the run's journal (through the
//! journal tail) and its row, never kept anywhere else. Any process computes
//! the same events with the same `sequence_number`s:
//!
//! - the view is a fold over the journal from its first row; each row maps to
//!   a fixed list of events (`response.created` is always number 0, then one
//!   number per event in journal order), and journal rows never change once
//!   written (deltas are merged before they are appended);
//! - `starting_after=N` replays the fold from the start and sends only the
//!   events numbered after N: exactly the remaining ones, on any process;
//! - the final snapshot is built from the run's terminal row (status, error,
//!   usage, finish time), which no longer changes either.
//!
//! What a row maps to:
//! - `run_queued` -> `response.queued`; `run_started` -> `response.in_progress`;
//! - `content_delta` -> `response.output_text.delta` (the first one of a
//!   message after `response.output_item.added` and `response.content_part.added`);
//! - `function_call` (the host's, from a turn's client calls: [`FUNCTION_CALL`]) -> the open
//!   message is closed, then a `function_call` item (added, arguments delta and
//!   done, done): a call the client runs;
//! - `complete` -> the open message is closed (`output_text.done`,
//!   `content_part.done`, `output_item.done`), then `response.completed`,
//!   `response.failed`, or for a cancelled run `response.incomplete` whose
//!   snapshot has `status: "cancelled"` (the specification has no cancelled
//!   event).
//!
//! `content_rollback` (a resumed model call dropped streamed text) cuts the
//! text of the snapshots and of `output_text.done`; deltas already sent
//! cannot be taken back on this wire.
//!
//! A message's text is bounded like a stored final answer: beyond
//! [`ANSWER_BYTES_MAX`] it is cut with the same marker as [`crate::text::cut`]
//! (and the same result), and the fold keeps no more than that bound of it,
//! however much the journal streamed.

use std::borrow::Cow;
use std::collections::VecDeque;

use chrono::{DateTime, Utc};
use futures::{Stream, StreamExt};
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::db::events::{COMPLETE, CONTENT_DELTA, CONTENT_ROLLBACK, FUNCTION_CALL, RUN_QUEUED, RUN_STARTED};
use crate::db::journal::Event;
use crate::db::responses::{self as rows, ResponseRow};
use crate::db::{RunId, RunStatus};
use crate::stream::tail::{Item, Reserved, TailError, TailStream, Tails, TooManyTails};
use crate::text::ANSWER_BYTES_MAX;

/// The prefix of a response id (`resp_` and the run id's 32 hex digits).
pub const RESPONSE_ID_PREFIX: &str = "resp_";
/// The config key that keeps the Responses request of a run.
pub const REQUEST_KEY: &str = "responses";

/// A run's response id.
pub fn response_id(run: RunId) -> String {
    format!("{RESPONSE_ID_PREFIX}{}", run.0.simple())
}

/// The run a response id names (`resp_<hex>`, or the run id itself).
pub fn parse_response_id(id: &str) -> Option<RunId> {
    let raw = id.strip_prefix(RESPONSE_ID_PREFIX).unwrap_or(id);
    raw.parse().ok()
}

/// The status word of a run, in the Responses vocabulary.
pub fn status_word(status: RunStatus) -> &'static str {
    match status {
        RunStatus::Queued => "queued",
        RunStatus::Running | RunStatus::Waiting => "in_progress",
        RunStatus::Completed => "completed",
        RunStatus::Failed => "failed",
        RunStatus::Cancelled => "cancelled",
    }
}

/// The `usage` object of a response from a run's usage (`{prompt_tokens,
/// completion_tokens}`); a run that called no model used no tokens.
pub fn usage_object(usage: Option<&Value>) -> Value {
    let tokens = |k: &str| usage.and_then(|u| u.get(k)).and_then(Value::as_u64).unwrap_or(0);
    let (input, output) = (tokens("prompt_tokens"), tokens("completion_tokens"));
    json!({
        "input_tokens": input,
        "output_tokens": output,
        "total_tokens": input + output,
        "input_tokens_details": { "cached_tokens": tokens("cached_tokens") },
        "output_tokens_details": { "reasoning_tokens": 0 },
    })
}

/// One output item of a response.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// Assistant text; `done` once closed (then `status` is final).
    Message { id: String, text: Text, status: &'static str },
    /// A call of a function the client runs.
    FunctionCall { id: String, call_id: String, name: String, arguments: String },
}

impl Output {
    pub fn to_json(&self) -> Value {
        match self {
            Output::Message { id, text, status } => {
                let content =
                    if *status == "in_progress" && text.is_empty() { json!([]) } else { json!([part(&text.shown())]) };
                json!({ "type": "message", "id": id, "status": status, "role": "assistant", "content": content })
            }
            Output::FunctionCall { id, call_id, name, arguments } => json!({
                "type": "function_call", "id": id, "call_id": call_id, "name": name,
                "arguments": arguments, "status": "completed",
            }),
        }
    }
}

fn part(text: &str) -> Value {
    json!({ "type": "output_text", "text": text, "annotations": [], "logprobs": [] })
}

/// A message's streamed text, kept up to [`ANSWER_BYTES_MAX`] bytes; what
/// streamed beyond is only counted.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Text {
    /// The first bytes of the text (up to the bound, at a character boundary).
    kept: String,
    /// The bytes and characters streamed after `kept`.
    over_bytes: usize,
    over_chars: usize,
}

impl Text {
    /// The text as shown: whole, or past the bound cut as [`crate::text::cut`]
    /// cuts it (at most [`ANSWER_BYTES_MAX`] bytes, with its marker).
    pub fn shown(&self) -> Cow<'_, str> {
        let total = self.kept.len() + self.over_bytes;
        if total <= ANSWER_BYTES_MAX {
            return Cow::Borrowed(&self.kept);
        }
        // As `crate::text::cut`: room for the marker with the widest count it could carry.
        let mut end = ANSWER_BYTES_MAX.saturating_sub(cut_marker(total).len()).min(self.kept.len());
        while !self.kept.is_char_boundary(end) {
            end -= 1;
        }
        Cow::Owned(format!("{}{}", &self.kept[..end], cut_marker(total - end)))
    }

    pub fn is_empty(&self) -> bool {
        self.kept.is_empty() && self.over_bytes == 0
    }

    fn chars(&self) -> usize {
        self.kept.chars().count() + self.over_chars
    }

    fn push(&mut self, delta: &str) {
        if self.over_bytes == 0 {
            let mut fit = ANSWER_BYTES_MAX.saturating_sub(self.kept.len()).min(delta.len());
            while !delta.is_char_boundary(fit) {
                fit -= 1;
            }
            self.kept.push_str(&delta[..fit]);
            if fit == delta.len() {
                return;
            }
            let rest = &delta[fit..];
            self.over_bytes = rest.len();
            self.over_chars = rest.chars().count();
        } else {
            self.over_bytes += delta.len();
            self.over_chars += delta.chars().count();
        }
    }

    /// Drops the last `n` characters (as many as there are at most); returns
    /// how many were dropped. Characters past the bound are not kept, so
    /// dropping some of them counts one byte a character (exact for ASCII).
    fn drop_last(&mut self, n: usize) -> usize {
        let over = n.min(self.over_chars);
        self.over_chars -= over;
        self.over_bytes =
            if self.over_chars == 0 { 0 } else { self.over_bytes.saturating_sub(over).max(self.over_chars) };
        let kept_chars = self.kept.chars().count();
        let cut = (n - over).min(kept_chars);
        if cut > 0 {
            let end = self.kept.char_indices().nth(kept_chars - cut).map_or(self.kept.len(), |(i, _)| i);
            self.kept.truncate(end);
        }
        over + cut
    }
}

/// The marker [`crate::text::cut`] appends (checked against it by the tests).
fn cut_marker(bytes_cut: usize) -> String {
    format!(" [… {bytes_cut} bytes cut]")
}

/// How a run ended, for the final snapshot.
#[derive(Debug, Clone, PartialEq)]
pub struct Ending {
    pub status: RunStatus,
    pub error: Option<String>,
    pub usage: Option<Value>,
    pub finished_at: Option<DateTime<Utc>>,
    /// The answer the transcript keeps: the output of a completed run whose
    /// plugin streamed no text of it.
    pub answer: Option<String>,
}

/// The fold of one run's journal into its response.
#[derive(Debug, Clone)]
pub struct View {
    run: RunId,
    created_at: i64,
    model: String,
    /// The Responses request kept in the run's config.
    request: Value,
    status: &'static str,
    output: Vec<Output>,
    /// The message receiving deltas, by index into `output`.
    open: Option<usize>,
    next_seq: u64,
    ending: Option<Ending>,
}

impl View {
    pub fn new(row: &ResponseRow) -> View {
        View {
            run: row.id,
            created_at: row.created_at.timestamp(),
            model: row.plugin.clone(),
            request: row.config.get(REQUEST_KEY).cloned().unwrap_or_else(|| json!({})),
            status: "queued",
            output: Vec::new(),
            open: None,
            next_seq: 0,
            ending: None,
        }
    }

    /// The output items so far.
    pub fn output(&self) -> &[Output] {
        &self.output
    }

    /// Whether the fold has seen the run's `complete`.
    pub fn ended(&self) -> bool {
        self.ending.is_some()
    }

    fn event(&mut self, kind: &str, mut body: Value) -> Value {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.next_seq);
        self.next_seq += 1;
        body
    }

    fn snapshot_event(&mut self, kind: &str) -> Value {
        let response = self.snapshot();
        self.event(kind, json!({ "response": response }))
    }

    /// `response.created`: number 0 of every replay.
    pub fn start(&mut self) -> Vec<Value> {
        vec![self.snapshot_event("response.created")]
    }

    /// The events one journal row maps to. After a `complete`, the caller
    /// reads the run's ending and calls [`View::finish`].
    pub fn apply(&mut self, e: &Event) -> Vec<Value> {
        if self.ending.is_some() {
            return Vec::new();
        }
        match e.kind.as_str() {
            RUN_QUEUED => vec![self.snapshot_event("response.queued")],
            RUN_STARTED => {
                self.status = "in_progress";
                vec![self.snapshot_event("response.in_progress")]
            }
            CONTENT_DELTA => match e.payload.get("delta").and_then(Value::as_str) {
                Some(delta) if !delta.is_empty() => self.delta(delta),
                _ => Vec::new(),
            },
            CONTENT_ROLLBACK => {
                let keep = e.payload.get("keep_chars").and_then(Value::as_u64).unwrap_or(0) as usize;
                self.rollback(keep);
                Vec::new()
            }
            FUNCTION_CALL => match function_call(&e.payload) {
                Some((call_id, name, arguments)) => self.function_call(call_id, name, arguments),
                None => Vec::new(),
            },
            _ => Vec::new(),
        }
    }

    fn delta(&mut self, delta: &str) -> Vec<Value> {
        let mut out = Vec::new();
        let index = match self.open {
            Some(i) => i,
            None => {
                let i = self.output.len();
                let id = format!("msg_{}_{i}", self.run.0.simple());
                self.output.push(Output::Message { id: id.clone(), text: Text::default(), status: "in_progress" });
                self.open = Some(i);
                let item = self.output[i].to_json();
                out.push(self.event("response.output_item.added", json!({ "output_index": i, "item": item })));
                out.push(self.event(
                    "response.content_part.added",
                    json!({ "item_id": id, "output_index": i, "content_index": 0, "part": part("") }),
                ));
                i
            }
        };
        let Output::Message { id, text, .. } = &mut self.output[index] else { unreachable!("open is a message") };
        text.push(delta);
        let id = id.clone();
        out.push(self.event(
            "response.output_text.delta",
            json!({ "item_id": id, "output_index": index, "content_index": 0, "delta": delta, "logprobs": [] }),
        ));
        out
    }

    /// The answer so far is its first `keep` characters.
    fn rollback(&mut self, keep: usize) {
        let total: usize = self.texts().map(Text::chars).sum();
        let mut drop = total.saturating_sub(keep);
        for item in self.output.iter_mut().rev() {
            if let Output::Message { text, .. } = item {
                drop -= text.drop_last(drop);
            }
        }
    }

    fn texts(&self) -> impl Iterator<Item = &Text> {
        self.output.iter().filter_map(|o| match o {
            Output::Message { text, .. } => Some(text),
            _ => None,
        })
    }

    /// Closes the message receiving deltas, with its final status.
    fn close(&mut self, status: &'static str) -> Vec<Value> {
        let Some(i) = self.open.take() else { return Vec::new() };
        let Output::Message { id, text, status: s } = &mut self.output[i] else { unreachable!("open is a message") };
        *s = status;
        let (id, text) = (id.clone(), text.shown().into_owned());
        let item = self.output[i].to_json();
        vec![
            self.event(
                "response.output_text.done",
                json!({ "item_id": id, "output_index": i, "content_index": 0, "text": text, "logprobs": [] }),
            ),
            self.event(
                "response.content_part.done",
                json!({ "item_id": id, "output_index": i, "content_index": 0, "part": part(&text) }),
            ),
            self.event("response.output_item.done", json!({ "output_index": i, "item": item })),
        ]
    }

    fn function_call(&mut self, call_id: String, name: String, arguments: String) -> Vec<Value> {
        let mut out = self.close("completed");
        let i = self.output.len();
        let id = format!("fc_{}_{i}", self.run.0.simple());
        let call = Output::FunctionCall { id: id.clone(), call_id, name, arguments: arguments.clone() };
        let mut added = call.to_json();
        added["arguments"] = json!("");
        added["status"] = json!("in_progress");
        self.output.push(call);
        out.push(self.event("response.output_item.added", json!({ "output_index": i, "item": added })));
        out.push(self.event(
            "response.function_call_arguments.delta",
            json!({ "item_id": id, "output_index": i, "delta": arguments }),
        ));
        out.push(self.event(
            "response.function_call_arguments.done",
            json!({ "item_id": id, "output_index": i, "arguments": arguments }),
        ));
        let item = self.output[i].to_json();
        out.push(self.event("response.output_item.done", json!({ "output_index": i, "item": item })));
        out
    }

    /// The run's ending: the open message closed, then the terminal event.
    pub fn finish(&mut self, ending: Ending) -> Vec<Value> {
        if self.ending.is_some() {
            return Vec::new();
        }
        let mut out = Vec::new();
        let streamed = self.texts().any(|t| !t.is_empty());
        if let Some(answer) = ending.answer.as_deref().filter(|a| !a.is_empty() && !streamed) {
            if ending.status == RunStatus::Completed {
                out.extend(self.delta(answer));
            }
        }
        out.extend(self.close(if ending.status == RunStatus::Completed { "completed" } else { "incomplete" }));
        self.status = status_word(ending.status);
        let kind = match ending.status {
            RunStatus::Completed => "response.completed",
            RunStatus::Failed => "response.failed",
            _ => "response.incomplete",
        };
        self.ending = Some(ending);
        out.push(self.snapshot_event(kind));
        out
    }

    /// The response object as the fold stands (the run's current status
    /// comes from its row for reads that do not stream: [`View::with_status`]).
    pub fn snapshot(&self) -> Value {
        let r = &self.request;
        let field = |k: &str| r.get(k).cloned().unwrap_or(Value::Null);
        let ending = self.ending.as_ref();
        let error = ending.and_then(|e| e.error.as_ref()).filter(|_| self.status == "failed");
        json!({
            "id": response_id(self.run),
            "object": "response",
            "created_at": self.created_at,
            "completed_at": ending.and_then(|e| e.finished_at).map(|t| t.timestamp()),
            "status": self.status,
            "incomplete_details": Value::Null,
            "model": self.model,
            "previous_response_id": field("previous_response_id"),
            "instructions": field("instructions"),
            "output": self.output.iter().map(Output::to_json).collect::<Vec<_>>(),
            "error": error.map(|m| json!({ "code": "server_error", "message": m })),
            "tools": r.get("tools").cloned().unwrap_or_else(|| json!([])),
            "tool_choice": r.get("tool_choice").cloned().unwrap_or_else(|| json!("auto")),
            "truncation": "disabled",
            "parallel_tool_calls": true,
            "text": { "format": { "type": "text" } },
            "top_p": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "top_logprobs": 0,
            "temperature": 1.0,
            "reasoning": { "effort": Value::Null, "summary": Value::Null },
            "usage": ending.map(|e| usage_object(e.usage.as_ref())),
            "max_output_tokens": Value::Null,
            "max_tool_calls": Value::Null,
            "store": true,
            "background": r.get("background").and_then(Value::as_bool).unwrap_or(false),
            "service_tier": "default",
            "metadata": r.get("metadata").cloned().unwrap_or_else(|| json!({})),
            "safety_identifier": Value::Null,
            "prompt_cache_key": Value::Null,
            "conversation": field("conversation"),
        })
    }

    /// The snapshot with the status the run's row has now (a read, not a
    /// stream: a cancel may be pending, a claim may not be journaled yet).
    pub fn with_status(&self, row: &ResponseRow) -> Value {
        let mut s = self.snapshot();
        // The row may have been read before the journal was: a status the
        // fold has already passed is not shown (queued with deltas out).
        let rank = |w: &str| ["queued", "in_progress"].iter().position(|x| *x == w).unwrap_or(2);
        let row_word = status_word(row.status);
        if self.ending.is_none() && rank(row_word) > rank(self.status) {
            s["status"] = json!(row_word);
        }
        s
    }
}

/// A plugin's `function_call` payload: `{call_id, name, arguments}` with the
/// arguments a JSON text (an object is written as one).
fn function_call(p: &Value) -> Option<(String, String, String)> {
    let name = p.get("name")?.as_str().filter(|n| !n.is_empty())?.to_string();
    let call_id = p.get("call_id")?.as_str().filter(|n| !n.is_empty())?.to_string();
    let arguments = match p.get("arguments") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => "{}".to_string(),
        Some(other) => other.to_string(),
    };
    Some((call_id, name, arguments))
}

/// What a response stream yields.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamItem {
    /// One `response.*` event, with its `sequence_number`.
    Event(Value),
    /// Nothing was sent for a keepalive interval.
    Keepalive,
}

struct Streamer {
    pool: PgPool,
    tail: TailStream,
    view: View,
    ready: VecDeque<Value>,
    after: Option<u64>,
    done: bool,
}

impl Streamer {
    fn push(&mut self, events: Vec<Value>) {
        let after = self.after;
        self.ready.extend(events.into_iter().filter(|e| {
            let n = e["sequence_number"].as_u64().unwrap_or(0);
            after.is_none_or(|a| n > a)
        }));
    }

    async fn next(&mut self) -> Option<Result<StreamItem, TailError>> {
        loop {
            if let Some(e) = self.ready.pop_front() {
                return Some(Ok(StreamItem::Event(e)));
            }
            if self.done {
                return None;
            }
            match self.tail.next().await {
                Some(Ok(Item::Event(e))) if e.kind == COMPLETE => {
                    let events = match ending_of(&self.pool, self.view.run, &e).await {
                        Ok(ending) => self.view.finish(ending),
                        Err(err) => return Some(Err(err)),
                    };
                    self.push(events);
                    self.done = true;
                }
                Some(Ok(Item::Event(e))) => {
                    let events = self.view.apply(&e);
                    self.push(events);
                }
                Some(Ok(Item::Keepalive)) => return Some(Ok(StreamItem::Keepalive)),
                Some(Ok(Item::End(_))) | None => self.done = true,
                Some(Err(e)) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
        }
    }
}

/// The ending a `complete` event names, with the run row's usage and finish time.
async fn ending_of(pool: &PgPool, run: RunId, complete: &Event) -> Result<Ending, TailError> {
    let status = complete.payload.get("status").and_then(Value::as_str).and_then(|s| s.parse().ok());
    let error = complete.payload.get("error").and_then(Value::as_str).map(str::to_string);
    let ended = rows::ending(pool, run).await?;
    Ok(Ending {
        status: status.unwrap_or(RunStatus::Failed),
        error,
        usage: ended.as_ref().and_then(|e| e.usage.clone()),
        finished_at: ended.as_ref().map(|e| e.finished_at),
        answer: ended.and_then(|e| e.answer),
    })
}

/// The response's events numbered after `after` (all of them for `None`),
/// followed live until its terminal event, with keepalives. Counted against
/// the process's bound of live tails.
pub fn follow(
    tails: &Tails,
    pool: &PgPool,
    row: &ResponseRow,
    after: Option<u64>,
) -> Result<impl Stream<Item = Result<StreamItem, TailError>> + Send + 'static, TooManyTails> {
    Ok(follow_reserved(tails, pool, row, after, tails.reserve()?))
}

/// [`follow`] in a place under the bound taken before the run was created.
pub fn follow_reserved(
    tails: &Tails,
    pool: &PgPool,
    row: &ResponseRow,
    after: Option<u64>,
    place: Reserved,
) -> impl Stream<Item = Result<StreamItem, TailError>> + Send + 'static {
    let tail = tails.follow_reserved(row.id, 0, place);
    let mut s = Streamer { pool: pool.clone(), tail, view: View::new(row), ready: VecDeque::new(), after, done: false };
    let first = s.view.start();
    s.push(first);
    futures::stream::unfold(s, |mut s| async move { s.next().await.map(|i| (i, s)) })
}

/// The response as it was enqueued (`queued`, no output): the answer to a
/// background create, the same for an idempotent replay of it, however far
/// the run has got since.
pub fn as_created(row: &ResponseRow) -> Value {
    View::new(row).snapshot()
}

/// The response as it stands now: the fold of the journal so far, with the
/// row's status (or the final snapshot of an ended run).
pub async fn current(tails: &Tails, pool: &PgPool, row: &ResponseRow) -> Result<Value, TailError> {
    let view = fold(tails.catch_up(row.id, 0), pool, row).await?;
    Ok(view.with_status(row))
}

/// Follows the response to its ending and returns the final snapshot (the
/// mode that neither streams nor runs in the background), in a place under
/// the bound taken before the run was created. A dropped client drops this
/// future; the run goes on.
pub async fn settle(tails: &Tails, pool: &PgPool, row: &ResponseRow, place: Reserved) -> Result<Value, TailError> {
    let view = fold(tails.follow_reserved(row.id, 0, place), pool, row).await?;
    Ok(view.snapshot())
}

async fn fold(mut tail: TailStream, pool: &PgPool, row: &ResponseRow) -> Result<View, TailError> {
    let mut view = View::new(row);
    view.start();
    while let Some(item) = tail.next().await {
        match item? {
            Item::Event(e) if e.kind == COMPLETE => {
                let ending = ending_of(pool, row.id, &e).await?;
                view.finish(ending);
                break;
            }
            Item::Event(e) => {
                view.apply(&e);
            }
            Item::Keepalive => {}
            Item::End(_) => break,
        }
    }
    Ok(view)
}

/// The function calls a response ended with (for the next turn, which
/// answers them): `(call_id, name, arguments)`.
pub fn function_calls(view: &View) -> Vec<(String, String, String)> {
    view.output
        .iter()
        .filter_map(|o| match o {
            Output::FunctionCall { call_id, name, arguments, .. } => {
                Some((call_id.clone(), name.clone(), arguments.clone()))
            }
            _ => None,
        })
        .collect()
}

/// The fold of a response's journal (for reads that need its output items).
pub async fn view(tails: &Tails, pool: &PgPool, row: &ResponseRow) -> Result<View, TailError> {
    fold(tails.catch_up(row.id, 0), pool, row).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> ResponseRow {
        ResponseRow {
            id: RunId::new(),
            conversation_id: crate::db::ConversationId::new(),
            status: RunStatus::Queued,
            plugin: "chat".into(),
            cancel_requested: false,
            error: None,
            created_at: Utc::now(),
            finished_at: None,
            config: json!({}),
            usage: None,
            content: "hi".into(),
        }
    }

    fn ev(seq: i32, kind: &str, payload: Value) -> Event {
        Event { seq, kind: kind.into(), payload }
    }

    fn types(events: &[Value]) -> Vec<String> {
        events.iter().map(|e| e["type"].as_str().unwrap().to_string()).collect()
    }

    #[test]
    fn a_journal_maps_to_numbered_events_and_a_final_snapshot() {
        let mut v = View::new(&row());
        let mut all = v.start();
        all.extend(v.apply(&ev(1, "user_message_created", json!({}))));
        all.extend(v.apply(&ev(2, RUN_QUEUED, json!({}))));
        all.extend(v.apply(&ev(3, RUN_STARTED, json!({}))));
        all.extend(v.apply(&ev(4, CONTENT_DELTA, json!({ "delta": "Hel" }))));
        all.extend(v.apply(&ev(5, "tool_call_finished", json!({}))));
        all.extend(v.apply(&ev(6, CONTENT_DELTA, json!({ "delta": "lo" }))));
        let usage = Some(json!({ "prompt_tokens": 3, "completion_tokens": 2 }));
        all.extend(v.finish(Ending {
            status: RunStatus::Completed,
            error: None,
            usage,
            finished_at: Some(Utc::now()),
            answer: None,
        }));
        assert_eq!(
            types(&all),
            [
                "response.created",
                "response.queued",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        let numbers: Vec<u64> = all.iter().map(|e| e["sequence_number"].as_u64().unwrap()).collect();
        assert_eq!(numbers, (0..all.len() as u64).collect::<Vec<_>>());
        let last = &all.last().unwrap()["response"];
        assert_eq!(last["status"], "completed");
        assert_eq!(last["output"][0]["content"][0]["text"], "Hello");
        assert_eq!(last["usage"]["total_tokens"], 5);
    }

    #[test]
    fn a_function_call_closes_the_message_and_a_cancel_ends_incomplete() {
        let mut v = View::new(&row());
        v.start();
        v.apply(&ev(3, RUN_STARTED, json!({})));
        v.apply(&ev(4, CONTENT_DELTA, json!({ "delta": "abc" })));
        v.apply(&ev(5, CONTENT_ROLLBACK, json!({ "keep_chars": 1 })));
        let fc = v.apply(&ev(6, FUNCTION_CALL, json!({ "call_id": "c1", "name": "f", "arguments": "{}" })));
        assert_eq!(types(&fc)[0], "response.output_text.done");
        assert_eq!(fc[0]["text"], "a");
        let end = v.finish(Ending {
            status: RunStatus::Cancelled,
            error: None,
            usage: None,
            finished_at: None,
            answer: None,
        });
        assert_eq!(types(&end), ["response.incomplete"]);
        assert_eq!(end[0]["response"]["status"], "cancelled");
        assert_eq!(function_calls(&v), [("c1".to_string(), "f".to_string(), "{}".to_string())]);
    }

    #[test]
    fn a_read_never_shows_a_status_the_journal_has_passed() {
        let mut r = row();
        let mut v = View::new(&r);
        v.start();
        v.apply(&ev(3, RUN_STARTED, json!({})));
        v.apply(&ev(4, CONTENT_DELTA, json!({ "delta": "a" })));
        // The row was read queued, before the claim's journal rows.
        assert_eq!(v.with_status(&r)["status"], "in_progress");
        r.status = RunStatus::Cancelled;
        assert_eq!(v.with_status(&r)["status"], "cancelled");
        let fresh = View::new(&r);
        r.status = RunStatus::Running;
        assert_eq!(fresh.with_status(&r)["status"], "in_progress");
    }

    #[test]
    fn the_fold_keeps_a_huge_text_cut_as_a_stored_answer_is() {
        let mut v = View::new(&row());
        v.start();
        v.apply(&ev(3, RUN_STARTED, json!({})));
        // 3 MiB in 64 KiB deltas, with a two-byte character across the bound.
        let chunk = format!("é{}", "x".repeat((64 << 10) - 2));
        let mut full = String::new();
        for seq in 0..48 {
            v.apply(&ev(4 + seq, CONTENT_DELTA, json!({ "delta": chunk })));
            full.push_str(&chunk);
        }
        assert!(full.len() > 2 * ANSWER_BYTES_MAX);
        let Output::Message { text, .. } = &v.output()[0] else { panic!("a message") };
        assert!(text.kept.len() <= ANSWER_BYTES_MAX, "the fold holds {} bytes", text.kept.len());
        let shown = text.shown().into_owned();
        assert!(shown.len() <= ANSWER_BYTES_MAX, "{}", shown.len());
        assert!(shown.ends_with(" bytes cut]"), "{}", &shown[shown.len() - 40..]);
        // The same text the transcript stores for the answer.
        assert_eq!(shown, crate::text::cut(&full, ANSWER_BYTES_MAX));
        let end = v.finish(Ending {
            status: RunStatus::Completed,
            error: None,
            usage: None,
            finished_at: None,
            answer: None,
        });
        assert_eq!(end[0]["text"], json!(shown));
        assert_eq!(end.last().unwrap()["response"]["output"][0]["content"][0]["text"], json!(shown));
    }

    #[test]
    fn a_rollback_past_the_bound_keeps_the_text_a_prefix() {
        let mut v = View::new(&row());
        v.start();
        let big = "a".repeat(ANSWER_BYTES_MAX + 10);
        v.apply(&ev(4, CONTENT_DELTA, json!({ "delta": big })));
        v.apply(&ev(5, CONTENT_DELTA, json!({ "delta": "bbbb" })));
        // Drop the 4 b's and 5 of the a's past the bound: still 5 over.
        v.apply(&ev(6, CONTENT_ROLLBACK, json!({ "keep_chars": ANSWER_BYTES_MAX + 5 })));
        let Output::Message { text, .. } = &v.output()[0] else { panic!("a message") };
        assert_eq!(text.shown(), crate::text::cut(&big[..ANSWER_BYTES_MAX + 5], ANSWER_BYTES_MAX));
        // Back under the bound: the text is whole again, and grows again.
        v.apply(&ev(7, CONTENT_ROLLBACK, json!({ "keep_chars": 3 })));
        v.apply(&ev(8, CONTENT_DELTA, json!({ "delta": "c" })));
        let Output::Message { text, .. } = &v.output()[0] else { panic!("a message") };
        assert_eq!(text.shown(), "aaac");
    }

    #[test]
    fn response_ids_round_trip() {
        let run = RunId::new();
        assert_eq!(parse_response_id(&response_id(run)), Some(run));
        assert_eq!(parse_response_id(&run.to_string()), Some(run));
        assert_eq!(parse_response_id("resp_nope"), None);
    }
}
