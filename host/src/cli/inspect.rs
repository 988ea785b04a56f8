//! `agent-host plugins inspect NAME|FILE`: what a plugin is and may do, for
//! a person or (`--json`) a script. A FILE is read here without compiling
//! (its component sections parsed with `wasmparser`, nested core modules
//! skipped unread): the WIT world version from its `agent-host:plugin`
//! imports, the imports grouped, the exports, the language, size and
//! digest as the host would record them. A NAME is the plugin's row of
//! `GET /v1/plugins` (the host does not serve a component's bytes back).
//! Either way the manifest is checked as an upload checks it and shown with
//! its limits' defaults filled in, and each granted tool is marked present
//! or missing against what `GET /v1/tools` lists for the token.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde_json::{json, Value};

use crate::cli::args::ApiArgs;
use crate::cli::client::{segment, Api};
use crate::db::plugins::{digest_of, language_of};
use crate::run::manifest::{Limits, Manifest};
use crate::service::plugins::{check_manifest, COMPONENT_BYTES_MAX};

/// The WIT package a plugin's host interface comes from.
const PLUGIN_PACKAGE: &str = "agent-host:plugin";
/// The worlds this host runs (the bindings in `sandbox`, `wit/<version>`).
pub const WORLDS_SERVED: &[&str] = &["0.1.0", "0.2.0"];
/// The manifest read beside a FILE when `--manifest` is not given.
const MANIFEST_BESIDE: &str = "manifest.json";
/// Pages of a list read at most (a list page holds up to 1000 items).
const PAGES_MAX: usize = 100;

/// What a component's own sections say of it.
#[derive(Debug, Clone, PartialEq)]
pub struct ComponentInfo {
    pub size_bytes: usize,
    pub digest: String,
    pub language: &'static str,
    /// The `agent-host:plugin` version its imports name (`None`: it imports
    /// nothing of the host interface).
    pub world: Option<String>,
    pub imports: Vec<String>,
    pub exports: Vec<String>,
}

/// Reads a component's top-level imports and exports without compiling or
/// validating it (a Python component of 19 MB takes milliseconds): nested
/// modules and components are skipped over, never parsed.
pub fn read_component(bytes: &[u8]) -> Result<ComponentInfo, String> {
    use wasmparser::{Chunk, ComponentExternalKind, ComponentTypeRef, Encoding, Parser, Payload};
    if !bytes.starts_with(b"\0asm") {
        return Err("not a WebAssembly component: the file does not begin with \"\\0asm\"".into());
    }
    let not_component = |e: wasmparser::BinaryReaderError| format!("not a WebAssembly component: {e}");
    let (mut imports, mut exports) = (Vec::new(), Vec::new());
    let mut parser = Parser::new(0);
    let mut rest = bytes;
    loop {
        let (payload, consumed) = match parser.parse(rest, true).map_err(not_component)? {
            Chunk::Parsed { consumed, payload } => (payload, consumed),
            // Not possible with `eof`; said rather than trusted.
            Chunk::NeedMoreData(_) => return Err("not a WebAssembly component: the file is cut short".into()),
        };
        rest = &rest[consumed..];
        match payload {
            Payload::Version { encoding: Encoding::Module, .. } => {
                return Err("a core WebAssembly module, not a component: build for wasm32-wasip2 (or wrap it \
                            with `wasm-tools component new`)"
                    .into())
            }
            // The parent parser has stepped past a nested one; so do we.
            Payload::ModuleSection { unchecked_range, .. } | Payload::ComponentSection { unchecked_range, .. } => {
                rest =
                    rest.get(unchecked_range.len()..).ok_or("not a WebAssembly component: a section is cut short")?;
            }
            Payload::ComponentImportSection(reader) => {
                // Types a component imports to name its exports' types are
                // no capability; instances and functions are.
                for import in reader {
                    let import = import.map_err(not_component)?;
                    if !matches!(import.ty, ComponentTypeRef::Type(_)) {
                        imports.push(import.name.name.to_string());
                    }
                }
            }
            Payload::ComponentExportSection(reader) => {
                for export in reader {
                    let export = export.map_err(not_component)?;
                    if export.kind != ComponentExternalKind::Type {
                        exports.push(export.name.name.to_string());
                    }
                }
            }
            Payload::End(_) => break,
            _ => {}
        }
    }
    let world = imports.iter().find_map(|i| world_of(i)).map(str::to_string);
    Ok(ComponentInfo {
        size_bytes: bytes.len(),
        digest: digest_of(bytes),
        language: language_of(bytes),
        world,
        imports,
        exports,
    })
}

