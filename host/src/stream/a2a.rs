//! The A2A protocol's view of a run (`api::a2a` encodes it): a run is a
//! task, its conversation the task's context, its streamed text one
//! artifact (`answer`), its states mapped from ours (a run waiting for a
//! person's approval is `INPUT_REQUIRED`). A task's snapshot is the fold of
//! the journal up to a seq; its updates are the journal's events after that
//! seq, so a subscriber that rejoins from any process gets the snapshot and
//! then exactly what follows it: nothing lost, nothing twice.

use chrono::{DateTime, SecondsFormat, Utc};
use futures::StreamExt;
use serde_json::{json, Value};

use crate::db::events::{
    APPROVAL_DECIDED, APPROVAL_REQUESTED, COMPLETE, CONTENT_DELTA, CONTENT_ROLLBACK, RUN_RESUMED, RUN_STARTED,
};
use crate::db::journal::Event;
use crate::db::tasks::TaskRow;
use crate::db::RunStatus;

use super::tail::{Item, TailError, TailStream};

/// The one artifact a task has: the agent's answer as it streams.
pub const ANSWER_ARTIFACT: &str = "answer";

pub const SUBMITTED: &str = "TASK_STATE_SUBMITTED";
pub const WORKING: &str = "TASK_STATE_WORKING";
pub const COMPLETED: &str = "TASK_STATE_COMPLETED";
pub const FAILED: &str = "TASK_STATE_FAILED";
pub const CANCELED: &str = "TASK_STATE_CANCELED";
pub const INPUT_REQUIRED: &str = "TASK_STATE_INPUT_REQUIRED";

/// Our status as a task state: `waiting` is `INPUT_REQUIRED` when a person's
/// approval is what it waits for (a timed wait is still working).
pub fn state_of(status: RunStatus, awaiting_approval: bool) -> &'static str {
    match status {
        RunStatus::Queued => SUBMITTED,
        RunStatus::Running => WORKING,
        RunStatus::Waiting if awaiting_approval => INPUT_REQUIRED,
        RunStatus::Waiting => WORKING,
        RunStatus::Completed => COMPLETED,
        RunStatus::Failed => FAILED,
        RunStatus::Cancelled => CANCELED,
    }
}

/// Whether no update follows a task in this state on a stream: it ended,
/// or it waits for the client's next message.
pub fn stream_ends_at(state: &str) -> bool {
    matches!(state, COMPLETED | FAILED | CANCELED | INPUT_REQUIRED)
}

