//! Tools' costs: one MCP tool call's host overhead over the server's own
//! time, and the same for the `http` tool (p50s). The server's own time is
//! the same call made without the host: a bare `rmcp` client on the same
//! connection kind to the same FastMCP server (tests/mcp/py_server.py, from
//! the venv scripts/test caches), and a bare HTTP client to the same
//! loopback destination. The host's is `ToolRegistry::invoke`: the grant-free
//! registry path every call-tool takes (lookup, cached listing, journal
//! events to a no-op sink, timeout, redaction).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agent_host::db::RunId;
use agent_host::tools::{EventSink, LlmConfig, ToolCall, ToolRegistry};
use async_trait::async_trait;
use rmcp::model::{CallToolRequestParams, ProtocolVersion};
use rmcp::service::{serve_client_with_lifecycle, ClientLifecycleMode};
use rmcp::transport::StreamableHttpClientTransport;
use serde_json::{json, Value};

use crate::figures::percentiles;
use crate::BenchArgs;

/// Calls before the measured ones.
const WARMUP: usize = 20;

struct NoSink;

#[async_trait]
impl EventSink for NoSink {
    async fn delta(&self, _text: &str) -> Result<(), agent_host::error::HostError> {
        Ok(())
    }

    async fn event(&self, _kind: &str, _payload: Value) -> Result<(), agent_host::error::HostError> {
        Ok(())
    }
}

/// A registry from a tools file's text (no `${env:...}` in it).
fn registry(text: &str) -> anyhow::Result<ToolRegistry> {
    let file = agent_host::tools::parse_tools_file_with(text, &|_| None).map_err(anyhow::Error::msg)?;
    ToolRegistry::from_tools(&LlmConfig::default(), &file).map_err(anyhow::Error::msg)
}

fn p50(samples: &mut [Duration]) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn report(what: &str, host: &mut [Duration], direct: &mut [Duration]) {
    let (h, d) = (p50(host), p50(direct));
    // Signed: on a noisy machine the difference of two p50s can be below 0.
    let overhead = h.as_secs_f64() - d.as_secs_f64();
    println!("{what}: through the host {}", percentiles(host));
    println!("{what}: without the host {}", percentiles(direct));
    println!(
        "{what}: host overhead p50 {:+.1} µs over the server's own {:.1} µs ({:.2}x)",
        overhead * 1e6,
        d.as_secs_f64() * 1e6,
        h.as_secs_f64() / d.as_secs_f64().max(1e-9)
    );
}

async fn invoke(r: &ToolRegistry, name: &str, args: Value) -> anyhow::Result<Duration> {
    let call = ToolCall {
        run_id: RunId::new(),
        call_index: 1,
        name,
        args,
        timeout_max: None,
        tenant: None,
        may_suspend: false,
    };
    let t = Instant::now();
    r.invoke(call, &NoSink, std::future::pending()).await.map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
    Ok(t.elapsed())
}

/// The Python with the `mcp` SDK that scripts/test installs (named by
/// AGENT_HOST_TEST_MCP_VENV, or found in the cache).
fn mcp_python() -> Option<PathBuf> {
    if let Ok(v) = std::env::var("AGENT_HOST_TEST_MCP_VENV") {
        return Some(PathBuf::from(v).join("bin/python"));
    }
    let cache = std::env::var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|_| std::env::var("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .ok()?
        .join("agent-host");
    let dir = std::fs::read_dir(cache)
        .ok()?
        .filter_map(Result::ok)
        .find(|e| e.file_name().to_string_lossy().starts_with("mcp-venv-") && e.path().join(".complete").exists())?;
    Some(dir.path().join("bin/python"))
}

/// Kills the server when dropped.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub async fn tools(args: &BenchArgs) -> anyhow::Result<()> {
    let samples = args.samples;
    mcp(samples).await?;
    http(samples).await
}

