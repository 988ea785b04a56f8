//! Plugin projects outside this repository (issue 42): `agent-host new`
//! writes one in each language into a directory outside the checkout,
//! `agent-host build` builds it there (the TypeScript compiler, pinned,
//! type-checks a TypeScript agent first), and the component, uploaded over
//! HTTP with a tenant admin's token, answers a turn on a real host: the
//! template offers the model the MCP tool its manifest grants (the `mcp`
//! Python SDK's server) and quotes its answer, and a stop during the tool's
//! call ends the run `cancelled`.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use crate::support::mcp_servers::McpServerProcess;
use crate::support::process::{HostProcess, FAST};
use crate::support::*;

const LANGS: &[&str] = &["python", "javascript", "typescript", "rust"];

fn agent_host(dir: &Path, args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
        .current_dir(dir)
        .args(args)
        .env("CARGO_TARGET_DIR", crate::docs::rust_target())
        .output()
        .unwrap()
}

fn said(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// A fresh directory outside the checkout.
fn scratch(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("agent-host-{what}-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_project_in_each_language_builds_uploads_calls_a_granted_tool_and_stops() {
    let mcp = McpServerProcess::python(None, None).await;
    let db = TestDb::new().await;
    let dir = scratch("projects");
    let tools = dir.join("tools.toml");
    std::fs::write(&tools, format!("[[mcp]]\nname = \"py\"\nurl = \"{}\"\ntimeout_ms = 120000\n", mcp.url())).unwrap();
    let args = [FAST, &["--tenant-tools", "all", "--tools-file", tools.to_str().unwrap()]].concat();
    let host = HostProcess::spawn(&db.url, "projects", &args);
    let token = agent_host::db::tokens::create(&db.pool, "author", "makers", true).await.unwrap();
    let url = format!("http://{}", host.addr);
    let api = ["--url", url.as_str(), "--token", token.as_str()];
    for (n, lang) in LANGS.iter().enumerate() {
        let name = format!("hello-{lang}");
        let made = agent_host(&dir, &["new", &name, "--lang", lang]);
        assert!(made.status.success(), "{}", said(&made));
        let project = dir.join(&name);
        let manifest: serde_json::Value =
            serde_json::from_slice(&std::fs::read(project.join("manifest.json")).unwrap()).unwrap();
        assert!(manifest["$schema"].as_str().unwrap().ends_with("manifest.schema.json"), "{manifest}");
        assert!(project.join("README.md").exists());

        let built = agent_host(&project, &["build"]);
        assert!(built.status.success(), "{lang}: {}", said(&built));
        let wasm = project.join("target").join(format!("{name}.wasm"));
        assert_eq!(String::from_utf8_lossy(&built.stdout).trim(), wasm.display().to_string());
        // Unchanged: not built again (the same file, untouched).
        let before = std::fs::metadata(&wasm).unwrap().modified().unwrap();
        let again = agent_host(&project, &["build"]);
        assert!(again.status.success(), "{}", said(&again));
        assert_eq!(std::fs::metadata(&wasm).unwrap().modified().unwrap(), before, "{lang} was built again");

        // Uploaded twice: granted the MCP server's `echo`, and its `slow`.
        for (plugin, tool) in [(name.clone(), "py.echo"), (format!("{name}-slow"), "py.slow")] {
            let mut grants = manifest.clone();
            grants["tools"] = serde_json::json!(["llm", tool]);
            std::fs::write(project.join(format!("{plugin}.json")), grants.to_string()).unwrap();
            let upload =
                agent_host(
                    &project,
                    &[
                        &[
                            "plugins",
                            "upload",
                            &plugin,
                            wasm.to_str().unwrap(),
                            "--manifest",
                            &format!("{plugin}.json"),
                        ][..],
                        &api,
                    ]
                    .concat(),
                );
            assert!(upload.status.success(), "{lang}: {}", said(&upload));
        }
        // The offline model calls the one tool it is offered (`py.echo`, as
        // `py_echo`) and quotes its answer.
        let turn = agent_host(&project, &[&["runs", "create", "--plugin", &name][..], &api, &["hello"]].concat());
        assert!(turn.status.success(), "{lang}: {}", said(&turn));
        assert_eq!(
            String::from_utf8_lossy(&turn.stdout),
            "Offline reply to: hello Tool py_echo said: echo: hello",
            "{lang}: {}",
            said(&turn)
        );
        // A stop while the model's call of `py.slow` runs: the server sees the
        // call cancelled, the agent passes the stop on, the run ends cancelled.
        let slow = format!("{name}-slow");
        let started =
            agent_host(&project, &[&["runs", "create", "--plugin", &slow, "--no-follow"][..], &api, &["nap"]].concat());
        assert!(started.status.success(), "{lang}: {}", said(&started));
        let id = String::from_utf8_lossy(&started.stdout).trim().to_string();
        let count = |what: &str| mcp.notes().iter().filter(|l| l.starts_with(what)).count();
        wait_for("the slow call to start", Duration::from_secs(60), || async { count("started ") > n }).await;
        let cancel = agent_host(&project, &[&["runs", "cancel", &id][..], &api].concat());
        assert!(cancel.status.success(), "{lang}: {}", said(&cancel));
        let tail = agent_host(&project, &[&["runs", "tail", &id][..], &api].concat());
        assert_eq!(tail.status.code(), Some(1), "{lang}: {}", said(&tail));
        let view = agent_host(&project, &[&["runs", "get", &id, "--json"][..], &api].concat());
        let view: serde_json::Value = serde_json::from_slice(&view.stdout).unwrap();
        assert_eq!(view["status"], "cancelled", "{lang}: {view}");
        wait_for("the server to see the cancel", Duration::from_secs(30), || async { count("cancelled ") > n }).await;
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_typescript_type_error_fails_the_build_with_the_compilers_message() {
    let dir = scratch("typescript");
    assert!(agent_host(&dir, &["new", "typo", "--lang", "typescript"]).status.success());
    let app = dir.join("typo/app.ts");
    let text = std::fs::read_to_string(&app).unwrap().replace("return answer.content ?? \"\";", "return 42;");
    std::fs::write(&app, text).unwrap();
    let built = agent_host(&dir.join("typo"), &["build"]);
    assert!(!built.status.success());
    let said = said(&built);
    assert!(said.contains("typo/app.ts(") && said.contains("error TS2322"), "{said}");
    assert!(!dir.join("typo/target/typo.wasm").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn new_refuses_a_bad_name_and_a_directory_in_use() {
    let dir = scratch("refusals");
    let bad = agent_host(&dir, &["new", "Bad Name", "--lang", "python"]);
    assert!(!bad.status.success() && said(&bad).contains("is not a plugin name"), "{}", said(&bad));
    assert!(agent_host(&dir, &["new", "taken", "--lang", "python"]).status.success());
    let again = agent_host(&dir, &["new", "taken", "--lang", "rust"]);
    assert!(!again.status.success() && said(&again).contains("is not empty"), "{}", said(&again));
    assert!(std::fs::read_to_string(dir.join("taken/app.py")).unwrap().contains("def run"), "the project was kept");
    let _ = std::fs::remove_dir_all(&dir);
}
