//! `/metrics` (Prometheus), `/healthz` and `/readyz` for the operator.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
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
            get(|State(m): State<Arc<Metrics>>| async move { m.encode() }),
        )
        .route("/healthz", get(|| async { "ok" }))
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
    axum::serve(listener, router(metrics)).await
}
