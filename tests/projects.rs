//! Plugin projects outside this repository (issue 42): `agent-host new`
//! writes one in each language into a directory outside the checkout,
//! `agent-host build` builds it there (the TypeScript compiler, pinned,
//! type-checks a TypeScript agent first), and the component, uploaded over
//! HTTP with a tenant admin's token, answers a turn on a real host: the
//! template offers the model the MCP tool its manifest grants (the `mcp`
//! Python SDK's server) and quotes its answer, and a stop during the tool's
//! call ends the run `cancelled`.
//!
//! The SDKs are packages of their ecosystems: the Python wheel `agent-plugin`,
//! the npm package `agent-plugin` with its types and the crate `agent-plugin`
//! with its WIT world install with pip, npm and cargo from their local paths
//! into clean environments, as from PyPI, npm and crates.io; a generated
//! project depends on them by version.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use crate::support::mcp_servers::McpServerProcess;
use crate::support::process::{HostProcess, FAST};
use crate::support::*;

pub(crate) const LANGS: &[&str] = &["python", "javascript", "typescript", "rust"];

pub(crate) fn agent_host(dir: &Path, args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_agent-host"))
        .current_dir(dir)
        .args(args)
        .env("CARGO_TARGET_DIR", crate::docs::rust_target())
        .output()
        .unwrap()
}

