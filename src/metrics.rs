//! `/metrics` (OpenMetrics text), `/healthz` and `/readyz` for the operator.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::routing::get;
use axum::Router;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// A label of one decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabel {
    /// replayed, duplicate, quarantined, skipped, failed.
    pub decision: String,
}

/// A label of one phase.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabel {
    /// The phase.
    pub phase: String,
}

/// A label of one kind of retry.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RetryLabel {
    /// reconnect (a new pass after a lost connection), redis_lookup or redis_commit (a Redis
    /// call whose answer was lost, asked again with the batch held).
    pub of: String,
}

/// The operator's metrics.
pub struct Metrics {
    /// Messages by decision.
    pub messages: Family<DecisionLabel, Counter>,
    /// Replays by phase (as last seen by this operator).
    pub replays: Family<PhaseLabel, Gauge>,
    /// Seconds from the end of a batch's publishes to each confirm.
    pub publish_latency: Histogram,
    /// Keys published twice in Claim mode; must stay 0.
    pub double_published: Counter,
    /// Retries after a lost connection or a lost Redis answer, by kind.
    pub retries: Family<RetryLabel, Counter>,
    /// Whether this instance leads (drives replays).
    pub leader: Gauge,
    registry: Registry,
    ready: AtomicBool,
    parts: Mutex<BTreeMap<String, Part>>,
}

/// The content type of `/metrics`: what `prometheus_client`'s text encoder writes (OpenMetrics
/// 1.0, ending in `# EOF`), so that Prometheus parses it as such.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// One long-running part of the operator (the controller, the lease loop), for `/healthz`.
#[derive(Clone, Debug)]
struct Part {
    /// When it last said it was alive.
    beat: Instant,
    /// Dead when it has not said so for this long (`None`: it only ever says it died).
    stale_after: Option<Duration>,
    /// Why it ended, when it ended without being asked to.
    died: Option<String>,
}

