//! `/metrics` (OpenMetrics text), `/healthz` and `/readyz` for the operator.

mod http;

pub use http::{router, serve, serve_on, OPENMETRICS};

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

/// The labels of one replay: its namespace and name.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplayLabel {
    /// The replay's namespace.
    pub namespace: String,
    /// The replay's name.
    pub name: String,
}

/// The labels of one replay and its phase.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplayPhaseLabel {
    /// The replay's namespace.
    pub namespace: String,
    /// The replay's name.
    pub name: String,
    /// Its phase.
    pub phase: String,
}

/// The labels of one count of one replay.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplayCountLabel {
    /// The replay's namespace.
    pub namespace: String,
    /// The replay's name.
    pub name: String,
    /// The field of `status.counts`: scanned, replayed, duplicates, quarantined, skipped,
    /// failed, returned.
    pub of: String,
}

/// The labels of one canary result of one replay.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplayCanaryLabel {
    /// The replay's namespace.
    pub namespace: String,
    /// The replay's name.
    pub name: String,
    /// Waiting, Passed, Confirmed, DiedAgain or Unconfirmed.
    pub result: String,
}

/// The per-replay series one replay has, so that they can be moved or removed.
#[derive(Clone, Debug, Default)]
struct ReplaySeries {
    phase: Option<String>,
    canary_results: Vec<String>,
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
    /// Per replay (leader only): the Unix time its current phase began, from its status
    /// conditions (see [`crate::controller::status::phase_since`]); one series per replay,
    /// labelled with that phase.
    pub replay_phase_since: Family<ReplayPhaseLabel, Gauge>,
    /// Per replay (leader only): `status.counts`, by field.
    pub replay_messages: Family<ReplayCountLabel, Counter>,
    /// Per replay (leader only): its canaries, by result.
    pub replay_canaries: Family<ReplayCanaryLabel, Gauge>,
    /// Per replay (leader only, when set): `spec.poison.maxQuarantineRatio`.
    pub replay_max_quarantine_ratio: Family<ReplayLabel, Gauge<f64, AtomicU64>>,
    replay_series: Mutex<BTreeMap<(String, String), ReplaySeries>>,
    registry: Registry,
    ready: AtomicBool,
    parts: Mutex<BTreeMap<String, Part>>,
}

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
        let replay_phase_since = Family::<ReplayPhaseLabel, Gauge>::default();
        let replay_messages = Family::<ReplayCountLabel, Counter>::default();
        let replay_canaries = Family::<ReplayCanaryLabel, Gauge>::default();
        let replay_max_quarantine_ratio = Family::<ReplayLabel, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "replay_phase_since_seconds",
            "Per replay: Unix time its current phase (label phase) began, from its status conditions' lastTransitionTime, so an operator restart does not reset it (Draining after a canary, or a status without conditions: when this operator first saw the phase)",
            replay_phase_since.clone(),
        );
        registry.register(
            "replay_messages",
            "Per replay: status.counts by field (scanned, replayed, duplicates, quarantined, skipped, failed, returned)",
            replay_messages.clone(),
        );
        registry.register(
            "replay_canaries",
            "Per replay: canaries by result",
            replay_canaries.clone(),
        );
        registry.register(
            "replay_max_quarantine_ratio",
            "Per replay: spec.poison.maxQuarantineRatio, when set",
            replay_max_quarantine_ratio.clone(),
        );
        Arc::new(Self {
            messages,
            replays,
            leader,
            replay_phase_since,
            replay_messages,
            replay_canaries,
            replay_max_quarantine_ratio,
            replay_series: Mutex::default(),
            publish_latency,
            double_published,
            retries,
            registry,
            ready: AtomicBool::new(false),
            parts: Mutex::default(),
        })
    }

    /// The process-wide metrics (one registry per process, like Prometheus' default one). The
    /// first call also makes them the engine's observer, so the engine's retries, confirm
    /// latencies and double publishes are counted here.
    pub fn global() -> Arc<Self> {
        static GLOBAL: std::sync::OnceLock<Arc<Metrics>> = std::sync::OnceLock::new();
        GLOBAL
            .get_or_init(|| {
                let metrics = Metrics::new();
                crate::engine::observe::install(metrics.clone());
                metrics
            })
            .clone()
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

    /// Show one replay as its status and spec now are in the per-replay series: its phase (with
    /// the time it began, kept while the phase holds), its counts, its canaries
    /// by result and its `maxQuarantineRatio`. Counts that went down (a new replay under the
    /// same name) start their series over.
    pub fn observe_replay(
        &self,
        namespace: &str,
        name: &str,
        status: Option<&crate::api::DlqReplayStatus>,
        max_quarantine_ratio: Option<f64>,
    ) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        self.observe_replay_at(namespace, name, status, max_quarantine_ratio, now);
    }

    fn observe_replay_at(
        &self,
        namespace: &str,
        name: &str,
        status: Option<&crate::api::DlqReplayStatus>,
        max_quarantine_ratio: Option<f64>,
        now: i64,
    ) {
        let default = crate::api::DlqReplayStatus::default();
        let status = status.unwrap_or(&default);
        let (ns, n) = (namespace.to_string(), name.to_string());
        let mut all = self.replay_series.lock().unwrap_or_else(|p| p.into_inner());
        let seen = all.entry((ns.clone(), n.clone())).or_default();
        let phase = status
            .phase
            .unwrap_or(crate::api::Phase::Pending)
            .to_string();
        if seen.phase.as_deref() != Some(phase.as_str()) {
            if let Some(old) = seen.phase.take() {
                self.replay_phase_since.remove(&ReplayPhaseLabel {
                    namespace: ns.clone(),
                    name: n.clone(),
                    phase: old,
                });
            }
            self.replay_phase_since
                .get_or_create(&ReplayPhaseLabel {
                    namespace: ns.clone(),
                    name: n.clone(),
                    phase: phase.clone(),
                })
                .set(crate::controller::status::phase_since(status).map_or(now, |t| t.min(now)));
            seen.phase = Some(phase);
        }
        let c = &status.counts;
        for (of, value) in c.by_field() {
            let label = ReplayCountLabel {
                namespace: ns.clone(),
                name: n.clone(),
                of: of.into(),
            };
            let counter = self.replay_messages.get_or_create(&label);
            let current = counter.get();
            if value >= current {
                counter.inc_by(value - current);
            } else {
                drop(counter);
                self.replay_messages.remove(&label);
                self.replay_messages.get_or_create(&label).inc_by(value);
            }
        }
        let mut by_result: BTreeMap<String, i64> = BTreeMap::new();
        for canary in &status.canary {
            *by_result.entry(format!("{:?}", canary.result)).or_default() += 1;
        }
        for old in &seen.canary_results {
            if !by_result.contains_key(old) {
                self.replay_canaries.remove(&ReplayCanaryLabel {
                    namespace: ns.clone(),
                    name: n.clone(),
                    result: old.clone(),
                });
            }
        }
        for (result, count) in &by_result {
            self.replay_canaries
                .get_or_create(&ReplayCanaryLabel {
                    namespace: ns.clone(),
                    name: n.clone(),
                    result: result.clone(),
                })
                .set(*count);
        }
        seen.canary_results = by_result.into_keys().collect();
        let label = ReplayLabel {
            namespace: ns,
            name: n,
        };
        match max_quarantine_ratio {
            Some(max) => {
                self.replay_max_quarantine_ratio
                    .get_or_create(&label)
                    .set(max);
            }
            None => {
                self.replay_max_quarantine_ratio.remove(&label);
            }
        }
    }

    /// Remove one replay's per-replay series (it was deleted).
    pub fn forget_replay(&self, namespace: &str, name: &str) {
        let mut all = self.replay_series.lock().unwrap_or_else(|p| p.into_inner());
        let Some(seen) = all.remove(&(namespace.to_string(), name.to_string())) else {
            return;
        };
        let (ns, n) = (namespace.to_string(), name.to_string());
        if let Some(phase) = seen.phase {
            self.replay_phase_since.remove(&ReplayPhaseLabel {
                namespace: ns.clone(),
                name: n.clone(),
                phase,
            });
        }
        for (of, _) in crate::api::Counts::default().by_field() {
            self.replay_messages.remove(&ReplayCountLabel {
                namespace: ns.clone(),
                name: n.clone(),
                of: of.into(),
            });
        }
        for result in seen.canary_results {
            self.replay_canaries.remove(&ReplayCanaryLabel {
                namespace: ns.clone(),
                name: n.clone(),
                result,
            });
        }
        self.replay_max_quarantine_ratio.remove(&ReplayLabel {
            namespace: ns,
            name: n,
        });
    }

    /// Remove every per-replay series (this instance stopped leading: the next leader shows
    /// them).
    pub fn forget_replays(&self) {
        let mut all = self.replay_series.lock().unwrap_or_else(|p| p.into_inner());
        all.clear();
        self.replay_phase_since.clear();
        self.replay_messages.clear();
        self.replay_canaries.clear();
        self.replay_max_quarantine_ratio.clear();
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

impl crate::engine::observe::Observer for Metrics {
    fn retried(&self, what: &str) {
        Metrics::retried(self, what);
    }

    fn confirmed(&self, latency: Duration) {
        self.publish_latency.observe(latency.as_secs_f64());
    }

    fn published_twice(&self, keys: u64) {
        self.double_published.inc_by(keys);
    }
}

#[cfg(test)]
mod tests;
