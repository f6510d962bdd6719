//! Logging: `tracing` to stderr, filtered by `RUST_LOG` (default `warn` for the CLI, `info` for
//! the operator), as text or as JSON lines.

use std::io::IsTerminal;

use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

/// Targets kept at `debug` at most, whatever `RUST_LOG` says: at `trace` lapin logs every frame
/// it writes, the connection's `StartOk` with the SASL PLAIN response (user and password, as
/// bytes) included.
const NEVER_TRACE: [&str; 2] = ["lapin::io_loop", "lapin::frames"];

/// Install the subscriber; `json` for machine-read logs (the operator's `--log-format json`: one
/// JSON object per line). Text has ANSI colours only on a terminal, and never with `NO_COLOR`
/// set: a log collector reading a pipe gets plain text.
pub fn init(default: &str, json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let cap = NEVER_TRACE.iter().fold(
        Targets::new().with_default(LevelFilter::TRACE),
        |t, target| t.with_target(*target, LevelFilter::DEBUG),
    );
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(!json && colour(std::io::stderr().is_terminal()));
    let _ = if json {
        builder.json().finish().with(cap).try_init()
    } else {
        builder.finish().with(cap).try_init()
    };
}

/// Whether text logs may be coloured: on a terminal, unless `NO_COLOR` is set (no-color.org).
fn colour(terminal: bool) -> bool {
    terminal && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

#[cfg(test)]
mod tests {
    #[test]
    fn no_colour_off_a_terminal() {
        assert!(!super::colour(false));
    }
}
