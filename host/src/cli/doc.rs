//! The command line's reference page, written from the clap definitions
//! (`config::Cli`): every command, its arguments, their environment
//! variables and defaults. `docs/src/reference/cli.md` is this text; a test
//! fails when the committed page differs (`AGENT_HOST_BLESS=1` rewrites it).

use std::fmt::Write;

/// The page, in Markdown.
pub fn cli_reference() -> String {
    let mut cmd = <crate::cli::args::Cli as clap::CommandFactory>::command();
    cmd.build();
    let mut out = String::from(
        "# Command line\n\n\
         <!-- Generated from the clap definitions (host/src/cli/args.rs) by host/src/cli/doc.rs; \
         do not edit: run the tests with AGENT_HOST_BLESS=1 to write it again. -->\n\n\
         Every flag may also come from its environment variable; durations are in milliseconds \
         unless the name says otherwise.\n",
    );
    command(&mut out, &cmd, "agent-host");
    out
}

fn command(out: &mut String, cmd: &clap::Command, path: &str) {
    if cmd.is_hide_set() {
        return;
    }
    let level = if path.contains(' ') { "###" } else { "##" };
    let _ = write!(out, "\n{level} `{path}`\n\n");
    if let Some(about) = cmd.get_long_about().or(cmd.get_about()) {
        let _ = writeln!(out, "{}\n", about.to_string().trim());
    }
    // The database flags: listed once, under `agent-host serve`; every other
    // command that opens the database says so.
    let db_flags = cmd.get_arguments().any(|a| a.get_id() == "database_url");
    if db_flags && path != "agent-host serve" {
        out.push_str("It opens the database: the [database flags](#agent-host-serve) apply.\n\n");
    }
    let args: Vec<&clap::Arg> = cmd
        .get_arguments()
        .filter(|a| !a.is_hide_set() && a.get_id() != "help" && a.get_id() != "version")
        .filter(|a| path == "agent-host serve" || a.get_help_heading() != Some("Database"))
        .collect();
    arg_tables(out, &args);
    if let Some(after) = cmd.get_after_help() {
        let _ = write!(out, "```text\n{}\n```\n", after.to_string().trim());
    }
    for sub in cmd.get_subcommands() {
        if sub.get_name() != "help" {
            command(out, sub, &format!("{path} {}", sub.get_name()));
        }
    }
}

/// Every generated file of the book: (path under `docs/src/`, its text).
/// The tests fail when a committed one differs (`AGENT_HOST_BLESS=1`
/// writes them again).
pub fn generated_pages() -> Vec<(&'static str, String)> {
    let manifest = schemars::schema_for!(crate::run::manifest::Manifest).to_value();
    let tools = schemars::schema_for!(crate::tools::ToolsFile).to_value();
    let pretty = |v: &serde_json::Value| serde_json::to_string_pretty(v).expect("a schema is JSON") + "\n";
    vec![
        ("reference/cli.md", cli_reference()),
        ("reference/configuration.md", configuration_page()),
        (
            "reference/manifest-schema.md",
            schema_page(
                "Manifest fields",
                "A plugin's `manifest.json`: the tools it is granted and its limits. Every field is optional. \
                 What the limits mean and their ceilings: [Manifest and limits](manifest.md). The JSON Schema, \
                 for an editor: [manifest.schema.json](manifest.schema.json).",
                "host/src/run/manifest.rs",
                &manifest,
            ),
        ),
        ("reference/manifest.schema.json", pretty(&manifest)),
        (
            "reference/tools-file.md",
            schema_page(
                "Tools file",
                "The operator's tools file (`serve --tools-file FILE`, TOML): webhook tools (`[[webhook]]`), MCP \
                 servers (`[[mcp]]`), destinations of the `http` tool (`[[http]]`) and the secrets they may use \
                 (`[secrets]`). A value may be `${env:NAME}`, read from the environment at start. A worked example: \
                 [Tools, MCP servers and the http tool](../guides/tools.md). The JSON Schema: \
                 [tools-file.schema.json](tools-file.schema.json).",
                "host/src/tools/config.rs",
                &tools,
            ),
        ),
        ("reference/tools-file.schema.json", pretty(&tools)),
        ("reference/routes.md", routes_page()),
        ("reference/openapi.json", pretty(&crate::api::openapi())),
    ]
}

