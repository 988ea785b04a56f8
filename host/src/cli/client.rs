//! The CLI's side of the HTTP API, for a person at a terminal: start a run and
//! watch its text arrive, rejoin a stream from a cursor, cancel, stop.
//!
//! Text (`content_delta`) goes to stdout as it arrives; everything else is
//! narrated on stderr. A dropped stream is rejoined from the last seq seen,
//! so nothing is lost or printed twice. Exit status: 0 when the run
//! completed, 1 when it failed or was cancelled.

use std::io::Write;
use std::time::Duration;

use anyhow::{bail, Context};
use futures::StreamExt;
use serde_json::{json, Value};

use crate::cli::args::{ApiArgs, ApprovalsCommand, ConversationsCommand, RunsCommand, SchedulesCommand};
use crate::db::events;
use crate::stream::decode::SseDecoder;

/// Reconnects after a dropped stream before giving up.
const REJOINS_MAX: u32 = 20;

struct Api {
    http: reqwest::Client,
    url: String,
    token: String,
}

impl Api {
    fn new(args: &ApiArgs) -> Api {
        Api { http: reqwest::Client::new(), url: args.url.trim_end_matches('/').to_string(), token: args.token.clone() }
    }

    /// A JSON request; an API error becomes its message.
    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> anyhow::Result<Value> {
        let mut req = self.http.request(method, format!("{}{path}", self.url)).bearer_auth(&self.token);
        if let Some(body) = body {
            req = req.json(&body);
        }
        let res = req.send().await.with_context(|| format!("cannot reach {}", self.url))?;
        let status = res.status();
        let body: Value = res.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            let message = body["error"]["message"].as_str().unwrap_or("no message");
            bail!("{status}: {message}");
        }
        Ok(body)
    }
}

pub async fn runs(args: &ApiArgs, command: RunsCommand) -> anyhow::Result<()> {
    let api = Api::new(args);
    match command {
        RunsCommand::Create { content, plugin, conversation, config, no_follow } => {
            let mut body = json!({ "content": content, "plugin": plugin });
            if let Some(c) = conversation {
                body["conversation_id"] = json!(c);
            }
            if let Some(c) = config {
                body["config"] = serde_json::from_str(&c).context("--config is not JSON")?;
            }
            let run = api.call(reqwest::Method::POST, "/v1/runs", Some(body)).await?;
            let id = run["run_id"].as_str().context("the answer has no run_id")?.to_string();
            eprintln!("run {id} queued (conversation {})", run["conversation_id"].as_str().unwrap_or("?"));
            if no_follow {
                println!("{id}");
                return Ok(());
            }
            follow(&api, &id, 0).await
        }
        RunsCommand::Tail { id, from } => follow(&api, &id, from).await,
        RunsCommand::Cancel { id } => {
            let answer = api.call(reqwest::Method::POST, &format!("/v1/runs/{id}/cancel"), None).await?;
            println!("{answer}");
            Ok(())
        }
        RunsCommand::Approve { id, call, args } => {
            let body = match args {
                None => json!({ "decision": "approve" }),
                Some(a) => {
                    json!({ "decision": "edit", "args": serde_json::from_str::<Value>(&a).context("--args is not JSON")? })
                }
            };
            decide(&api, &id, call, body).await
        }
        RunsCommand::Reject { id, call, reason } => {
            decide(&api, &id, call, json!({ "decision": "reject", "reason": reason })).await
        }
    }
}

async fn decide(api: &Api, id: &str, call: u32, body: Value) -> anyhow::Result<()> {
    let answer = api.call(reqwest::Method::POST, &format!("/v1/runs/{id}/approvals/{call}"), Some(body)).await?;
    println!("{answer}");
    Ok(())
}