pub(crate) fn said(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// A fresh directory outside the checkout.
pub(crate) fn scratch(what: &str) -> PathBuf {
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

/// The checkout: the SDKs' sources and scripts/build-plugin.
fn checkout() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Runs a command that must succeed.
fn ok(what: &str, command: &mut Command) -> Output {
    let out = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(out.status.success(), "{what}: {}", said(&out));
    out
}

/// A pinned toolchain's directory, installed by scripts/build-plugin if need be.
fn toolchain(lang: &str) -> PathBuf {
    let out = ok(
        "build-plugin --toolchain",
        Command::new(checkout().join("scripts/build-plugin")).args(["--toolchain", lang]),
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// A directory's files (relative paths) and their bytes.
fn files(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut found = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(at) = todo.pop() {
        for entry in std::fs::read_dir(&at).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                todo.push(path);
            } else {
                found.push((path.strip_prefix(dir).unwrap().to_path_buf(), std::fs::read(&path).unwrap()));
            }
        }
    }
    found.sort();
    found
}

/// The Rust SDK carries its world (plugins/sdk/wit, what `generate!` reads)
/// as a copy of wit/0.2.0: the two may not drift.
#[test]
fn the_rust_sdks_wit_world_is_wit_0_2_0_byte_for_byte() {
    let root = checkout();
    let (copy, world) = (files(&root.join("plugins/sdk/wit")), files(&root.join("wit/0.2.0")));
    assert!(!world.is_empty());
    let names = |f: &[(PathBuf, Vec<u8>)]| f.iter().map(|(p, _)| p.clone()).collect::<Vec<_>>();
    assert_eq!(names(&copy), names(&world), "plugins/sdk/wit and wit/0.2.0 hold different files");
    for ((path, a), (_, b)) in copy.iter().zip(&world) {
        assert!(
            a == b,
            "plugins/sdk/wit/{} differs from wit/0.2.0's: copy wit/0.2.0 into plugins/sdk/wit",
            path.display()
        );
    }
}

#[test]
fn the_sdk_packages_install_with_pip_npm_and_cargo_from_their_local_paths() {
    let root = checkout();
    let dir = scratch("packages");

    // Python: the wheel, built from a copy of the source (as from an sdist)
    // and installed into a fresh venv from that directory alone (--no-index:
    // nothing from PyPI), by the version range a project declares.
    let source = dir.join("sdk-python");
    ok("cp", Command::new("cp").arg("-r").arg(root.join("plugins/sdk-python")).arg(&source));
    let _ = std::fs::remove_dir_all(source.join("agent_plugin/__pycache__"));
    let venv = dir.join("venv");
    ok("python3 -m venv", Command::new("python3").args(["-m", "venv"]).arg(&venv));
    let (pip, python) = (venv.join("bin/pip"), venv.join("bin/python"));
    let wheels = dir.join("wheels");
    ok(
        "pip wheel",
        Command::new(&pip)
            .args(["wheel", "-q", "--disable-pip-version-check", "--no-deps", "-w"])
            .arg(&wheels)
            .arg(&source),
    );
    ok(
        "pip install",
        Command::new(&pip)
            .args(["install", "-q", "--disable-pip-version-check", "--no-index", "--find-links"])
            .arg(&wheels)
            .arg("agent-plugin>=0.2,<0.3"),
    );
    let metadata = ok(
        "importlib.metadata",
        Command::new(&python).args([
            "-c",
            "import importlib.metadata as m; print(m.version('agent-plugin')); \
             print(*sorted(str(f) for f in m.files('agent-plugin') if f.parts[0] == 'agent_plugin' and f.suffix != '.pyc'))",
        ]),
    );
    assert_eq!(String::from_utf8_lossy(&metadata.stdout), "0.2.0\nagent_plugin/__init__.py agent_plugin/py.typed\n");
    // Outside a component build its host bindings do not exist: the import
    // says so, not merely "No module named 'wit_world'".
    let import = Command::new(&python).args(["-c", "import agent_plugin"]).output().unwrap();
    assert!(!import.status.success());
    let said_import = said(&import);
    assert!(
        said_import.contains("ImportError: agent_plugin runs inside an agent-host plugin")
            && said_import.contains("agent-host build"),
        "{said_import}"
    );

    // JavaScript/TypeScript: the tarball `npm pack` makes (what the registry
    // would serve), installed offline into a project that depends on
    // `agent-plugin` by version; the TypeScript compiler sees its types there.
    let packed = dir.join("npm");
    std::fs::create_dir_all(&packed).unwrap();
    ok(
        "npm pack",
        Command::new("npm")
            .current_dir(&dir)
            .args(["pack", "--loglevel=error", "--pack-destination"])
            .arg(&packed)
            .arg(root.join("plugins/sdk-js")),
    );
    let tarball = packed.join("agent-plugin-0.2.0.tgz");
    assert!(tarball.exists(), "npm pack made no agent-plugin-0.2.0.tgz");
    let js = dir.join("js");
    std::fs::create_dir_all(&js).unwrap();
    std::fs::write(
        js.join("package.json"),
        r#"{ "name": "probe", "private": true, "type": "module", "dependencies": { "agent-plugin": "^0.2.0" } }"#,
    )
    .unwrap();
    ok(
        "npm install",
        Command::new("npm")
            .current_dir(&js)
            .args(["install", "--offline", "--no-save", "--no-audit", "--no-fund", "--loglevel=error"])
            .arg(&tarball),
    );
    let installed = js.join("node_modules/agent-plugin");
    let names = files(&installed).into_iter().map(|(p, _)| p.display().to_string()).collect::<Vec<_>>();
    assert_eq!(names, ["index.d.ts", "index.js", "package.json", "wit.d.ts"]);
    let package: serde_json::Value =
        serde_json::from_slice(&std::fs::read(installed.join("package.json")).unwrap()).unwrap();
    assert_eq!(
        (&package["version"], &package["types"]),
        (&serde_json::json!("0.2.0"), &serde_json::json!("./index.d.ts"))
    );
    let tsc = toolchain("js").join("node_modules/typescript/bin/tsc");
    let check = |source: &str| {
        std::fs::write(js.join("probe.ts"), source).unwrap();
        Command::new("node")
            .current_dir(&js)
            .arg(&tsc)
            .args([
                "--noEmit",
                "--strict",
                "--target",
                "es2022",
                "--module",
                "es2022",
                "--moduleResolution",
                "bundler",
                "--pretty",
                "false",
                "probe.ts",
            ])
            .output()
            .unwrap()
    };
    let typed = "import { exportAgent, type Turn } from \"agent-plugin\";\n\
                 export const run = exportAgent((turn: Turn): string => turn.content);\n";
    let checked = check(typed);
    assert!(checked.status.success(), "{}", said(&checked));
    // The types are the SDK's, not `any`: a turn's content is no number.
    let mistyped = check(&typed.replace("(turn: Turn): string => turn.content", "(turn: Turn) => turn.content.length"));
    assert!(!mistyped.status.success() && said(&mistyped).contains("error TS2345"), "{}", said(&mistyped));

    // Rust: the .crate `cargo package` makes (what crates.io would serve)
    // carries its WIT world; unpacked, as cargo unpacks a download, it builds
    // a crate depending on `agent-plugin = "0.2"`.
    let target = dir.join("cargo-target");
    ok(
        "cargo package",
        Command::new("cargo")
            .args(["package", "-q", "--no-verify", "--allow-dirty", "-p", "agent-plugin", "--manifest-path"])
            .arg(root.join("plugins/Cargo.toml"))
            .arg("--target-dir")
            .arg(&target),
    );
    let crates = dir.join("crates");
    std::fs::create_dir_all(&crates).unwrap();
    ok(
        "tar",
        Command::new("tar").arg("-xzf").arg(target.join("package/agent-plugin-0.2.0.crate")).arg("-C").arg(&crates),
    );
    let unpacked = crates.join("agent-plugin-0.2.0");
    assert_eq!(files(&unpacked.join("wit")), files(&root.join("wit/0.2.0")), "the crate's WIT world");
    let probe = dir.join("rust-probe");
    std::fs::create_dir_all(probe.join("src")).unwrap();
    std::fs::write(
        probe.join("Cargo.toml"),
        format!(
            "[package]\nname = \"rust-probe\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n[lib]\ncrate-type = [\"cdylib\"]\n\n\
             [dependencies]\nagent-plugin = \"0.2\"\n\n[patch.crates-io]\nagent-plugin = {{ path = {:?} }}\n\n[workspace]\n",
            unpacked.display().to_string()
        ),
    )
    .unwrap();
    std::fs::write(
        probe.join("src/lib.rs"),
        "struct Probe;\nimpl agent_plugin::Agent for Probe {\n    fn run(turn: agent_plugin::Turn) -> Result<String, String> {\n        \
         Ok(turn.content.clone())\n    }\n}\nagent_plugin::export_agent!(Probe);\n",
    )
    .unwrap();
    let rust_target = crate::docs::rust_target();
    ok(
        "cargo build",
        Command::new("cargo")
            .current_dir(&probe)
            .args(["build", "--release", "--target", "wasm32-wasip2", "--target-dir"])
            .arg(&rust_target),
    );
    assert!(rust_target.join("wasm32-wasip2/release/rust_probe.wasm").exists());
    let _ = std::fs::remove_dir_all(&dir);
}
