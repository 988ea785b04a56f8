//! Grants made easy to see (issue 42): `GET /v1/tools` on a real host lists
//! the tools a tenant may grant and call (webhooks with their descriptions,
//! a live MCP server's tools with their schemas, the host's own), hides
//! another tenant's, and names an MCP server that is down; `agent-host
//! plugins inspect FILE` reads a component's world version, imports and
//! exports without a host (0.2.0 and 0.1.0 examples) and reports an invalid
//! manifest with the host's own message; `plugins inspect NAME` after an
//! upload marks each granted tool present or missing on that host.

use std::path::Path;
use std::process::Output;

use serde_json::{json, Value};

use crate::support::mcp_servers::{free_port, McpServerProcess};
use crate::support::process::{HostProcess, FAST};
use crate::support::*;

fn agent_host(args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
        .args(args)
        .env_remove("AGENT_HOST_TOKEN")
        .env_remove("AGENT_HOST_URL")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap()
}

fn said(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// A built example written to `dir/<name>.wasm`.
fn example(dir: &Path, name: &str) -> String {
    let path = dir.join(format!("{name}.wasm"));
    std::fs::write(&path, plugin_wasm(name)).unwrap();
    path.to_string_lossy().into_owned()
}

async fn tools(url: &str, token: &str, query: &str) -> Value {
    let res = reqwest::Client::new().get(format!("{url}/v1/tools{query}")).bearer_auth(token).send().await.unwrap();
    assert_eq!(res.status(), 200);
    res.json().await.unwrap()
}

fn names(page: &Value) -> Vec<&str> {
    page["tools"].as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_are_listed_per_tenant_and_inspect_shows_a_plugins_world_manifest_and_grants() {
    let py = McpServerProcess::python(None, None).await;
    let db = TestDb::new().await;
    let dir = TempDir::new("inspect");
    std::fs::create_dir_all(&dir.0).unwrap();
    // `gone` is an MCP server nobody listens for: its tools are missing.
    let tools_file = dir.0.join("tools.toml");
    std::fs::write(
        &tools_file,
        format!(
            "[[webhook]]\nname = \"crm\"\nurl = \"http://127.0.0.1:1/crm\"\ndescription = \"Look a customer up\"\n\
             tenants = [\"acme\"]\n\n\
             [[webhook]]\nname = \"ledger\"\nurl = \"http://127.0.0.1:1/ledger\"\ntenants = [\"globex\"]\n\n\
             [[mcp]]\nname = \"py\"\nurl = \"{}\"\ntenants = [\"acme\"]\n\n\
             [[mcp]]\nname = \"gone\"\nurl = \"http://127.0.0.1:{}/mcp\"\ntenants = [\"acme\"]\n",
            py.url(),
            free_port()
        ),
    )
    .unwrap();
    let host =
        HostProcess::spawn(&db.url, "inspect", &[FAST, &["--tools-file", tools_file.to_str().unwrap()]].concat());
    let url = format!("http://{}", host.addr);
    let acme = agent_host::db::tokens::create(&db.pool, "ada", "acme", true).await.unwrap();
    let globex = agent_host::db::tokens::create(&db.pool, "gus", "globex", true).await.unwrap();

    // GET /v1/tools: acme's tools with descriptions and schemas, not globex's.
    let page = tools(&url, &acme, "").await;
    assert_eq!(
        names(&page),
        ["crm", "llm", "py.add_late", "py.echo", "py.fail", "py.ping", "py.slow", "py.weather", "wait"],
        "{page}"
    );
    assert_eq!(page["unavailable"], json!(["gone"]));
    assert_eq!(page["next_cursor"], Value::Null);
    let tool = |name: &str| page["tools"].as_array().unwrap().iter().find(|t| t["name"] == name).unwrap().clone();
    assert_eq!(tool("crm")["description"], "Look a customer up");
    assert_eq!(tool("crm")["kind"], "webhook");
    assert_eq!(tool("llm")["kind"], "model");
    assert_eq!(tool("py.echo")["kind"], "mcp");
    assert_eq!(tool("py.echo")["description"], "Answers its input back");
    assert_eq!(tool("py.echo")["input_schema"]["properties"]["input"]["type"], "string", "{page}");
    let other = tools(&url, &globex, "").await;
    assert_eq!(names(&other), ["ledger", "llm", "wait"], "{other}");
    assert_eq!(other["unavailable"], json!([]));
    // Paged as the other lists are: by name, with a cursor.
    let first = tools(&url, &acme, "?limit=2").await;
    assert_eq!(names(&first), ["crm", "llm"]);
    let cursor = first["next_cursor"].as_str().unwrap();
    let second = tools(&url, &acme, &format!("?limit=2&after={cursor}")).await;
    assert_eq!(names(&second), ["py.add_late", "py.echo"]);
    let res = reqwest::get(format!("{url}/v1/tools")).await.unwrap();
    assert_eq!(res.status(), 401);

    // inspect FILE: the world version, the host import, without a host.
    let chat = example(&dir.0, "chat");
    let out = agent_host(&["plugins", "inspect", &chat]);
    assert!(out.status.success(), "{}", said(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("world     agent-host:plugin@0.2.0 (this host runs it)"), "{text}");
    assert!(text.contains("agent-host:plugin/host@0.2.0"), "{text}");
    assert!(text.contains("exports     run\n"), "{text}");
    assert!(text.contains("language  rust"), "{text}");
    assert!(text.contains("memory_bytes         67108864 (default)"), "{text}");
    assert!(text.contains("tools      check skipped: no token"), "{text}");
    let out = agent_host(&["plugins", "inspect", &chat, "--json"]);
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let bytes = std::fs::read(&chat).unwrap();
    assert_eq!(report["component"]["digest"], agent_host::db::plugins::digest_of(&bytes));
    assert_eq!(report["component"]["size_bytes"], bytes.len());
    assert_eq!(report["component"]["world_version"], "0.2.0");
    assert!(report["component"]["imports"]["wasi"]
        .as_array()
        .unwrap()
        .iter()
        .any(|i| i.as_str().unwrap().starts_with("wasi:cli/environment@")));
    assert_eq!(report["component"]["imports"]["other"], json!([]));

    let legacy = example(&dir.0, "legacy");
    let out = agent_host(&["plugins", "inspect", &legacy, "--json"]);
    assert!(out.status.success(), "{}", said(&out));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["component"]["world"], "agent-host:plugin@0.1.0");
    assert!(report["component"]["imports"]["host"]
        .as_array()
        .unwrap()
        .contains(&json!("agent-host:plugin/host@0.1.0")));

    // Not a component, and no such file: said plainly.
    let out = agent_host(&["plugins", "inspect", tools_file.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(said(&out).contains("not a WebAssembly component"), "{}", said(&out));
    let out = agent_host(&["plugins", "inspect", "missing.wasm"]);
    assert!(!out.status.success());
    assert!(said(&out).contains("cannot read missing.wasm"), "{}", said(&out));

    // An invalid manifest beside the file: the host's own message, exit 1.
    std::fs::write(dir.0.join("manifest.json"), r#"{"tools": ["llm"], "limits": {"memory_bytes": 5}}"#).unwrap();
    let out = agent_host(&["plugins", "inspect", &chat]);
    assert_eq!(out.status.code(), Some(1), "{}", said(&out));
    let expected = "manifest: limits.memory_bytes must be 1048576 to 1073741824, not 5";
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!("manifest   INVALID: {expected}")),
        "{}",
        said(&out)
    );
    let bad = dir.0.join("manifest.json");
    let upload = agent_host(&[
        "plugins",
        "upload",
        "bad",
        &chat,
        "--manifest",
        bad.to_str().unwrap(),
        "--url",
        &url,
        "--token",
        &acme,
    ]);
    assert!(said(&upload).contains(expected), "the host says the same: {}", said(&upload));

    // inspect NAME after an upload: each grant present or missing on this host.
    let manifest = dir.0.join("helper.json");
    let grants =
        json!({ "tools": ["llm", "crm", "py.echo", "py.*", "gone.echo", "nope"], "limits": { "wall_ms": 5000 } });
    std::fs::write(&manifest, grants.to_string()).unwrap();
    let api = ["--url", url.as_str(), "--token", acme.as_str()];
    let upload = agent_host(
        &[&["plugins", "upload", "helper", &chat, "--manifest", manifest.to_str().unwrap()][..], &api].concat(),
    );
    assert!(upload.status.success(), "{}", said(&upload));
    let out = agent_host(&[&["plugins", "inspect", "helper", "--json"][..], &api].concat());
    assert!(out.status.success(), "{}", said(&out));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["plugin"]["digest"], agent_host::db::plugins::digest_of(&bytes));
    assert_eq!(report["plugin"]["tenant_id"], "acme");
    assert_eq!(report["manifest"]["limits"]["wall_ms"], json!({ "value": 5000, "default": 600000, "set": true }));
    let checked: Vec<(String, bool)> = report["tools"]["grants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| (g["grant"].as_str().unwrap().to_string(), g["present"].as_bool().unwrap()))
        .collect();
    let expect: Vec<(String, bool)> =
        [("llm", true), ("crm", true), ("py.echo", true), ("py.*", true), ("gone.echo", false), ("nope", false)]
            .iter()
            .map(|(g, p)| (g.to_string(), *p))
            .collect();
    assert_eq!(checked, expect, "{report}");
    assert_eq!(report["tools"]["grants"][4]["missing"], "MCP server \"gone\" is not answering now");
    let out = agent_host(&[&["plugins", "inspect", "helper"][..], &api].concat());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("  scope     tenant acme"), "{text}");
    assert!(text.contains("  crm        present  webhook"), "{text}");
    assert!(text.contains("  nope       MISSING  no tool of this name for this token's tenant"), "{text}");
    assert!(text.contains("    wall_ms              5000\n"), "{text}");

    // FILE with a token: the same check, against the manifest given.
    let out = agent_host(
        &[&["plugins", "inspect", &chat, "--manifest", manifest.to_str().unwrap(), "--json"][..], &api].concat(),
    );
    assert!(out.status.success(), "{}", said(&out));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["tools"]["grants"][1]["present"], true, "{report}");
    assert_eq!(report["tools"]["grants"][5]["present"], false, "{report}");
    // Another tenant does not see acme's plugin.
    let out = agent_host(&["plugins", "inspect", "helper", "--url", &url, "--token", &globex]);
    assert!(!out.status.success());
    assert!(said(&out).contains("no plugin named \"helper\""), "{}", said(&out));
}