pub async fn schedules(args: &ApiArgs, command: SchedulesCommand) -> anyhow::Result<()> {
    let api = Api::new(args);
    let api = &api;
    let post = |path: String| async move { api.call(reqwest::Method::POST, &path, None).await };
    let answer = match command {
        SchedulesCommand::List => {
            let mut after: Option<String> = None;
            loop {
                let path = after.as_ref().map_or("/v1/schedules".to_string(), |c| format!("/v1/schedules?after={c}"));
                let page = api.call(reqwest::Method::GET, &path, None).await?;
                for s in page["schedules"].as_array().into_iter().flatten() {
                    println!(
                        "{}\t{}\t{}\t{}\t{}\tnext {}",
                        s["id"].as_str().unwrap_or("?"),
                        s["cron"].as_str().unwrap_or("?"),
                        s["timezone"].as_str().unwrap_or("?"),
                        s["plugin"].as_str().unwrap_or("?"),
                        if s["paused"].as_bool() == Some(true) { "paused" } else { "active" },
                        s["next_fire_at"].as_str().unwrap_or("?"),
                    );
                }
                match page["next_cursor"].as_str() {
                    Some(c) => after = Some(c.to_string()),
                    None => return Ok(()),
                }
            }
        }
        SchedulesCommand::Create { content, plugin, cron, timezone, config, conversation } => {
            let mut body = json!({ "content": content, "plugin": plugin, "cron": cron });
            if let Some(tz) = timezone {
                body["timezone"] = json!(tz);
            }
            if let Some(c) = config {
                body["config"] = serde_json::from_str(&c).context("--config is not JSON")?;
            }
            if let Some(c) = conversation {
                body["conversation_id"] = json!(c);
            }
            api.call(reqwest::Method::POST, "/v1/schedules", Some(body)).await?
        }
        SchedulesCommand::Pause { id } => post(format!("/v1/schedules/{id}/pause")).await?,
        SchedulesCommand::Resume { id } => post(format!("/v1/schedules/{id}/resume")).await?,
        SchedulesCommand::Delete { id } => {
            api.call(reqwest::Method::DELETE, &format!("/v1/schedules/{id}"), None).await?;
            json!({ "deleted": id })
        }
    };
    println!("{answer}");
    Ok(())
}

pub async fn approvals(args: &ApiArgs, command: ApprovalsCommand) -> anyhow::Result<()> {
    let api = Api::new(args);
    match command {
        ApprovalsCommand::List => {
            let mut after: Option<String> = None;
            loop {
                let path = match &after {
                    None => "/v1/approvals".to_string(),
                    Some(c) => format!("/v1/approvals?after={c}"),
                };
                let page = api.call(reqwest::Method::GET, &path, None).await?;
                for a in page["approvals"].as_array().into_iter().flatten() {
                    println!(
                        "{}\t{}\t{}\t{}\t{}",
                        a["run_id"].as_str().unwrap_or("?"),
                        a["call_id"],
                        a["tool"].as_str().unwrap_or("?"),
                        a["args"],
                        a["expires_at"].as_str().unwrap_or("?")
                    );
                }
                match page["next_cursor"].as_str() {
                    Some(c) => after = Some(c.to_string()),
                    None => return Ok(()),
                }
            }
        }
    }
}

pub async fn conversations(args: &ApiArgs, command: ConversationsCommand) -> anyhow::Result<()> {
    let api = Api::new(args);
    match command {
        ConversationsCommand::Stop { id } => {
            let answer = api.call(reqwest::Method::POST, &format!("/v1/conversations/{id}/stop"), None).await?;
            println!("{answer}");
            Ok(())
        }
    }
}

