//! The journal's vocabulary, defined once: the event kinds the host writes
//! and the payload of the one `complete` event every terminal run has.
//! Everything that writes, reads, synthesizes or decodes events uses these.

use serde_json::{json, Value};

use super::RunStatus;

/// seq 1, written by enqueue: `{message_id}`.
pub const USER_MESSAGE_CREATED: &str = "user_message_created";
/// seq 2, written by enqueue: `{run_id}`.
pub const RUN_QUEUED: &str = "run_queued";
/// seq 3, written by the claim: `{worker_id}`.
pub const RUN_STARTED: &str = "run_started";
/// A piece of the answer: `{delta}`; consecutive ones merge in the journal writer.
pub const CONTENT_DELTA: &str = "content_delta";
/// A host tool call began: `{call_index, name}`.
pub const TOOL_CALL_STARTED: &str = "tool_call_started";
/// A host tool call ended: `{call_index, name, outcome, duration_ms, result_bytes, error?, usage?}`.
pub const TOOL_CALL_FINISHED: &str = "tool_call_finished";
/// A resumed attempt of a resumable run began (after seq 3, at the next seq):
/// `{attempt, worker_id, replayed_calls}`.
pub const RUN_RESUMED: &str = "run_resumed";
/// Drop streamed text: the answer so far is its first `keep_chars` Unicode
/// scalar values (the text a model call in flight at a crash had streamed;
/// the call is made again): `{keep_chars, call_index, reason}`. The SSE
/// stream and the JSON pages carry it as it is; clients (the console, the
/// CLI) cut their text.
pub const CONTENT_ROLLBACK: &str = "content_rollback";
/// A call that needs a person's approval; the run is waiting: `{call_id,
/// tool, args, requested_at, expires_at}` (the arguments are shown: the
/// approver must see them).
pub const APPROVAL_REQUESTED: &str = "approval_requested";
/// The decision on it (a person's, or the timeout's rejection): `{call_id,
/// decision: approve|reject|edit, args?, reason?, decided_at}`.
pub const APPROVAL_DECIDED: &str = "approval_decided";
/// The run waits (the `wait` tool) with nothing held: `{call_id, until}`.
pub const WAIT_STARTED: &str = "wait_started";
/// Its time came: `{call_id, decision: "elapsed", decided_at}`.
pub const WAIT_ELAPSED: &str = "wait_elapsed";
/// Written by the host (reserved) from the client calls a 0.2.0 guest's turn
/// ends with, once checked against the turn's client tools: the model asked
/// for a function the client runs, and the turn ends with it as an output
/// item of its response (the Responses API): `{call_id, name, arguments}`,
/// the arguments a JSON text.
pub const FUNCTION_CALL: &str = "function_call";
/// One attempt of a model call (issue 46), written by the `llm` tool as
/// each attempt gets its answer's head: `{call_index, attempt, provider,
/// model, outcome: ok|retry|fallback|error, status?, error?, retry_after_ms?,
/// waited_ms}`. `fallback`: the next attempt goes to the alias's next
/// target; `retry`: the same targets again after a backoff.
pub const MODEL_ATTEMPT: &str = "model_attempt";
/// A webhook call's attempt failed and the call is retried (its `retry`
/// policy): `{call_index, name, attempt, status?, error, retry_in_ms}`.
pub const TOOL_ATTEMPT: &str = "tool_attempt";
/// A model call waits for a limit every process shares (issue 46):
/// `{call_index, provider, model, limit, reason, position}`; `reason` is
/// `requests_per_minute`, `tokens_per_minute`, `concurrent`, `paused` (a
/// provider's Retry-After) or `queue` (calls that came first).
pub const MODEL_WAIT: &str = "model_wait";
/// An instruction queued for the running turn (`POST /v1/runs/{id}/steer`,
/// or a message to its busy conversation with the strategy `steer`), as the
/// run's worker learns of it: `{steer_id, content, queued_at}`. At most
/// once per instruction (a worker lost between marking and journaling it
/// leaves it to `steer_taken`).
pub const STEER_RECEIVED: &str = "steer_received";
/// The guest took queued instructions at a host-call boundary
/// (`take-instructions`): `{instructions: [{steer_id, content}], position}`,
/// `position` the call-log position of the take (null for a run that
/// records nothing). A resumed run takes the same ones at the same point.
pub const STEER_TAKEN: &str = "steer_taken";
/// The run's agent started a child run (a sub-agent, `agent:<plugin>`):
/// `{call_index, run_id, plugin, conversation_id, events}`, `events` the
/// path of the child's own stream.
pub const AGENT_STARTED: &str = "agent_started";
/// A child the run's agent awaited (`await-agents`) had ended:
/// `{call_index, run_id, plugin, status, error}`, once per child.
pub const AGENT_FINISHED: &str = "agent_finished";
/// A waiting parent's awaited children were joined, and it is queued to
/// resume (written by the ending of the child that joined them, or when the
/// wait timed out): `{call_id, run_id, status}` or `{call_id, timed_out}`.
pub const AGENTS_JOINED: &str = "agents_joined";
/// The run's one ending: [`complete_payload`].
pub const COMPLETE: &str = "complete";
/// Sent on a quiet stream, never stored.
pub const KEEPALIVE: &str = "keepalive";

/// The seqs enqueue writes (1-2) and the claim writes (3); a run's own
/// events start at [`FIRST_RUN_SEQ`].
pub const ENQUEUE_SEQS: std::ops::RangeInclusive<i32> = 1..=2;
pub const RUN_STARTED_SEQ: i32 = 3;
pub const FIRST_RUN_SEQ: i32 = 4;

/// Event kinds only the host writes; guests cannot emit them.
pub const RESERVED: &[&str] = &[
    USER_MESSAGE_CREATED,
    RUN_QUEUED,
    RUN_STARTED,
    RUN_RESUMED,
    CONTENT_ROLLBACK,
    APPROVAL_REQUESTED,
    APPROVAL_DECIDED,
    WAIT_STARTED,
    WAIT_ELAPSED,
    COMPLETE,
    TOOL_CALL_STARTED,
    TOOL_CALL_FINISHED,
    FUNCTION_CALL,
    MODEL_ATTEMPT,
    MODEL_WAIT,
    TOOL_ATTEMPT,
    STEER_RECEIVED,
    STEER_TAKEN,
    AGENT_STARTED,
    AGENT_FINISHED,
    AGENTS_JOINED,
    KEEPALIVE,
];

/// The payload of `complete`: `{status, error?}`, the same whoever ends the
/// run (worker, backstop, reaper, stop) and whether it is stored or
/// synthesized by a tail (which adds `synthesized: true`).
pub fn complete_payload(status: RunStatus, error: Option<&str>) -> Value {
    match error {
        Some(e) => json!({ "status": status.as_str(), "error": e }),
        None => json!({ "status": status.as_str() }),
    }
}