async fn mcp(samples: usize) -> anyhow::Result<()> {
    let script = PathBuf::from("tests/mcp/py_server.py");
    let Some(python) = mcp_python().filter(|p| p.exists() && script.exists()) else {
        println!(
            "MCP tool call: skipped (run scripts/test once to install the mcp SDK's venv, from the repository root)"
        );
        return Ok(());
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let notes = std::env::temp_dir().join(format!("agent-host-bench-mcp-{}", std::process::id()));
    let _server = Child(
        Command::new(python)
            .arg(&script)
            .arg(port.to_string())
            .arg(&notes)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        anyhow::ensure!(Instant::now() < deadline, "the MCP server did not listen");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let url = format!("http://127.0.0.1:{port}/mcp");
    let text = format!("[[mcp]]\nname = \"py\"\nurl = \"{url}\"\n");
    let registry = registry(&text)?;

    let lifecycle = ClientLifecycleMode::Auto {
        preferred_versions: vec![ProtocolVersion::V_2026_07_28],
        legacy_version: Some(ProtocolVersion::V_2025_11_25),
    };
    let client = serve_client_with_lifecycle((), StreamableHttpClientTransport::from_uri(url.as_str()), lifecycle)
        .await
        .map_err(|e| anyhow::anyhow!("a bare MCP client: {e}"))?;
    // Listed once, as the host's client has (so both send the same requests).
    client.peer().list_all_tools().await.map_err(|e| anyhow::anyhow!("tools/list: {e}"))?;
    let args = json!({ "input": "bench" });
    let direct_call = || async {
        let params = CallToolRequestParams::new("echo").with_arguments(args.as_object().unwrap().clone());
        let t = Instant::now();
        client.peer().call_tool(params).await.map_err(|e| anyhow::anyhow!("echo: {e}"))?;
        Ok::<_, anyhow::Error>(t.elapsed())
    };
    let (mut host, mut direct) = (Vec::new(), Vec::new());
    for i in 0..WARMUP + samples {
        // Interleaved, in alternating order, so both see the same server
        // and machine.
        let (h, d) = if i % 2 == 0 {
            (invoke(&registry, "py.echo", args.clone()).await?, direct_call().await?)
        } else {
            let d = direct_call().await?;
            (invoke(&registry, "py.echo", args.clone()).await?, d)
        };
        if i >= WARMUP {
            host.push(h);
            direct.push(d);
        }
    }
    let _ = client.cancel().await;
    let _ = std::fs::remove_file(&notes);
    report(&format!("MCP tool call (FastMCP echo, {samples} calls)"), &mut host, &mut direct);
    Ok(())
}

async fn http(samples: usize) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let router = axum::Router::new().route("/v1/now", axum::routing::get(|| async { "sunny" }));
    let server = tokio::spawn(async move { axum::serve(listener, router).await });
    let text = format!("[[http]]\nurl = \"http://{addr}\"\npaths = [\"/v1/*\"]\n");
    let registry = registry(&text)?;
    let url = format!("http://{addr}/v1/now");
    let client = reqwest::Client::builder().no_proxy().build()?;
    let args = json!({ "method": "GET", "url": url });
    let (mut host, mut direct) = (Vec::new(), Vec::new());
    for i in 0..WARMUP + samples {
        let direct_get = || async {
            let t = Instant::now();
            client.get(&url).send().await?.bytes().await?;
            Ok::<_, anyhow::Error>(t.elapsed())
        };
        let (h, d) = if i % 2 == 0 {
            (invoke(&registry, "http", args.clone()).await?, direct_get().await?)
        } else {
            let d = direct_get().await?;
            (invoke(&registry, "http", args.clone()).await?, d)
        };
        if i >= WARMUP {
            host.push(h);
            direct.push(d);
        }
    }
    server.abort();
    report(&format!("http tool call (loopback GET, {samples} calls)"), &mut host, &mut direct);
    Ok(())
}
