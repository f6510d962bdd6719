use std::process::ExitCode;

use clap::Parser;

#[cfg(feature = "count-allocs")]
mod count_allocs;

fn main() -> ExitCode {
    dlq_replay::tls::install_provider();
    let cli = dlq_replay::cli::Cli::parse();
    let (filter, json) = cli.logging();
    dlq_replay::telemetry::init(filter, json);
    let runtime = match cli.runtime() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(dlq_replay::cli::main(cli));
    #[cfg(feature = "count-allocs")]
    count_allocs::report();
    code
}
