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

pub(crate) struct Api {
    pub(crate) http: reqwest::Client,
    pub(crate) url: String,
    pub(crate) token: String,
}

impl Api {
    pub(crate) fn new(args: &ApiArgs) -> anyhow::Result<Api> {
        let token = args
            .token
            .clone()
            .context("no token: give --token or set AGENT_HOST_TOKEN (`agent-host tokens create`)")?;
        Ok(Api { http: reqwest::Client::new(), url: args.url.trim_end_matches('/').to_string(), token })
    }

    /// A JSON request; an API error becomes its message.
    pub(crate) async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> anyhow::Result<Value> {
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
    let api = Api::new(args)?;
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
        RunsCommand::Get { id, json } => {
            let run = api.call(reqwest::Method::GET, &format!("/v1/runs/{}", segment(&id)), None).await?;
            if json {
                println!("{run}");
                return Ok(());
            }
            for key in ["id", "status", "plugin", "conversation_id", "created_at", "started_at", "finished_at", "error"]
            {
                if !run[key].is_null() {
                    println!("{key}\t{}", text(&run[key]));
                }
            }
            for key in ["attempt", "last_seq", "usage", "pending_approval", "webhook"] {
                if !run[key].is_null() {
                    println!("{key}\t{}", run[key]);
                }
            }
            Ok(())
        }
        RunsCommand::List { status, limit, json } => {
            let path = match status {
                Some(s) => format!("/v1/runs?status={}", segment(&s)),
                None => "/v1/runs".to_string(),
            };
            let columns = |r: &Value| {
                format!(
                    "{}\t{}\t{}\t{}\t{}",
                    text(&r["id"]),
                    text(&r["status"]),
                    text(&r["plugin"]),
                    text(&r["created_at"]),
                    text(&r["conversation_id"])
                )
            };
            list(&api, &path, "runs", Some(limit), json, columns).await
        }
        RunsCommand::Retry { id } => {
            let run = api.call(reqwest::Method::POST, &format!("/v1/runs/{}/retry", segment(&id)), None).await?;
            eprintln!("run {} queued (a retry of {id})", text(&run["run_id"]));
            println!("{}", text(&run["run_id"]));
            Ok(())
        }
        RunsCommand::Tail { id, from } => follow(&api, &id, from).await,
        RunsCommand::Cancel { id } => {
            let answer = api.call(reqwest::Method::POST, &format!("/v1/runs/{id}/cancel"), None).await?;
            println!("{answer}");
            Ok(())
        }
        RunsCommand::Steer { id, content } => {
            let path = format!("/v1/runs/{}/steer", segment(&id));
            let answer = api.call(reqwest::Method::POST, &path, Some(json!({ "content": content }))).await?;
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
    let api = Api::new(args)?;
    let api = &api;
    let post = |path: String| async move { api.call(reqwest::Method::POST, &path, None).await };
    let answer = match command {
        SchedulesCommand::List { json } => {
            let columns = |s: &Value| {
                format!(
                    "{}\t{}\t{}\t{}\t{}\tnext {}",
                    text(&s["id"]),
                    text(&s["cron"]),
                    text(&s["timezone"]),
                    text(&s["plugin"]),
                    if s["paused"].as_bool() == Some(true) { "paused" } else { "active" },
                    text(&s["next_fire_at"]),
                )
            };
            return list(api, "/v1/schedules", "schedules", None, json, columns).await;
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
    let api = Api::new(args)?;
    match command {
        ApprovalsCommand::List { json } => {
            let columns = |a: &Value| {
                format!(
                    "{}\t{}\t{}\t{}\t{}",
                    text(&a["run_id"]),
                    a["call_id"],
                    text(&a["tool"]),
                    a["args"],
                    text(&a["expires_at"])
                )
            };
            list(&api, "/v1/approvals", "approvals", None, json, columns).await
        }
    }
}

pub async fn conversations(args: &ApiArgs, command: ConversationsCommand) -> anyhow::Result<()> {
    let api = Api::new(args)?;
    match command {
        ConversationsCommand::List { limit, json } => {
            let columns = |c: &Value| {
                format!(
                    "{}\t{}\t{}\t{}\t{}",
                    text(&c["id"]),
                    text(&c["created_at"]),
                    text(&c["latest_run_id"]),
                    text(&c["latest_status"]),
                    text(&c["title"])
                )
            };
            list(&api, "/v1/conversations", "conversations", Some(limit), json, columns).await
        }
        ConversationsCommand::Stop { id } => {
            let answer = api.call(reqwest::Method::POST, &format!("/v1/conversations/{id}/stop"), None).await?;
            println!("{answer}");
            Ok(())
        }
    }
}

/// `plugins upload`: `POST /v1/plugins` with a tenant admin's token, for a
/// team with no access to the database; prints the plugin's name and digest.
pub async fn plugins_upload(
    args: &ApiArgs,
    name: &str,
    file: &std::path::Path,
    manifest: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    let api = Api::new(args)?;
    let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    let manifest = match manifest {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            serde_json::from_str::<Value>(&text).with_context(|| format!("{} is not JSON", path.display()))?;
            Some(text)
        }
        None => None,
    };
    let body = upload(&api, name, bytes, manifest).await?;
    let scope = body["tenant_id"].as_str().map_or("published".to_string(), |t| format!("tenant {t}"));
    println!("{} -> {} ({scope}, uploaded to {})", text(&body["name"]), text(&body["digest"]), api.url);
    Ok(())
}

/// `POST /v1/plugins`: the registered plugin (`name`, `digest`, ...).
pub(crate) async fn upload(api: &Api, name: &str, bytes: Vec<u8>, manifest: Option<String>) -> anyhow::Result<Value> {
    let mut form = reqwest::multipart::Form::new()
        .text("name", name.to_string())
        .part("component", reqwest::multipart::Part::bytes(bytes).file_name("component.wasm"));
    if let Some(text) = manifest {
        serde_json::from_str::<Value>(&text).context("the manifest is not JSON")?;
        form = form.text("manifest", text);
    }
    let res = api
        .http
        .post(format!("{}/v1/plugins", api.url))
        .bearer_auth(&api.token)
        .multipart(form)
        .send()
        .await
        .with_context(|| format!("cannot reach {}", api.url))?;
    let status = res.status();
    let body: Value = res.json().await.unwrap_or(Value::Null);
    if !status.is_success() {
        bail!("{status}: {}", body["error"]["message"].as_str().unwrap_or("no message"));
    }
    Ok(body)
}

/// A string field as it reads (`-` when absent), any other value as JSON.
fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".to_string(),
        other => other.to_string(),
    }
}

/// `s` percent-encoded for one path segment or query value.
pub(crate) fn segment(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// Prints a paged list (`{<key>: [...], next_cursor}`), page after page,
/// until `max` items (all without it): one JSON object a line with `json`,
/// else `columns` of each.
async fn list(
    api: &Api,
    path: &str,
    key: &str,
    max: Option<u32>,
    json: bool,
    columns: impl Fn(&Value) -> String,
) -> anyhow::Result<()> {
    let mut left = max.map(|m| m.max(1));
    let mut after: Option<String> = None;
    let sep = if path.contains('?') { '&' } else { '?' };
    loop {
        let mut url = path.to_string();
        let mut push = |k: &str, v: String| {
            url.push(if url == path { sep } else { '&' });
            url.push_str(&format!("{k}={v}"));
        };
        if let Some(n) = left {
            push("limit", n.min(crate::api::LIMIT_MAX as u32).to_string());
        }
        if let Some(c) = &after {
            push("after", segment(c));
        }
        let page = api.call(reqwest::Method::GET, &url, None).await?;
        for item in page[key].as_array().into_iter().flatten() {
            if left == Some(0) {
                return Ok(());
            }
            println!("{}", if json { item.to_string() } else { columns(item) });
            left = left.map(|n| n - 1);
        }
        match page["next_cursor"].as_str() {
            Some(c) if left != Some(0) => after = Some(c.to_string()),
            _ => return Ok(()),
        }
    }
}

/// Prints the run's stream after `from` until its `complete` event,
/// rejoining from the last seq when the connection drops; exits with status
/// 1 unless the run completed.
async fn follow(api: &Api, id: &str, from: i64) -> anyhow::Result<()> {
    if follow_to_end(api, id, from).await? != "completed" {
        std::process::exit(1);
    }
    Ok(())
}

/// [`follow`], answering the run's final status.
pub(crate) async fn follow_to_end(api: &Api, id: &str, from: i64) -> anyhow::Result<String> {
    let mut last = from;
    // Characters of the answer printed so far (a rollback withdraws some).
    let mut printed = 0;
    let mut rejoins = 0;
    loop {
        match stream_once(api, id, &mut last, &mut printed).await {
            Ok(Some(status)) => return Ok(status),
            // The stream ended before a `complete`: a stream also ends at
            // once, without one, when the cursor is past the run's ending.
            Ok(None) => {
                if let Ok(Some(status)) = ended(api, id).await {
                    eprintln!("\n[{status}]");
                    return Ok(status);
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
