//! Logging: `tracing` to stderr, filtered by `RUST_LOG` (default `warn` for the CLI).

use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

/// Targets kept at `debug` at most, whatever `RUST_LOG` says: at `trace` lapin logs every frame
/// it writes, the connection's `StartOk` with the SASL PLAIN response (user and password, as
/// bytes) included.
const NEVER_TRACE: [&str; 2] = ["lapin::io_loop", "lapin::frames"];

/// Install the subscriber; `json` for machine-read logs (the operator).
pub fn init(default: &str, json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let cap = NEVER_TRACE.iter().fold(
        Targets::new().with_default(LevelFilter::TRACE),
        |t, target| t.with_target(*target, LevelFilter::DEBUG),
    );
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if json {
        builder.json().finish().with(cap).try_init()
    } else {
        builder.finish().with(cap).try_init()
    };
}