impl Metrics {
    /// A registry with every metric.
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::with_prefix("dlq_replay");
        let messages = Family::<DecisionLabel, Counter>::default();
        let replays = Family::<PhaseLabel, Gauge>::default();
        let leader = Gauge::default();
        let publish_latency = Histogram::new(exponential_buckets(0.0005, 2.0, 14));
        let double_published = Counter::default();
        let retries = Family::<RetryLabel, Counter>::default();
        registry.register(
            "retries",
            "Reconnects and Redis calls asked again after a lost answer",
            retries.clone(),
        );
        registry.register(
            "publish_latency_seconds",
            "Publish to broker confirm",
            publish_latency.clone(),
        );
        registry.register(
            "double_published",
            "Keys published twice in Claim mode (must stay 0)",
            double_published.clone(),
        );
        registry.register("messages", "Messages by decision", messages.clone());
        registry.register("replays", "Replays by phase", replays.clone());
        registry.register(
            "leader",
            "1 when this instance drives replays",
            leader.clone(),
        );
        Arc::new(Self {
            messages,
            replays,
            leader,
            publish_latency,
            double_published,
            retries,
            registry,
            ready: AtomicBool::new(false),
            parts: Mutex::default(),
        })
    }

    /// The process-wide metrics (one registry per process, like Prometheus' default one).
    pub fn global() -> Arc<Self> {
        static GLOBAL: std::sync::OnceLock<Arc<Metrics>> = std::sync::OnceLock::new();
        GLOBAL.get_or_init(Metrics::new).clone()
    }

    /// Count one retry of kind `of` (see [`RetryLabel`]).
    pub fn retried(&self, of: &str) {
        self.retries
            .get_or_create(&RetryLabel { of: of.into() })
            .inc();
    }

    /// Count the decisions between two count snapshots.
    pub fn count(&self, before: &crate::api::Counts, after: &crate::api::Counts) {
        let pairs = [
            ("replayed", before.replayed, after.replayed),
            ("duplicate", before.duplicates, after.duplicates),
            ("quarantined", before.quarantined, after.quarantined),
            ("skipped", before.skipped, after.skipped),
            ("failed", before.failed, after.failed),
        ];
        for (decision, b, a) in pairs {
            if a > b {
                self.messages
                    .get_or_create(&DecisionLabel {
                        decision: decision.into(),
                    })
                    .inc_by(a - b);
            }
        }
    }

    /// Move one replay from one phase to another in the phase gauge.
    pub fn phase_change(&self, from: Option<crate::api::Phase>, to: Option<crate::api::Phase>) {
        if from == to {
            return;
        }
        if let Some(f) = from {
            self.replays
                .get_or_create(&PhaseLabel {
                    phase: f.to_string(),
                })
                .dec();
        }
        if let Some(t) = to {
            self.replays
                .get_or_create(&PhaseLabel {
                    phase: t.to_string(),
                })
                .inc();
        }
    }

    /// Mark the operator ready (its watch is up).
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    /// `part` is alive now; it counts as dead once it has not said so for `stale_after`
    /// (`None`: only [`Metrics::died`] makes it dead).
    pub fn alive(&self, part: &str, stale_after: Option<Duration>) {
        let mut parts = self.parts.lock().unwrap_or_else(|p| p.into_inner());
        parts.insert(
            part.into(),
            Part {
                beat: Instant::now(),
                stale_after,
                died: None,
            },
        );
    }

    /// `part` ended without being asked to: `/healthz` fails from now on.
    pub fn died(&self, part: &str, why: &str) {
        let mut parts = self.parts.lock().unwrap_or_else(|p| p.into_inner());
        let entry = parts.entry(part.into()).or_insert(Part {
            beat: Instant::now(),
            stale_after: None,
            died: None,
        });
        entry.died = Some(why.into());
    }

    /// `part` stopped because it was asked to (a shutdown): no longer watched.
    pub fn stopped(&self, part: &str) {
        let mut parts = self.parts.lock().unwrap_or_else(|p| p.into_inner());
        parts.remove(part);
    }

    /// `Ok` while every watched part is alive, else what died or stalled.
    pub fn health(&self) -> Result<(), String> {
        let parts = self.parts.lock().unwrap_or_else(|p| p.into_inner());
        let bad: Vec<String> = parts
            .iter()
            .filter_map(|(name, p)| match (&p.died, p.stale_after) {
                (Some(why), _) => Some(format!("{name} died: {why}")),
                (None, Some(max)) if p.beat.elapsed() > max => Some(format!(
                    "{name} stalled: not alive for {}s",
                    p.beat.elapsed().as_secs()
                )),
                _ => None,
            })
            .collect();
        if bad.is_empty() {
            Ok(())
        } else {
            Err(bad.join("; "))
        }
    }

    fn encode(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// The HTTP routes.
pub fn router(metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|State(m): State<Arc<Metrics>>| async move {
                ([(header::CONTENT_TYPE, OPENMETRICS)], m.encode())
            }),
        )
        .route(
            "/healthz",
            get(|State(m): State<Arc<Metrics>>| async move {
                match m.health() {
                    Ok(()) => (StatusCode::OK, "ok".to_string()),
                    Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
                }
            }),
        )
        .route(
            "/readyz",
            get(|State(m): State<Arc<Metrics>>| async move {
                if m.ready.load(Ordering::Relaxed) {
                    (StatusCode::OK, "ready")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not ready")
                }
            }),
        )
        .with_state(metrics)
}

/// Serve the routes on `addr` until the process ends.
pub async fn serve(addr: std::net::SocketAddr, metrics: Arc<Metrics>) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    serve_on(listener, metrics).await
}

/// Serve the routes on a bound listener until the process ends.
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
) -> std::io::Result<()> {
    axum::serve(listener, router(metrics)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_fails_when_a_part_died_or_stalled_and_not_after_a_clean_stop() {
        let m = Metrics::new();
        assert!(m.health().is_ok());
        m.alive("controller", None);
        m.alive("lease", Some(Duration::from_secs(60)));
        assert!(m.health().is_ok());
        m.died("controller", "it panicked");
        assert_eq!(
            m.health().unwrap_err(),
            "controller died: it panicked".to_string()
        );
        m.stopped("controller");
        assert!(m.health().is_ok());
        m.alive("lease", Some(Duration::ZERO));
        std::thread::sleep(Duration::from_millis(5));
        assert!(m.health().unwrap_err().starts_with("lease stalled"));
    }

    #[test]
    fn the_text_is_openmetrics() {
        let m = Metrics::new();
        m.leader.set(1);
        let text = m.encode();
        assert!(text.contains("dlq_replay_leader 1"), "{text}");
        assert!(text.trim_end().ends_with("# EOF"), "{text}");
        assert!(OPENMETRICS.starts_with("application/openmetrics-text; version=1.0.0"));
    }
}
