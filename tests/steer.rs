//! Steering with real processes (issue 45): an instruction queued for a
//! running turn (`POST /v1/runs/{id}/steer`, or a message sent to its busy
//! conversation with the strategy `steer`) is journaled as it arrives
//! (`steer_received`, while the guest is inside a model call), taken by the
//! example chat agents of Python and JavaScript at their next step
//! (`take-instructions`), and reaches the model's next request. After a
//! SIGKILL the resumed run takes the same instructions at the same point,
//! from its log, once. Refusals: an ended run (409), past the most a run
//! takes (409), another user's run (404), blank content (422).

use std::sync::{Arc, Mutex};

use crate::support::durable::*;
use crate::support::*;
use agent_host::db::tokens;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use futures::StreamExt;
use nix::sys::signal::Signal;
use serde_json::{json, Value};

const SHORTER: &str = "Answer in one sentence.";
const FRENCH: &str = "Answer in French.";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steering_a_python_chat_turn_reaches_the_next_model_request_and_is_taken_once_across_a_sigkill() {
    steer_a_chat_turn("chat-python").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steering_a_javascript_chat_turn_reaches_the_next_model_request_and_is_taken_once_across_a_sigkill() {
    steer_a_chat_turn("chat-js").await;
}

/// The model: request 1 waits for the test's permit, then asks for the
/// `record` tool; request 2 streams a little and stalls (the host is
/// killed inside it); later ones answer.
#[derive(Clone)]
struct Model {
    log: ModelLog,
    gate: Arc<tokio::sync::Semaphore>,
}

async fn complete(State(m): State<Model>, Json(body): Json<Value>) -> axum::response::Response {
    let n = {
        let mut log = m.log.lock().unwrap();
        log.push(body);
        log.len()
    };
    if n == 1 {
        m.gate.acquire().await.unwrap().forget();
    }
    let frame = |c: Value| Ok::<_, std::convert::Infallible>(bytes::Bytes::from(format!("data: {c}\n\n")));
    let text =
        |t: &str| frame(json!({ "choices": [{ "index": 0, "delta": { "content": t }, "finish_reason": null }] }));
    let finish = |why: &str| frame(json!({ "choices": [{ "index": 0, "delta": {}, "finish_reason": why }] }));
    let done = Ok(bytes::Bytes::from("data: [DONE]\n\n"));
    let body = match n {
        1 => {
            let call = json!({ "index": 0, "id": "call_1", "type": "function",
                               "function": { "name": "record", "arguments": "{}" } });
            let calls =
                frame(json!({ "choices": [{ "index": 0, "delta": { "tool_calls": [call] }, "finish_reason": null }] }));
            axum::body::Body::from_stream(futures::stream::iter(vec![calls, finish("tool_calls"), done]))
        }
        2 => axum::body::Body::from_stream(futures::stream::iter(vec![text("Bien")]).chain(futures::stream::pending())),
        _ => axum::body::Body::from_stream(futures::stream::iter(vec![text("C'est fait."), finish("stop"), done])),
    };
    ([("content-type", "text/event-stream")], body).into_response()
}

/// How many of a model request's messages are `content` from the user.
fn told(request: &Value, content: &str) -> usize {
    let messages = request["messages"].as_array().unwrap();
    messages.iter().filter(|m| m["role"] == "user" && m["content"] == content).count()
}

async fn steer_a_chat_turn(example: &str) {
    let models = ModelLog::default();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let model = Model { log: models.clone(), gate: gate.clone() };
    let base = serve(Router::new().route("/v1/chat/completions", post(complete)).with_state(model)).await;
    let llm = format!("{base}/v1");
    let manifest = json!({ "tools": ["llm", "record"], "durability": "resume" });
    let env = Env::with_wasm(example, &example_wasm(example), &manifest, true, &["--llm-base-url", &llm]).await;
    let a = env.spawn("A");
    let hosts = Arc::new(Mutex::new(vec![a.addr.clone()]));
    let offered = json!([{ "name": "record", "description": "records", "parameters": { "type": "object" } }]);
    let run = env.post(&a, example, "Say it is done.", json!({ "tools": offered })).await;
    let client = start_following(&env, &hosts, run);
    let conversation = env.view(&a, run).await["conversation_id"].as_str().unwrap().to_string();
    let asked = poll_until(LONG, || async { !models.lock().unwrap().is_empty() }).await;
    assert!(
        asked,
        "no model request: run {}\njournal {:?}\nlog:\n{}",
        env.view(&a, run).await,
        journal_payloads(&env.db.pool, run).await,
        a.log()
    );

    // Inside the first model call: one instruction by the run, one by a
    // message to its busy conversation.
    let steer = |content: &str| json!({ "content": content });
    let (status, queued) =
        env.request(&a, reqwest::Method::POST, &format!("/v1/runs/{run}/steer"), Some(steer(SHORTER))).await;
    assert_eq!(status, 202, "{queued}");
    assert_eq!(queued["run_id"], run.to_string());
    assert_eq!(queued["source"], "api");
    assert!(queued["taken_at"].is_null(), "{queued}");
    let busy = json!({ "plugin": example, "content": FRENCH, "multitask_strategy": "steer" });
    let path = format!("/v1/conversations/{conversation}/runs");
    let (status, steered) = env.request(&a, reqwest::Method::POST, &path, Some(busy)).await;
    assert_eq!(status, 202, "{steered}");
    assert_eq!(steered["steered"], true, "{steered}");
    assert_eq!(steered["run_id"], run.to_string(), "the busy turn is steered, no run enqueued: {steered}");
    assert_eq!(steered["steer"]["source"], "busy");
    // Both are journaled as they arrive, while the guest waits on the model.
    let pool = env.db.pool.clone();
    wait_for("two steer_received events", LONG, || {
        let pool = pool.clone();
        async move {
            let j = journal_payloads(&pool, run).await;
            j.iter().filter(|(_, kind, _)| kind == "steer_received").count() == 2
        }
    })
    .await;

    // Refusals. A run queued behind this one takes at most 32 instructions;
    // cancelled, none.
    let queued_turn = env.post_turn(&a, &path, json!({ "plugin": example, "content": "later" })).await;
    let steer_path = format!("/v1/runs/{queued_turn}/steer");
    for i in 0..32 {
        let (status, body) =
            env.request(&a, reqwest::Method::POST, &steer_path, Some(steer(&format!("note {i}")))).await;
        assert_eq!(status, 202, "{body}");
    }
    let (status, body) = env.request(&a, reqwest::Method::POST, &steer_path, Some(steer("one too many"))).await;
    assert_eq!(status, 409, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("32 instructions"), "{body}");
    let (status, _) = env.request(&a, reqwest::Method::POST, &format!("/v1/runs/{queued_turn}/cancel"), None).await;
    assert_eq!(status, 202);
    let (status, body) = env.request(&a, reqwest::Method::POST, &steer_path, Some(steer("too late"))).await;
    assert_eq!(status, 409, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("has ended"), "{body}");
    let (status, body) =
        env.request(&a, reqwest::Method::POST, &format!("/v1/runs/{run}/steer"), Some(steer("   "))).await;
    assert_eq!(status, 422, "{body}");
    let bob = tokens::create(&env.db.pool, "bob", "other", false).await.unwrap();
    let res = reqwest::Client::new()
        .post(format!("http://{}/v1/runs/{run}/steer", a.addr))
        .bearer_auth(&bob)
        .json(&steer("mine now"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status().as_u16(), 404, "another user's run is not found");

    // The model answers: the agent calls the tool, takes both instructions
    // at its next step, and the model's next request carries them.
    gate.add_permits(1);
    wait_for("the second model request", LONG, || async { models.lock().unwrap().len() >= 2 }).await;
    {
        let log = models.lock().unwrap();
        assert_eq!((told(&log[0], SHORTER), told(&log[0], FRENCH)), (0, 0), "not before they were taken");
        assert_eq!((told(&log[1], SHORTER), told(&log[1], FRENCH)), (1, 1), "{}", log[1]);
    }
    let taken: Option<chrono::DateTime<chrono::Utc>> =
        scalar(&env.db, "SELECT max(taken_at) FROM run_steer WHERE run_id = $1", run).await;
    assert!(taken.is_some(), "the instructions are marked taken");

    // The host dies inside the second model call; another resumes the run.
    a.signal(Signal::SIGKILL);
    let b = env.spawn("B");
    hosts.lock().unwrap().push(b.addr.clone());
    let followed = client.await.unwrap();
    let view = env.view(&b, run).await;
    assert_eq!(view["status"], "completed", "{view}");
    assert_eq!(view["attempt"], 2);
    assert_eq!(env.assistant(run).await, "C'est fait.");
    {
        let log = models.lock().unwrap();
        assert_eq!(log.len(), 3, "the first model call came from the log; the cut one was asked again");
        assert_eq!(
            (told(&log[2], SHORTER), told(&log[2], FRENCH)),
            (1, 1),
            "taken again from the log, once: {}",
            log[2]
        );
    }
    // Journaled once each: received twice (one per instruction), taken once
    // (both at one point), not again by the resumed attempt.
    let journal = journal_payloads(&env.db.pool, run).await;
    let kinds =
        |kind: &str| journal.iter().filter(|(_, k, _)| k == kind).map(|(_, _, p)| p.clone()).collect::<Vec<_>>();
    assert_eq!(kinds("steer_received").len(), 2, "{journal:?}");
    let taken = kinds("steer_taken");
    assert_eq!(taken.len(), 1, "{journal:?}");
    let contents: Vec<&str> =
        taken[0]["instructions"].as_array().unwrap().iter().map(|i| i["content"].as_str().unwrap()).collect();
    assert_eq!(contents, vec![SHORTER, FRENCH]);
    assert!(taken[0]["position"].as_i64().unwrap() > 0, "{}", taken[0]);
    assert_eq!(kinds("run_resumed").len(), 1);
    // The client following the run saw both kinds, once each per instruction.
    assert_eq!(count(&followed.events, "steer_received"), 2);
    assert_eq!(count(&followed.events, "steer_taken"), 1);
    assert_journal_sound(&env.db.pool, run).await;
    // The run's instructions, as its owner lists them.
    let listed = env.get(&b, &format!("/v1/runs/{run}/steers")).await;
    let listed = listed["steers"].as_array().unwrap().clone();
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert!(listed.iter().all(|s| !s["taken_at"].is_null() && !s["announced_at"].is_null()), "{listed:?}");
    assert_eq!(listed[1]["source"], "busy");
    // Ended: steering is refused.
    let (status, body) =
        env.request(&b, reqwest::Method::POST, &format!("/v1/runs/{run}/steer"), Some(steer("after"))).await;
    assert_eq!(status, 409, "{body}");
    // Without an active turn, the strategy `steer` enqueues a run.
    let next =
        json!({ "plugin": example, "content": "next", "multitask_strategy": "steer", "config": { "answer": "ok" } });
    let (status, body) = env.request(&b, reqwest::Method::POST, &path, Some(next)).await;
    assert_eq!(status, 202, "{body}");
    assert!(body["steered"].is_null() && body["user_message_id"].is_string(), "a run: {body}");
}
