//! The command line's reference page, written from the clap definitions
//! (`config::Cli`): every command, its arguments, their environment
//! variables and defaults. `docs/src/reference/cli.md` is this text; a test
//! fails when the committed page differs (`AGENT_HOST_BLESS=1` rewrites it).

use std::fmt::Write;

use clap::CommandFactory;

/// The page, in Markdown.
pub fn cli_reference() -> String {
    let mut cmd = crate::cli::args::Cli::command();
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
    // The database flags are global: listed once, under `agent-host`.
    let sub = path.contains(' ');
    let args: Vec<&clap::Arg> = cmd
        .get_arguments()
        .filter(|a| !a.is_hide_set() && a.get_id() != "help" && a.get_id() != "version")
        .filter(|a| !(sub && a.is_global_set()))
        .collect();
    if !args.is_empty() {
        out.push_str("| argument | environment | default | meaning |\n| --- | --- | --- | --- |\n");
        for a in args {
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
            let values: Vec<String> = a
                .get_possible_values()
                .iter()
                .filter(|v| !v.is_hide_set())
                .map(|v| format!("`{}`", v.get_name()))
                .collect();
            if !values.is_empty() && !matches!(a.get_action(), clap::ArgAction::SetTrue) {
                help.push_str(&format!(" (one of {})", values.join(", ")));
            }
            let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
            let help = help.replace('|', "\\|").replace('<', "&lt;").replace('>', "&gt;");
            let _ = writeln!(out, "| {name} | {env} | {default} | {help} |");
        }
    }
    for sub in cmd.get_subcommands() {
        if sub.get_name() != "help" {
            command(out, sub, &format!("{path} {}", sub.get_name()));
        }
    }
}
