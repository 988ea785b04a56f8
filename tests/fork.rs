//! Fork (issue 45): `POST /v1/runs/{id}/fork` makes a new conversation whose
//! first turn replays the original's recorded calls up to a point (no tool
//! or model call made again; the last one's answer edited when asked) and
//! runs live after it, against a real host process with the `chat`
//! component, the offline model and a tool receiver that counts calls. The
//! original's journal and transcript are unchanged; a plugin that records
//! nothing, a point past the record and another user's run are refused.

use serde_json::{json, Value};

use agent_host::db::RunId;

use crate::support::durable::*;
use crate::support::process::HostProcess;
use crate::support::*;

async fn ended(env: &Env, host: &HostProcess, run: RunId) -> Value {
    wait_for("the run to end", LONG, || async {
        matches!(env.view(host, run).await["status"].as_str(), Some("completed" | "failed" | "cancelled"))
    })
    .await;
    env.view(host, run).await
}

async fn fork(env: &Env, host: &HostProcess, run: RunId, body: Value) -> (u16, Value) {
    env.request(host, reqwest::Method::POST, &format!("/v1/runs/{run}/fork"), Some(body)).await
}

/// The run's journal and its conversation's transcript, as stored.
async fn record_of(env: &Env, run: RunId) -> (Vec<(i32, String, Value)>, Vec<(String, String, String)>) {
    let journal = sqlx::query_as("SELECT seq, type, payload FROM run_event WHERE run_id = $1 ORDER BY seq")
        .bind(run)
        .fetch_all(&env.db.pool)
        .await
        .unwrap();
    let transcript = sqlx::query_as(
        "SELECT role, content, status FROM message
         WHERE conversation_id = (SELECT conversation_id FROM agent_run WHERE id = $1) ORDER BY created_at",
    )
    .bind(run)
    .fetch_all(&env.db.pool)
    .await
    .unwrap();
    (journal, transcript)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_replays_the_record_up_to_its_point_and_runs_live_after_it() {
    let env = Env::new("chat", "chat", &["llm", "record"], true, &[]).await;
    let host = env.spawn("A");
    let offered = json!([{ "name": "record", "description": "record", "parameters": { "type": "object" } }]);
    let run = env.post(&host, "chat", "go", json!({ "tools": offered })).await;
    let original = ended(&env, &host, run).await;
    assert_eq!(original["status"], "completed", "{original}");
    let answer = env.assistant(run).await;
    assert_eq!(answer, r#"Offline reply to: go Tool record said: {"ok":true,"route":"record"}"#);
    assert_eq!(env.receiver.keys("record").len(), 1);
    let record_at: i32 =
        scalar(&env.db, "SELECT position FROM run_call WHERE run_id = $1 AND name = 'record'", run).await;
    let model_at: i32 =
        scalar(&env.db, "SELECT min(position) FROM run_call WHERE run_id = $1 AND name = 'llm'", run).await;
    assert!(model_at < record_at, "the model asked for the tool first");
    let before = record_of(&env, run).await;

    // At the tool call, its answer edited: nothing up to it is made again,
    // the model (live after it) reads the edited answer.
    // (Named by its call_index, as its events carry it: the model's call is 1.)
    let body = json!({ "after_tool_call": 2, "tool_answer": { "edited": true } });
    let (status, forked) = fork(&env, &host, run, body).await;
    assert_eq!(status, 202, "{forked}");
    let branch: RunId = forked["run_id"].as_str().unwrap().parse().unwrap();
    assert_ne!(forked["conversation_id"], original["conversation_id"], "a new conversation");
    assert_eq!(ended(&env, &host, branch).await["status"], "completed");
    assert_eq!(env.assistant(branch).await, r#"Offline reply to: go Tool record said: {"edited":true}"#);
    assert_eq!(env.receiver.keys("record").len(), 1, "the tool was not called again");
    let view = env.view(&host, branch).await;
    assert_eq!(view["forked_from"], run.to_string(), "{view}");
    assert_eq!(view["fork_after"], record_at, "{view}");
    assert!(env.view(&host, run).await["forked_from"].is_null());
    let replayed: i64 = scalar(&env.db, "SELECT count(*) FROM run_call WHERE run_id = $1", branch).await;
    assert!(replayed > record_at as i64, "the branch recorded its own calls after the point");

    // After the model's first call only: the tool is called live, once.
    let (status, forked) = fork(&env, &host, run, json!({ "after_call": model_at })).await;
    assert_eq!(status, 202, "{forked}");
    let live: RunId = forked["run_id"].as_str().unwrap().parse().unwrap();
    assert_eq!(ended(&env, &host, live).await["status"], "completed");
    assert_eq!(env.assistant(live).await, answer);
    let keys = env.receiver.keys("record");
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert!(keys[1].starts_with(&live.to_string()), "the live call is the branch's: {keys:?}");

    // A new message from the start: the whole turn runs live.
    let (status, forked) = fork(&env, &host, run, json!({ "after_call": 0, "content": "go again" })).await;
    assert_eq!(status, 202, "{forked}");
    let fresh: RunId = forked["run_id"].as_str().unwrap().parse().unwrap();
    assert_eq!(ended(&env, &host, fresh).await["status"], "completed");
    assert!(env.assistant(fresh).await.starts_with("Offline reply to: go again Tool record said"));

    // The original: its journal and transcript as they were.
    assert_eq!(record_of(&env, run).await, before);

    // Refusals, each naming why.
    let (status, e) = fork(&env, &host, run, json!({ "after_call": 10_000 })).await;
    assert_eq!(status, 422, "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("is past them"), "{e}");
    let (status, e) = fork(&env, &host, run, json!({ "after_call": record_at, "content": "other" })).await;
    assert_eq!(status, 422, "{e}");
    // Three tool calls were made: the model, the tool, the model.
    let (status, e) = fork(&env, &host, run, json!({ "after_tool_call": 4 })).await;
    assert_eq!(status, 422, "{e}");
    let (status, e) = fork(&env, &host, run, json!({ "after_call": 1, "after_tool_call": 1 })).await;
    assert_eq!(status, 422, "one point: {e}");
    let reading: Option<i32> =
        sqlx::query_scalar("SELECT min(position) FROM run_call WHERE run_id = $1 AND import <> 'call-tool'")
            .bind(run)
            .fetch_one(&env.db.pool)
            .await
            .unwrap();
    if let Some(reading) = reading {
        let (status, e) = fork(&env, &host, run, json!({ "after_call": reading, "tool_answer": {} })).await;
        assert_eq!(status, 422, "only a tool call's answer can be edited: {e}");
    }
    let echo = env.post(&host, "echo", "hi", json!({})).await;
    assert_eq!(ended(&env, &host, echo).await["status"], "completed");
    let (status, e) = fork(&env, &host, echo, json!({ "after_call": 0 })).await;
    assert_eq!(status, 409, "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("durability"), "{e}");
    let bob = agent_host::db::tokens::create(&env.db.pool, "bob", "acme", false).await.unwrap();
    let res = reqwest::Client::new()
        .post(format!("http://{}/v1/runs/{run}/fork", host.addr))
        .bearer_auth(bob)
        .json(&json!({ "after_call": 0 }))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 404, "another user's run is not found");
}
