//! The `hearth` command line: argument parsing ([`args`]) and launchers ([`launch`]); the
//! management commands ([`manage`]) and benchmarks ([`bench_cmd`]) each in their own module.

mod args;
mod bench_cmd;
mod launch;
mod local_worker;
mod manage;
mod output;

use clap::Parser;
use hearth_engine::fetch::{ensure_model, hearth_home};

use crate::args::{Cli, Command, ModelCommand};

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("HEARTH_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn"));
    // Colours only for a person at a terminal: a log file or pipe gets plain text, and
    // NO_COLOR (https://no-color.org) turns them off everywhere.
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        match cli.command {
            Command::Serve(a) => launch::serve(a).await,
            Command::Worker(a) => launch::worker(a).await,
            Command::Gateway(a) => launch::gateway(a).await,
            Command::Admin(a) => manage::admin(a).await,
            Command::Billing { command } => manage::billing(command).await,
            Command::Processor(a) => manage::processor(a).await,
            Command::Model {
                command: ModelCommand::Fetch { model },
            } => {
                let path = ensure_model(&model, &hearth_home(), &mut |m| eprintln!("{m}"))?;
                println!("{}", path.display());
                Ok(())
            }
            Command::Bench { command } => bench_cmd::run(command).await,
        }
    })
}