/// The version of `agent-host:plugin/<interface>@<version>`.
fn world_of(import: &str) -> Option<&str> {
    let (package, version) = import.strip_prefix(PLUGIN_PACKAGE)?.strip_prefix('/')?.split_once('@')?;
    (!package.is_empty()).then_some(version)
}

/// An import's group: the host interface, WASI, or something else (which
/// the host does not provide: such a component fails to instantiate).
fn group_of(import: &str) -> &'static str {
    if import.starts_with(PLUGIN_PACKAGE) {
        "host"
    } else if import.starts_with("wasi:") {
        "wasi"
    } else {
        "other"
    }
}

/// `plugins inspect`: a FILE when `plugin` is an existing path (or looks
/// like one: it ends in `.wasm` or holds a `/`), else a NAME on the host.
/// Exit status 1 (an error) when the manifest is invalid.
pub async fn inspect(api: &ApiArgs, plugin: &str, manifest: Option<&Path>, as_json: bool) -> anyhow::Result<()> {
    let path = Path::new(plugin);
    let report = if path.exists() || plugin.ends_with(".wasm") || plugin.contains('/') {
        inspect_file(api, path, manifest).await?
    } else {
        if manifest.is_some() {
            bail!("--manifest is for a FILE; a plugin on the host is inspected with the manifest it was uploaded with");
        }
        inspect_name(api, plugin).await?
    };
    if as_json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    if let Some(e) = report["manifest_error"].as_str() {
        bail!("the manifest is invalid: {e}");
    }
    Ok(())
}

async fn inspect_file(api: &ApiArgs, path: &Path, manifest: Option<&Path>) -> anyhow::Result<Value> {
    let meta = std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    if meta.is_dir() {
        bail!("{} is a directory; give the component (.wasm) file, or `agent-host build` it first", path.display());
    }
    if meta.len() > COMPONENT_BYTES_MAX as u64 {
        bail!(
            "{} is {} bytes; a host takes components of {COMPONENT_BYTES_MAX} bytes at most",
            path.display(),
            meta.len()
        );
    }
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let component = read_component(&bytes).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let beside = path.parent().unwrap_or(Path::new(".")).join(MANIFEST_BESIDE);
    let manifest_path: Option<PathBuf> = match manifest {
        Some(m) => Some(m.to_path_buf()),
        None => beside.is_file().then_some(beside),
    };
    let (manifest, manifest_error) = match &manifest_path {
        None => (manifest_view(&json!({})).ok(), None),
        Some(m) => {
            let text = std::fs::read_to_string(m).with_context(|| format!("cannot read {}", m.display()))?;
            match serde_json::from_str::<Value>(&text) {
                Err(e) => (None, Some(format!("{} is not JSON: {e}", m.display()))),
                Ok(v) => match manifest_view(&v) {
                    Ok(view) => (Some(view), None),
                    Err(e) => (None, Some(e)),
                },
            }
        }
    };
    let tools = match (&manifest, &api.token) {
        (None, _) => json!({ "skipped": "the manifest is invalid" }),
        (Some(_), None) => {
            json!({ "skipped": "no token (--token or AGENT_HOST_TOKEN) to ask a host which tools it has" })
        }
        (Some(m), Some(_)) => match host_tools(api).await {
            Ok(listed) => check_grants(&m["tools"], &listed, &api.url),
            Err(e) => json!({ "skipped": format!("{e:#}") }),
        },
    };
    Ok(json!({
        "source": "file",
        "path": path.display().to_string(),
        "component": component_view(&component),
        "manifest_path": manifest_path.map(|p| p.display().to_string()),
        "manifest": manifest,
        "manifest_error": manifest_error,
        "tools": tools,
    }))
}