/// Prints the run's stream after `from` until its `complete` event,
/// rejoining from the last seq when the connection drops.
async fn follow(api: &Api, id: &str, from: i64) -> anyhow::Result<()> {
    let mut last = from;
    // Characters of the answer printed so far (a rollback withdraws some).
    let mut printed = 0;
    let mut rejoins = 0;
    loop {
        match stream_once(api, id, &mut last, &mut printed).await {
            Ok(Some(status)) => {
                if status == "completed" {
                    return Ok(());
                }
                std::process::exit(1);
            }
            // The stream ended before a `complete`: a stream also ends at
            // once, without one, when the cursor is past the run's ending.
            Ok(None) => {
                if let Ok(Some(status)) = ended(api, id).await {
                    eprintln!("\n[{status}]");
                    if status == "completed" {
                        return Ok(());
                    }
                    std::process::exit(1);
                }
            }
            // Refusals (unknown run, bad token) are final; a dropped connection is not.
            Err(e) if e.downcast_ref::<Refused>().is_some() => return Err(e),
            Err(e) => eprintln!("\n[stream dropped: {e:#}; rejoining after seq {last}]"),
        }
        rejoins += 1;
        if rejoins > REJOINS_MAX {
            bail!("the stream dropped {REJOINS_MAX} times; rejoin with `agent-host runs tail {id} --from {last}`");
        }
        tokio::time::sleep(Duration::from_millis(200 * u64::from(rejoins.min(10)))).await;
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Refused(String);

/// The run's status if it has ended (then nothing more will be streamed).
async fn ended(api: &Api, id: &str) -> anyhow::Result<Option<String>> {
    let run = api.call(reqwest::Method::GET, &format!("/v1/runs/{id}"), None).await?;
    let status = run["status"].as_str().unwrap_or_default();
    Ok(["completed", "failed", "cancelled"].contains(&status).then(|| status.to_string()))
}

/// One connection: prints events and advances `last` (and `printed`, the
/// answer's characters on stdout); the run's final status once `complete`
/// arrives, `None` if the stream ended before it.
async fn stream_once(api: &Api, id: &str, last: &mut i64, printed: &mut u64) -> anyhow::Result<Option<String>> {
    let res = api
        .http
        .get(format!("{}/v1/runs/{id}/events", api.url))
        .bearer_auth(&api.token)
        .header("Accept", "text/event-stream")
        .header("Last-Event-ID", last.to_string())
        .send()
        .await?;
    if !res.status().is_success() {
        let status = res.status();
        let body: Value = res.json().await.unwrap_or(Value::Null);
        let message = body["error"]["message"].as_str().unwrap_or("no message").to_string();
        return Err(Refused(format!("{status}: {message}")).into());
    }
    let mut body = res.bytes_stream();
    let mut decoder = SseDecoder::default();
    let mut out = Vec::new();
    let mut stdout = std::io::stdout();
    while let Some(chunk) = body.next().await {
        decoder.feed(&chunk?, &mut out).map_err(anyhow::Error::msg)?;
        for data in out.drain(..) {
            let event: Value = serde_json::from_str(&data).context("an event that is not JSON")?;
            if let Some(seq) = event["seq"].as_i64() {
                *last = seq;
            }
            match event["type"].as_str().unwrap_or("") {
                events::CONTENT_DELTA => {
                    let delta = event["delta"].as_str().unwrap_or("");
                    *printed += delta.chars().count() as u64;
                    print!("{delta}");
                    stdout.flush()?;
                }
                events::CONTENT_ROLLBACK => {
                    // Printed text cannot be taken back: say what is withdrawn.
                    let keep = event["keep_chars"].as_u64().unwrap_or(0);
                    let dropped = printed.saturating_sub(keep);
                    *printed = keep.min(*printed);
                    eprintln!("\n[resumed: the last {dropped} characters above are withdrawn; the answer goes on]");
                }
                events::RUN_RESUMED => eprintln!(
                    "\n[resumed on {}, attempt {}, {} calls replayed]",
                    event["worker_id"].as_str().unwrap_or("?"),
                    event["attempt"],
                    event["replayed_calls"]
                ),
                events::COMPLETE => {
                    let status = event["status"].as_str().unwrap_or("?").to_string();
                    match event["error"].as_str() {
                        Some(error) => eprintln!("\n[{status}: {error}]"),
                        None => eprintln!("\n[{status}]"),
                    }
                    return Ok(Some(status));
                }
                events::TOOL_CALL_STARTED => eprintln!("\n[tool {} #{}]", event["name"], event["call_index"]),
                events::TOOL_CALL_FINISHED => {
                    eprintln!("[tool {} #{}: {}]", event["name"], event["call_index"], event["outcome"])
                }
                events::USER_MESSAGE_CREATED | events::RUN_QUEUED => {}
                events::RUN_STARTED => eprintln!("[started on {}]", event["worker_id"].as_str().unwrap_or("?")),
                events::APPROVAL_REQUESTED => eprintln!(
                    "\n[waiting for approval of call {} ({} {}); decide with `agent-host runs approve|reject {id} {}`]",
                    event["call_id"], event["tool"], event["args"], event["call_id"]
                ),
                other => eprintln!("\n[{other}] {}", event_body(&event)),
            }
        }
    }
    Ok(None)
}

/// An event's own fields, without the envelope.
fn event_body(event: &Value) -> Value {
    let mut e = event.clone();
    if let Some(map) = e.as_object_mut() {
        map.remove("seq");
        map.remove("type");
    }
    e
}
