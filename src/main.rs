use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    dlq_replay::tls::install_provider();
    dlq_replay::telemetry::init("warn,lapin::channel=off", false);
    dlq_replay::cli::main(dlq_replay::cli::Cli::parse()).await
}