async fn inspect_name(api: &ApiArgs, name: &str) -> anyhow::Result<Value> {
    let client = Api::new(api)?;
    let row = find_plugin(&client, name).await?;
    if row["builtin"] == true {
        return Ok(json!({ "source": "host", "name": name, "url": client.url, "builtin": true, "plugin": row,
                          "component": null, "manifest": null, "manifest_error": null,
                          "tools": { "skipped": "a built-in agent has no manifest: it is granted every tool" } }));
    }
    let (manifest, manifest_error) = match manifest_view(&row["manifest"]) {
        Ok(view) => (Some(view), None),
        Err(e) => (None, Some(e)),
    };
    let tools = match &manifest {
        None => json!({ "skipped": "the manifest is invalid" }),
        Some(m) => check_grants(&m["tools"], &host_tools(api).await?, &client.url),
    };
    Ok(json!({
        "source": "host",
        "name": name,
        "url": client.url,
        "plugin": {
            "digest": row["digest"], "size_bytes": row["size_bytes"], "language": row["language"],
            "tenant_id": row["tenant_id"], "published": row["tenant_id"].is_null(), "updated_at": row["updated_at"],
        },
        "component": null,
        "component_note": "the host does not serve a component's bytes: run `agent-host plugins inspect FILE` on \
                           the .wasm for its world version, imports and exports",
        "manifest": manifest,
        "manifest_error": manifest_error,
        "tools": tools,
    }))
}

/// The row of `GET /v1/plugins` named `name` (the list is in name order).
async fn find_plugin(api: &Api, name: &str) -> anyhow::Result<Value> {
    let mut after: Option<String> = None;
    for _ in 0..PAGES_MAX {
        let path = match &after {
            None => "/v1/plugins?limit=1000".to_string(),
            Some(c) => format!("/v1/plugins?limit=1000&after={}", segment(c)),
        };
        let page = api.call(reqwest::Method::GET, &path, None).await?;
        let rows = page["plugins"].as_array().context("the answer has no plugins")?;
        if let Some(row) = rows.iter().find(|p| p["name"] == name) {
            return Ok(row.clone());
        }
        if rows.last().and_then(|p| p["name"].as_str()).is_some_and(|last| last > name) {
            break;
        }
        match page["next_cursor"].as_str() {
            Some(c) => after = Some(c.to_string()),
            None => break,
        }
    }
    bail!(
        "no plugin named {name:?} on {} for this token (`agent-host plugins list`; a path to a .wasm file is \
         inspected locally)",
        api.url
    )
}

/// Every page of `GET /v1/tools`: the tools, and the MCP servers that
/// cannot be listed now.
async fn host_tools(args: &ApiArgs) -> anyhow::Result<(Vec<Value>, Vec<String>)> {
    let api = Api::new(args)?;
    let (mut tools, mut down) = (Vec::new(), Vec::new());
    let mut after: Option<String> = None;
    for _ in 0..PAGES_MAX {
        let path = match &after {
            None => "/v1/tools".to_string(),
            Some(c) => format!("/v1/tools?after={}", segment(c)),
        };
        let page = api.call(reqwest::Method::GET, &path, None).await.context("GET /v1/tools")?;
        tools.extend(page["tools"].as_array().context("the answer has no tools")?.iter().cloned());
        for s in page["unavailable"].as_array().into_iter().flatten().filter_map(Value::as_str) {
            if !down.iter().any(|d| d == s) {
                down.push(s.to_string());
            }
        }
        match page["next_cursor"].as_str() {
            Some(c) => after = Some(c.to_string()),
            None => break,
        }
    }
    Ok((tools, down))
}

/// Each grant marked present (with the tools it reaches) or missing (and
/// why) against what the host lists.
fn check_grants(grants: &Value, (tools, down): &(Vec<Value>, Vec<String>), url: &str) -> Value {
    let names: Vec<&str> = tools.iter().filter_map(|t| t["name"].as_str()).collect();
    let kind = |name: &str| tools.iter().find(|t| t["name"] == name).map(|t| t["kind"].clone());
    let checked: Vec<Value> = grants
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(|grant| {
            // A sub-agent is a plugin, started by the run host.
            if let Some(plugin) = grant.strip_prefix(crate::tools::AGENT_TOOL_PREFIX) {
                return json!({ "grant": grant, "present": true, "kind": "agent", "tools": [plugin] });
            }
            let server = grant.split_once('.').map(|(s, _)| s);
            let reached: Vec<&str> = match grant.strip_suffix(".*") {
                Some(s) => names.iter().copied().filter(|n| n.split_once('.').is_some_and(|(p, _)| p == s)).collect(),
                None => names.iter().copied().filter(|n| *n == grant).collect(),
            };
            if !reached.is_empty() {
                let kind = kind(reached[0]).unwrap_or(Value::Null);
                return json!({ "grant": grant, "present": true, "kind": kind, "tools": reached });
            }
            let why = match server {
                Some(s) if down.iter().any(|d| d == s) => format!("MCP server {s:?} is not answering now"),
                Some(s) if grant.ends_with(".*") => format!("no MCP server {s:?} with tools for this token's tenant"),
                _ => "no tool of this name for this token's tenant".to_string(),
            };
            json!({ "grant": grant, "present": false, "missing": why })
        })
        .collect();
    json!({ "url": url, "grants": checked, "unavailable_servers": down })
}

