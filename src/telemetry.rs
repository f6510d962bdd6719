//! Logging: `tracing` to stderr, filtered by `RUST_LOG` (default `warn` for the CLI).

use tracing_subscriber::EnvFilter;

/// Install the subscriber; `json` for machine-read logs (the operator).
pub fn init(default: &str, json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}
