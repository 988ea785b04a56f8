//! The MCP server's view of a run (`api::mcp` encodes it): a run is a tool
//! call's task (task id = run id), its states mapped from ours (a run
//! waiting for a person's approval is `input_required`), its answer the
//! call's text result, and its streamed text `notifications/progress`
//! messages. Everything here is read from the run's row and journal, so any
//! process answers for any task.

use serde_json::{json, Value};

use crate::db::events::{APPROVAL_REQUESTED, COMPLETE};
use crate::db::journal::Event;
use crate::db::tasks::TaskRow;
use crate::db::RunStatus;

use super::a2a::{timestamp, Folded};

pub const WORKING: &str = "working";
pub const INPUT_REQUIRED: &str = "input_required";
pub const COMPLETED: &str = "completed";
pub const FAILED: &str = "failed";
pub const CANCELLED: &str = "cancelled";

/// How often a client is told to poll a task (`pollInterval`, ms).
pub const POLL_INTERVAL_MS: u64 = 500;

/// The `_meta` key that ties a result to its task (2025-11-25).
pub const RELATED_TASK: &str = "io.modelcontextprotocol/related-task";
/// The `_meta` key under which a result names its run and conversation.
pub const RUN_META: &str = "agent-host/run";

/// Our status as a task status: `waiting` is `input_required` when a
/// person's approval is what it waits for (a timed wait is still working).
pub fn status_of(status: RunStatus, awaiting_approval: bool) -> &'static str {
    match status {
        RunStatus::Queued | RunStatus::Running => WORKING,
        RunStatus::Waiting if awaiting_approval => INPUT_REQUIRED,
        RunStatus::Waiting => WORKING,
        RunStatus::Completed => COMPLETED,
        RunStatus::Failed => FAILED,
        RunStatus::Cancelled => CANCELLED,
    }
}

/// What a run waiting for approval asks, and where a person decides it.
pub fn approval_note(run: &impl std::fmt::Display, call: &Value) -> String {
    format!(
        "approval needed: tool {} wants to run with {} (call {}); decide it with POST /v1/runs/{run}/approvals/{} \
         (or in the console)",
        call["tool"], call["args"], call["call_id"], call["call_id"]
    )
}

/// The task object (2025-11-25 `Task`): kept as long as the run is (`ttl`
/// null), polled every [`POLL_INTERVAL_MS`].
pub fn task(row: &TaskRow) -> Value {
    let status = status_of(row.status, row.pending_approval.is_some());
    let mut task = json!({
        "taskId": row.id,
        "status": status,
        "createdAt": timestamp(row.created_at),
        "lastUpdatedAt": timestamp(row.updated_at),
        "ttl": null,
        "pollInterval": POLL_INTERVAL_MS,
    });
    let message = match status {
        INPUT_REQUIRED => row.pending_approval.as_ref().map(|call| approval_note(&row.id, call)),
        FAILED | CANCELLED => row.error.clone(),
        WORKING if row.status == RunStatus::Queued => Some("queued".into()),
        WORKING if row.cancel_requested => Some("stopping: a cancel was requested".into()),
        _ => None,
    };
    if let Some(m) = message {
        task["statusMessage"] = json!(m);
    }
    task
}

/// A tool call's result for the run as it stands: its answer (the
/// transcript's once it ended, else `text` so far) as text; an error result
/// when it failed or was cancelled; the approval it waits for when it does.
pub fn call_result(row: &TaskRow, text: &str) -> Value {
    let status = status_of(row.status, row.pending_approval.is_some());
    let answer = match row.status.is_terminal() {
        true => row.answer.as_deref().unwrap_or(text),
        false => text,
    };
    let mut content = Vec::new();
    if !answer.is_empty() {
        content.push(json!({ "type": "text", "text": answer }));
    }
    let note = match status {
        FAILED => Some(format!("the run failed: {}", row.error.as_deref().unwrap_or("no reason given"))),
        CANCELLED => {
            Some(format!("the run was cancelled{}", row.error.as_deref().map(|e| format!(": {e}")).unwrap_or_default()))
        }
        INPUT_REQUIRED => row.pending_approval.as_ref().map(|call| approval_note(&row.id, call)),
        _ => None,
    };
    if let Some(n) = note {
        content.push(json!({ "type": "text", "text": n }));
    }
    json!({
        "content": content,
        "isError": matches!(status, FAILED | CANCELLED),
        "_meta": { RUN_META: { "run_id": row.id, "conversation_id": row.conversation_id, "status": row.status.as_str() } },
    })
}

/// A `notifications/progress` message for the `n`th piece of streamed text.
pub fn progress(token: &Value, n: u64, text: &str) -> Value {
    json!({ "jsonrpc": "2.0", "method": "notifications/progress",
            "params": { "progressToken": token, "progress": n, "message": text } })
}

/// What one journal event is to a caller following the run: the streamed
/// text it adds (a delta; a rollback's kept text replaces what was said, and
/// is not news), and whether the call's answer is due (the run ended, or it
/// waits for a person).
pub fn follow(folded: &mut Folded, e: &Event) -> (Option<String>, bool) {
    let said = match folded.apply(e) {
        Some((text, true)) => Some(text),
        Some((text, false)) if e.kind == crate::db::events::CONTENT_DELTA => Some(text),
        _ => None,
    };
    (said, matches!(e.kind.as_str(), COMPLETE | APPROVAL_REQUESTED))
}