pub fn timestamp(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// A message of the agent's, in a task's status (why it failed, what it
/// asks a person to decide).
fn agent_note(row: &TaskRow, id: String, text: &str) -> Value {
    json!({ "messageId": id, "contextId": row.conversation_id, "taskId": row.id, "role": "ROLE_AGENT",
            "parts": [{ "text": text }] })
}

/// What a task waiting for approval asks: the call, and how to answer.
pub fn approval_note(call: &Value) -> String {
    format!(
        "approval needed: tool {} wants to run with {} (call {}). Reply on this task with \"approve\" or \
         \"reject\" (a data part {{\"decision\": \"approve\"|\"reject\", \"reason\": \"...\"}} also works).",
        call["tool"], call["args"], call["call_id"]
    )
}

/// The task's status object.
pub fn status_object(row: &TaskRow, state: &str) -> Value {
    let mut status = json!({ "state": state, "timestamp": timestamp(row.updated_at) });
    match state {
        FAILED | CANCELED => {
            if let Some(e) = &row.error {
                status["message"] = agent_note(row, format!("{}-status", row.id), e);
            }
        }
        INPUT_REQUIRED => {
            if let Some(call) = &row.pending_approval {
                status["message"] =
                    agent_note(row, format!("{}-approval-{}", row.id, call["call_id"]), &approval_note(call));
            }
        }
        _ => {}
    }
    status
}

/// The fold of a run's journal: the answer's text so far and the last seq read.
#[derive(Debug, Default, Clone)]
pub struct Folded {
    pub text: String,
    pub seq: i32,
}

impl Folded {
    /// Applies one event; what it changes of the answer: `Some((text,
    /// append))` for a delta (`append`: after text already there) or a
    /// rollback (the whole text kept, replacing).
    pub fn apply(&mut self, e: &Event) -> Option<(String, bool)> {
        self.seq = self.seq.max(e.seq);
        match e.kind.as_str() {
            CONTENT_DELTA => {
                let delta = e.payload["delta"].as_str().unwrap_or_default();
                let append = !self.text.is_empty();
                self.text.push_str(delta);
                Some((delta.to_string(), append))
            }
            CONTENT_ROLLBACK => {
                let keep = e.payload["keep_chars"].as_u64().unwrap_or(0) as usize;
                self.text = self.text.chars().take(keep).collect();
                Some((self.text.clone(), false))
            }
            _ => None,
        }
    }
}

/// Reads a catch-up tail to its end: the answer so far and its last seq.
pub async fn fold(mut tail: TailStream) -> Result<Folded, TailError> {
    let mut folded = Folded::default();
    while let Some(item) = tail.next().await {
        match item? {
            Item::Event(e) => {
                folded.apply(&e);
            }
            Item::Keepalive => {}
            Item::End(_) => break,
        }
    }
    Ok(folded)
}

/// The task object: its status, its answer as an artifact (the
/// transcript's once it ended, else `text` so far), and the last
/// `history_length` messages of its exchange (all without one).
pub fn task(row: &TaskRow, text: &str, history_length: Option<usize>) -> Value {
    let awaiting = row.pending_approval.is_some();
    let state = state_of(row.status, awaiting);
    let answer = match row.status.is_terminal() {
        true => row.answer.as_deref().unwrap_or(text),
        false => text,
    };
    let mut history = vec![json!({ "messageId": row.user_message_id, "contextId": row.conversation_id,
        "taskId": row.id, "role": "ROLE_USER", "parts": [{ "text": row.input }] })];
    if let (Some(id), Some(a)) = (row.answer_id, row.answer.as_deref()) {
        history.push(json!({ "messageId": id, "contextId": row.conversation_id, "taskId": row.id,
            "role": "ROLE_AGENT", "parts": [{ "text": a }] }));
    }
    let keep = history_length.unwrap_or(history.len()).min(history.len());
    let history: Vec<Value> = history.split_off(history.len() - keep);
    let mut task = json!({
        "id": row.id,
        "contextId": row.conversation_id,
        "status": status_object(row, state),
        "history": history,
        "metadata": { "plugin": row.plugin },
    });
    if !answer.is_empty() {
        task["artifacts"] = json!([{ "artifactId": ANSWER_ARTIFACT, "name": ANSWER_ARTIFACT,
                                     "parts": [{ "text": answer }] }]);
    }
    task
}

/// What one journal event is on a task's stream (`StreamResponse`s), given
/// the fold so far; the state it leaves the task in when it changes it.
pub fn updates(row: &TaskRow, folded: &mut Folded, e: &Event) -> (Vec<Value>, Option<&'static str>) {
    let ids = json!({ "taskId": row.id, "contextId": row.conversation_id });
    let status = |state: &str, message: Option<Value>| {
        let mut s = json!({ "state": state, "timestamp": timestamp(Utc::now()) });
        if let Some(m) = message {
            s["message"] = m;
        }
        let mut u = ids.clone();
        u["status"] = s;
        json!({ "statusUpdate": u })
    };
    if let Some((text, append)) = folded.apply(e) {
        let mut u = ids.clone();
        u["artifact"] = json!({ "artifactId": ANSWER_ARTIFACT, "name": ANSWER_ARTIFACT, "parts": [{ "text": text }] });
        u["append"] = json!(append);
        return (vec![json!({ "artifactUpdate": u })], None);
    }
    match e.kind.as_str() {
        RUN_STARTED | RUN_RESUMED | APPROVAL_DECIDED => (vec![status(WORKING, None)], Some(WORKING)),
        APPROVAL_REQUESTED => {
            let call = json!({ "call_id": e.payload["call_id"], "tool": e.payload["tool"], "args": e.payload["args"] });
            let note = agent_note(row, format!("{}-approval-{}", row.id, call["call_id"]), &approval_note(&call));
            (vec![status(INPUT_REQUIRED, Some(note))], Some(INPUT_REQUIRED))
        }
        COMPLETE => {
            let state = match e.payload["status"].as_str() {
                Some("completed") => COMPLETED,
                Some("cancelled") => CANCELED,
                _ => FAILED,
            };
            let note = e.payload["error"].as_str().map(|m| agent_note(row, format!("{}-status", row.id), m));
            let mut out = Vec::new();
            if state == COMPLETED && !folded.text.is_empty() {
                let mut u = ids.clone();
                u["artifact"] = json!({ "artifactId": ANSWER_ARTIFACT, "name": ANSWER_ARTIFACT, "parts": [] });
                u["append"] = json!(true);
                u["lastChunk"] = json!(true);
                out.push(json!({ "artifactUpdate": u }));
            }
            out.push(status(state, note));
            (out, Some(state))
        }
        _ => (Vec::new(), None),
    }
}