/// A component as the report shows it.
fn component_view(c: &ComponentInfo) -> Value {
    let group = |g: &str| -> Vec<&str> { c.imports.iter().filter(|i| group_of(i) == g).map(String::as_str).collect() };
    json!({
        "size_bytes": c.size_bytes,
        "digest": c.digest,
        "language": c.language,
        "world": c.world.as_ref().map(|v| format!("{PLUGIN_PACKAGE}@{v}")),
        "world_version": c.world,
        "world_served": c.world.as_deref().is_some_and(|v| WORLDS_SERVED.contains(&v)),
        "imports": { "host": group("host"), "wasi": group("wasi"), "other": group("other") },
        "exports": c.exports,
    })
}

/// A manifest checked as the host checks an upload's (the host's message
/// when it is refused), with every limit's value and whether it is the
/// default.
fn manifest_view(raw: &Value) -> Result<Value, String> {
    let m: Manifest = check_manifest(raw).map_err(|e| e.to_string())?;
    let defaults = Limits::default().fields();
    let limits: serde_json::Map<String, Value> = m
        .limits
        .fields()
        .iter()
        .zip(defaults.iter())
        .map(|((name, v, _, _), (_, d, _, _))| {
            let set = raw["limits"].get(*name).is_some();
            (name.to_string(), json!({ "value": v, "default": d, "set": set }))
        })
        .collect();
    Ok(json!({
        "tools": m.tools,
        "limits": limits,
        "durability": m.durability,
        "approval": m.approval,
    }))
}

