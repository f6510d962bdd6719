use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    dlq_replay::tls::install_provider();
    let cli = dlq_replay::cli::Cli::parse();
    let (filter, json) = cli.logging();
    dlq_replay::telemetry::init(filter, json);
    dlq_replay::cli::main(cli).await
}
