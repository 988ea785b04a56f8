use anyhow::Context;
use clap::Parser;
use tracing_subscriber::EnvFilter;

use agent_host::client;
use agent_host::config::{Cli, Command, PluginsCommand, TokensCommand};
use agent_host::{bench, db, server};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // The benchmark's own runs would drown its figures in per-run lines.
    let default_level = if matches!(cli.command, Command::Bench(_)) { "warn" } else { "info" };
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_env("AGENT_HOST_LOG").unwrap_or_else(|_| EnvFilter::new(default_level)))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match cli.command {
        Command::Serve(args) => server::serve(&cli.db, &args).await,
        Command::Migrate => {
            server::with_pool(&cli.db, |_| async {
                println!("migrations applied ({} in all)", db::MIGRATOR.iter().count());
                Ok(())
            })
            .await
        }
        Command::Tokens(TokensCommand::Create { user, tenant, admin }) => {
            server::with_pool(&cli.db, |pool| async move {
                let token = db::tokens::create(&pool, &user, &tenant, admin).await.context("creating the token")?;
                println!("{token}");
                Ok(())
            })
            .await
        }
        Command::Bench(args) => bench::run(&cli.db, &args).await,
        Command::Plugins(PluginsCommand::Add { name, file, manifest }) => {
            server::plugins_add(&cli.db, &name, &file, manifest.as_deref()).await
        }
        Command::Plugins(PluginsCommand::List) => server::plugins_list(&cli.db).await,
        Command::Runs { api, command } => client::runs(&api, command).await,
        Command::Conversations { api, command } => client::conversations(&api, command).await,
    }
}