/// The report as lines a person reads.
fn render(r: &Value) -> String {
    let mut out = String::new();
    let mut line = |s: String| {
        out.push_str(&s);
        out.push('\n');
    };
    let list = |v: &Value| -> String {
        let items: Vec<&str> = v.as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        if items.is_empty() {
            "-".to_string()
        } else {
            items.join(", ")
        }
    };
    match r["source"].as_str() {
        Some("file") => line(format!("component  {}", r["path"].as_str().unwrap_or("?"))),
        _ => line(format!("plugin     {} on {}", r["name"].as_str().unwrap_or("?"), r["url"].as_str().unwrap_or("?"))),
    }
    if r["builtin"] == true {
        line("  a built-in agent of the host: no component, no manifest".into());
        return out;
    }
    let c = &r["component"];
    let p = if c.is_null() { &r["plugin"] } else { c };
    line(format!("  size      {} bytes", p["size_bytes"]));
    line(format!("  digest    {}", p["digest"].as_str().unwrap_or("-")));
    line(format!("  language  {}", p["language"].as_str().unwrap_or("-")));
    if !r["plugin"].is_null() {
        let scope = match r["plugin"]["tenant_id"].as_str() {
            Some(t) => format!("tenant {t}"),
            None => "published to every tenant".to_string(),
        };
        line(format!("  scope     {scope}"));
    }
    if c.is_null() {
        line(format!("  note      {}", r["component_note"].as_str().unwrap_or_default()));
    } else {
        let world = match (c["world"].as_str(), c["world_served"].as_bool()) {
            (Some(w), Some(true)) => format!("{w} (this host runs it)"),
            (Some(w), _) => format!("{w} (not a world this host runs: {})", WORLDS_SERVED.join(", ")),
            (None, _) => format!("unknown: it imports nothing of {PLUGIN_PACKAGE}"),
        };
        line(format!("  world     {world}"));
        line("imports".into());
        line(format!("  host      {}", list(&c["imports"]["host"])));
        line(format!("  wasi      {}", list(&c["imports"]["wasi"])));
        if !c["imports"]["other"].as_array().is_none_or(Vec::is_empty) {
            line(format!("  other     {} (not provided by the host)", list(&c["imports"]["other"])));
        }
        line(format!("exports     {}", list(&c["exports"])));
    }
    match (r["manifest"].is_null(), r["manifest_error"].as_str()) {
        (_, Some(e)) => line(format!("manifest   INVALID: {e}")),
        (true, None) => line("manifest   -".into()),
        (false, None) => {
            let m = &r["manifest"];
            let from = r["manifest_path"].as_str().unwrap_or(if r["source"] == "file" {
                "none: the defaults"
            } else {
                "as uploaded"
            });
            line(format!("manifest   {from}"));
            line(format!("  grants      {}", list(&m["tools"])));
            line(format!("  durability  {}", m["durability"].as_str().unwrap_or("-")));
            let approvals: Vec<String> = m["approval"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(t, a)| format!("{t} {}", a.as_str().unwrap_or("?")))
                .collect();
            line(format!(
                "  approval    {}",
                if approvals.is_empty() { "-".to_string() } else { approvals.join(", ") }
            ));
            line("  limits".into());
            for (name, l) in m["limits"].as_object().into_iter().flatten() {
                let note = if l["set"] == true { "" } else { " (default)" };
                line(format!("    {name:<20} {}{note}", l["value"]));
            }
        }
    }
    let t = &r["tools"];
    if let Some(why) = t["skipped"].as_str() {
        line(format!("tools      check skipped: {why}"));
        return out;
    }
    line(format!("tools on   {}", t["url"].as_str().unwrap_or("?")));
    let grants = t["grants"].as_array().cloned().unwrap_or_default();
    if grants.is_empty() {
        line("  (the manifest grants no tools)".into());
    }
    let width = grants.iter().filter_map(|g| g["grant"].as_str()).map(str::len).max().unwrap_or(0);
    for g in &grants {
        let name = g["grant"].as_str().unwrap_or("?");
        if g["present"] == true {
            let reached = g["tools"].as_array().map_or(0, Vec::len);
            let what = match (name.ends_with(".*"), g["kind"].as_str()) {
                (true, _) => format!("{reached} tools: {}", list(&g["tools"])),
                (false, Some(k)) => k.to_string(),
                (false, None) => "-".to_string(),
            };
            line(format!("  {name:<width$}  present  {what}"));
        } else {
            line(format!("  {name:<width$}  MISSING  {}", g["missing"].as_str().unwrap_or("")));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn world_versions_and_groups_come_from_import_names() {
        assert_eq!(world_of("agent-host:plugin/host@0.2.0"), Some("0.2.0"));
        assert_eq!(world_of("agent-host:plugin/types@0.1.0"), Some("0.1.0"));
        assert_eq!(world_of("agent-host:pluginx/host@0.2.0"), None);
        assert_eq!(world_of("wasi:cli/environment@0.2.6"), None);
        assert_eq!(group_of("agent-host:plugin/host@0.2.0"), "host");
        assert_eq!(group_of("wasi:io/streams@0.2.6"), "wasi");
        assert_eq!(group_of("acme:thing/x"), "other");
    }

    #[test]
    fn what_is_not_a_component_is_said() {
        let e = read_component(b"hello").unwrap_err();
        assert!(e.starts_with("not a WebAssembly component"), "{e}");
        // The smallest core module: magic and version 1.
        let e = read_component(b"\0asm\x01\0\0\0").unwrap_err();
        assert!(e.starts_with("a core WebAssembly module"), "{e}");
    }

    #[test]
    fn grants_are_present_missing_or_behind_a_server_down() {
        let tools = vec![
            json!({ "name": "llm", "kind": "model" }),
            json!({ "name": "py.echo", "kind": "mcp" }),
            json!({ "name": "py.slow", "kind": "mcp" }),
        ];
        let grants = json!(["llm", "py.*", "py.nope", "crm", "down.echo", "down.*"]);
        let checked = check_grants(&grants, &(tools, vec!["down".to_string()]), "http://h");
        let g = checked["grants"].as_array().unwrap();
        assert_eq!(g[0]["present"], true);
        assert_eq!(g[1]["tools"], json!(["py.echo", "py.slow"]));
        assert_eq!(g[2]["present"], false);
        assert_eq!(g[3]["missing"], "no tool of this name for this token's tenant");
        assert_eq!(g[4]["missing"], "MCP server \"down\" is not answering now");
        assert_eq!(g[5]["missing"], "MCP server \"down\" is not answering now");
    }
}
