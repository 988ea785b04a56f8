//! The `agent-host` binary: parses the command line (`config`), refuses a
//! configuration that would busy-loop or overcommit before anything is
//! opened, then serves, migrates, manages tokens and plugins, or drives a
//! running host over HTTP (`client`).

use clap::{CommandFactory, Parser};
use tracing_subscriber::EnvFilter;

use agent_host::cli::args::{Cli, Command, PluginsCommand};
use agent_host::cli::client;
use agent_host::cli::serve as server;
use agent_host::db;

/// Where the benchmark went when it left the host's binary.
const BENCH_MOVED: &str = "the benchmark is no longer part of agent-host: it is its own binary, \
    `cargo run --release -p agent-host-bench -- [flags]` (the same flags; see docs/src/performance.md)";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Refused before anything is opened, as a usage error (exit status 2).
    if let Err(e) = cli.validate() {
        Cli::command().error(clap::error::ErrorKind::ValueValidation, e).exit();
    }
    // `test` and `dev` report in their own lines; the host they run logs only warnings.
    let quiet = if matches!(cli.command, Command::Test { .. } | Command::Dev(_)) { "warn" } else { "info" };
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_env("AGENT_HOST_LOG").unwrap_or_else(|_| EnvFilter::new(quiet)))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if !matches!(cli.command, Command::Serve(_) | Command::Dev(_)) {
        end_quietly_on_a_closed_pipe();
    }
    match cli.command {
        Command::Serve(args) => server::serve(&args.db, &args).await,
        Command::Migrate { db } => {
            server::with_pool(&db, |_| async {
                println!("migrations applied ({} in all)", db::MIGRATOR.iter().count());
                Ok(())
            })
            .await
        }
        Command::Tokens { db, command } => server::tokens(&db, command).await,
        Command::Tenants { db, command } => server::tenants(&db, command).await,
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "agent-host", &mut std::io::stdout());
            Ok(())
        }
        Command::Audit { db, tenant, after, limit } => server::audit(&db, tenant.as_deref(), after, limit).await,
        Command::Bench { .. } => Cli::command().error(clap::error::ErrorKind::InvalidSubcommand, BENCH_MOVED).exit(),
        Command::Plugins(PluginsCommand::Add { db, name, file, manifest, tenant }) => {
            server::plugins_add(&db, &name, &file, manifest.as_deref(), tenant.as_deref()).await
        }
        Command::Plugins(PluginsCommand::List { db, tenant, json }) => {
            server::plugins_list(&db, tenant.as_deref(), json).await
        }
        Command::Plugins(PluginsCommand::Upload { api, name, file, manifest }) => {
            client::plugins_upload(&api, &name, &file, manifest.as_deref()).await
        }
        Command::Plugins(PluginsCommand::Inspect { api, plugin, manifest, json }) => {
            agent_host::cli::inspect::inspect(&api, &plugin, manifest.as_deref(), json).await
        }
        Command::New { name, lang, dir } => {
            let made = agent_host::cli::project::new(&name, lang, &dir)?;
            println!("{}", made.display());
            eprintln!("next: cd {} && agent-host build (see its README.md)", made.display());
            Ok(())
        }
        Command::Build { dir, out } => {
            let built = agent_host::cli::project::build(&dir, out.as_deref())?;
            println!("{}", built.display());
            Ok(())
        }
        Command::Test { dir, file, database_url, turn_timeout_ms } => {
            let options = agent_host::cli::agent_test::Options {
                dir: &dir,
                file: file.as_deref(),
                database_url: database_url.as_deref(),
                turn_timeout: std::time::Duration::from_millis(turn_timeout_ms),
            };
            if !agent_host::cli::agent_test::run(options).await? {
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Dev(args) => {
            if !agent_host::cli::dev::run(&args).await? {
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Runs { api, command } => client::runs(&api, command).await,
        Command::Conversations { api, command } => client::conversations(&api, command).await,
        Command::Approvals { api, command } => client::approvals(&api, command).await,
        Command::Schedules { api, command } => client::schedules(&api, command).await,
    }
}

/// A one-shot command whose reader stopped early (`| head`, `| grep -q`) ends
/// by SIGPIPE, quietly, as other Unix tools do: Rust ignores the signal, so
/// without this every `println!` after the reader left would panic. Not for
/// `serve`, whose sockets must see EPIPE as an error, never a signal.
fn end_quietly_on_a_closed_pipe() {
    use nix::sys::signal::{signal, SigHandler, Signal};
    // SAFETY: no handler is installed (the default disposition), so nothing
    // runs in signal context; the disposition is process-wide, set once.
    unsafe { signal(Signal::SIGPIPE, SigHandler::SigDfl) }.expect("SIGPIPE's default disposition");
}