/// Every route of the HTTP API in one table, from the table the router is
/// built from (`api::routes::ROUTES`), beside its OpenAPI document.
fn routes_page() -> String {
    let mut out = String::from(
        "# Routes\n\n<!-- Generated from the route table (host/src/api/routes.rs) by host/src/cli/doc.rs; do not \
         edit: run the tests with AGENT_HOST_BLESS=1 to write it again. -->\n\n\
         Every route the host serves. The request and answer schemas are in the OpenAPI document, \
         [openapi.json](openapi.json) (also served at `/openapi.json`); errors have one shape, \
         `{\"error\": {\"code\", \"message\"}}` ([HTTP API](http-api.md)). 🔒: needs `Authorization: Bearer`.\n\n\
         | method and path | what | success | errors |\n| --- | --- | --- | --- |\n",
    );
    for r in crate::api::ROUTES {
        let lock = if r.auth { " 🔒" } else { "" };
        let mut errors: Vec<u16> = r.errors.to_vec();
        if r.auth {
            errors.push(401);
        }
        errors.sort_unstable();
        let errors: Vec<String> = errors.iter().map(u16::to_string).collect();
        let errors = if errors.is_empty() { "-".to_string() } else { errors.join(", ") };
        let _ = writeln!(
            out,
            "| `{} {}`{lock} | {} | {} {} | {errors} |",
            r.method.to_uppercase(),
            r.path,
            one_line(r.summary).replace('|', "\\|"),
            r.ok.0,
            one_line(r.ok.1).replace('|', "\\|"),
        );
    }
    let _ = writeln!(
        out,
        "\nBeside them, `POST {}` 🔒 is the MCP server: JSON-RPC over Streamable HTTP, whose methods are MCP's \
         rather than operations of the document ([Agents as MCP tools](../guides/mcp-server.md)).",
        crate::api::MCP_PATH
    );
    out
}

/// A reference page of a JSON Schema: a table of fields for the top object
/// and for each type it defines.
fn schema_page(title: &str, intro: &str, source: &str, schema: &serde_json::Value) -> String {
    let mut out = format!(
        "# {title}\n\n<!-- Generated from the Rust types ({source}) by host/src/cli/doc.rs; do not edit: run the \
         tests with AGENT_HOST_BLESS=1 to write it again. -->\n\n{intro}\n"
    );
    object_table(&mut out, schema);
    if let Some(defs) = schema.get("$defs").and_then(|d| d.as_object()) {
        for (name, def) in defs {
            let _ = write!(out, "\n## `{name}`\n\n");
            if let Some(d) = def.get("description").and_then(|d| d.as_str()) {
                let _ = writeln!(out, "{}\n", one_line(d));
            }
            if def.get("properties").is_some() {
                object_table(&mut out, def);
            } else if let Some(values) = variants(def) {
                let _ = writeln!(out, "One of: {}.", values.join(", "));
            }
        }
    }
    out
}

fn object_table(out: &mut String, schema: &serde_json::Value) {
    let Some(props) = schema.get("properties").and_then(|p| p.as_object()) else { return };
    let required: Vec<&str> =
        schema.get("required").and_then(|r| r.as_array()).into_iter().flatten().filter_map(|v| v.as_str()).collect();
    out.push_str("\n| field | type | default | meaning |\n| --- | --- | --- | --- |\n");
    for (name, p) in props {
        let default = match p.get("default") {
            Some(d) => format!("`{d}`"),
            None if required.contains(&name.as_str()) => "required".to_string(),
            None => String::new(),
        };
        let meaning = p.get("description").and_then(|d| d.as_str()).map(one_line).unwrap_or_default();
        let _ = writeln!(out, "| `{name}` | {} | {default} | {} |", type_of(p), meaning.replace('|', "\\|"));
    }
}

/// A field's type as a reader says it: `string`, `array of string`, a
/// reference's name, the words of an enum.
fn type_of(p: &serde_json::Value) -> String {
    if let Some(r) = p.get("$ref").and_then(|r| r.as_str()) {
        let name = r.rsplit('/').next().unwrap_or(r);
        return format!("[`{name}`](#{})", name.to_lowercase());
    }
    if let Some(values) = variants(p) {
        return values.join(" \\| ");
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        if let Some(options) = p.get(key).and_then(|o| o.as_array()) {
            let kinds: Vec<String> =
                options.iter().filter(|o| o.get("type") != Some(&serde_json::json!("null"))).map(type_of).collect();
            return kinds.join(" or ");
        }
    }
    let kind = match p.get("type") {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Array(kinds)) => {
            kinds.iter().filter_map(|k| k.as_str()).filter(|k| *k != "null").collect::<Vec<_>>().join(" or ")
        }
        _ => "any".to_string(),
    };
    match kind.as_str() {
        "array" => format!("array of {}", p.get("items").map_or("any".to_string(), type_of)),
        "object" => match p.get("additionalProperties") {
            Some(v) if v.is_object() => format!("map of {}", type_of(v)),
            _ => "object".to_string(),
        },
        _ => kind,
    }
}

