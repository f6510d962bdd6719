use std::process::ExitCode;

use clap::Parser;

#[cfg(feature = "count-allocs")]
mod count_allocs;

/// mimalloc, not glibc's malloc: a drain allocates and frees a few dozen small blocks per
/// message (parsed properties, keys, audit rows), and glibc's allocator took about a quarter
/// of the process's CPU doing it (bench/RESULTS.md, issue 21). With `count-allocs` the
/// counting allocator wraps it instead.
#[cfg(not(feature = "count-allocs"))]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
