//! `kubectl dlqreplay`: the kubectl plugin (an executable named `kubectl-dlqreplay` on PATH).
//! Everything is in [`dlq_replay::plugin`].

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = dlq_replay::plugin::Plugin::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    runtime.block_on(dlq_replay::plugin::main(cli))
}