/// The words of an enum (`enum`, or `oneOf` of `const`s), quoted.
fn variants(p: &serde_json::Value) -> Option<Vec<String>> {
    if let Some(values) = p.get("enum").and_then(|e| e.as_array()) {
        return Some(values.iter().map(|v| format!("`{v}`")).collect());
    }
    let options = p.get("oneOf").and_then(|o| o.as_array())?;
    options.iter().map(|o| o.get("const").map(|c| format!("`{c}`"))).collect()
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// One table of `args` a help heading, in the order the headings first appear.
fn arg_tables(out: &mut String, args: &[&clap::Arg]) {
    let mut headings: Vec<Option<&str>> = Vec::new();
    for a in args {
        if !headings.contains(&a.get_help_heading()) {
            headings.push(a.get_help_heading());
        }
    }
    for heading in headings {
        if let Some(h) = heading {
            let _ = write!(out, "**{h}**\n\n");
        }
        out.push_str("| argument | environment | default | meaning |\n| --- | --- | --- | --- |\n");
        for a in args.iter().filter(|a| a.get_help_heading() == heading) {
            let _ = writeln!(out, "{}", arg_row(a));
        }
        out.push('\n');
    }
}

/// Settings read from the environment alone: (variable, default, meaning).
const ENVIRONMENT_ONLY: &[(&str, &str, &str)] = &[
    (
        "AGENT_HOST_ARTIFACT_KEY",
        "unset",
        "the artifact key itself, instead of `--artifact-key-file` (see Compile once)",
    ),
    (
        "AGENT_HOST_PG_BIN",
        "search",
        "directory of `initdb` and `pg_ctl` (else `PATH`, then `/usr/lib/postgresql/*/bin`)",
    ),
    ("AGENT_HOST_LOG", "`info`", "log filter (`tracing` syntax, e.g. `agent_host=debug`)"),
];

/// The configuration page: what `serve` refuses, then every flag of
/// `serve` from the clap definitions, grouped by heading, and the settings
/// read from the environment alone.
fn configuration_page() -> String {
    let mut cmd = <crate::cli::args::Cli as clap::CommandFactory>::command();
    cmd.build();
    let serve = cmd.find_subcommand("serve").expect("serve is a command");
    let mut out = String::from(
        "# Configuration\n\n<!-- Generated from the clap definitions (host/src/cli/args.rs) by host/src/cli/doc.rs; \
         do not edit: run the tests with AGENT_HOST_BLESS=1 to write it again. -->\n\n\
         `agent-host serve` takes every setting as a flag or from its environment variable; durations are \
         milliseconds unless the name says otherwise. It refuses at start, with a message naming the flag and its \
         variable, anything that would spin or overcommit: a heartbeat not below the lease; a zero lease, heartbeat, \
         reap interval, poll tick, journal flush, SSE keepalive, retention interval, resume attempts, webhook \
         attempts, backoff or poll, schedule tick or pool size; an allow-list without a signing secret, or a secret \
         that is not one; a tools file entry that does not check, or a `${env:NAME}` it names that is not set; \
         `--max-runs` of 0 or above 10,000 (one process's most slots: its sandbox's pool is sized by it). The other commands' arguments: \
         [Command line](cli.md).\n\n",
    );
    let args: Vec<&clap::Arg> = serve.get_arguments().filter(|a| !a.is_hide_set() && a.get_id() != "help").collect();
    arg_tables(&mut out, &args);
    out.push_str("**The environment alone**\n\n| variable | default | meaning |\n| --- | --- | --- |\n");
    for (var, default, meaning) in ENVIRONMENT_ONLY {
        let _ = writeln!(out, "| `{var}` | {default} | {meaning} |");
    }
    out.push_str(
        "\nAs root (as in CI), the private cluster runs as the `postgres` account, which then owns \
         `<data-dir>/pg`: PostgreSQL refuses to run as root. A guard process holds a pipe to the host and stops \
         the cluster when the host exits, however it exits.\n",
    );
    out
}

/// One argument's row of the reference: name, environment, default, meaning.
fn arg_row(a: &clap::Arg) -> String {
    let name = match (a.get_long(), a.is_positional()) {
        (Some(long), _) => format!("`--{long}`"),
        (None, true) => format!(
            "`{}`",
            a.get_value_names()
                .and_then(|v| v.first())
                .map_or_else(|| a.get_id().to_string().to_uppercase(), |v| v.to_string())
        ),
        (None, false) => format!("`{}`", a.get_id()),
    };
    let env = a.get_env().map_or(String::new(), |e| format!("`{}`", e.to_string_lossy()));
    let default = a.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect::<Vec<_>>();
    let default = if default.is_empty() { String::new() } else { format!("`{}`", default.join(",")) };
    let mut help = a.get_long_help().or(a.get_help()).map(|h| h.to_string()).unwrap_or_default();
    let values: Vec<String> =
        a.get_possible_values().iter().filter(|v| !v.is_hide_set()).map(|v| format!("`{}`", v.get_name())).collect();
    if !values.is_empty() && !matches!(a.get_action(), clap::ArgAction::SetTrue) {
        help.push_str(&format!(" (one of {})", values.join(", ")));
    }
    let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
    let help = help.replace('|', "\\|").replace('<', "&lt;").replace('>', "&gt;");
    format!("| {name} | {env} | {default} | {help} |")
}
