//! The redis section: a replay's footprint in Redis, by key kind.

use std::time::Duration;

use dlq_replay::engine::store;
use dlq_replay::engine::store::Redis;

use crate::broker::Section;
use crate::replay::Extras;
use crate::setup::Bench;
use crate::NAMESPACE;

/// How many idempotency keys the redis section weighs with MEMORY USAGE per sample: tens of
/// thousands of claims, each one call, would make the sampling itself the load on Redis.
pub(crate) const CLAIM_SAMPLE: usize = 2000;
/// The pause between two samples of a replay's Redis keys (each takes its own time on top).
pub(crate) const REDIS_SAMPLE_EVERY: Duration = Duration::from_millis(300);

/// A replay's footprint in Redis, by key kind: Check and Claim with the audit in Redis, Check
/// with the audit sent to the log.
pub(crate) async fn redis_section(b: &mut Bench, n: usize) {
    let server = redis_info(&mut b.redis, "server").await;
    let policy: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(&mut b.redis)
        .await
        .unwrap_or_default();
    println!(
        "\n== redis footprint (classic DLQ, RabbitMQ 3.10; N = {n}, 10 % duplicates whose keys the bench marked done beforehand (not counted); canary off; Redis {}, maxmemory-policy {})",
        info_field(&server, "redis_version").unwrap_or("?"),
        policy.get(1).map(String::as_str).unwrap_or("?")
    );
    println!("  B/msg = bytes / replayed messages. Per kind: MEMORY USAGE <key> SAMPLES 0 of the replay's keys (audit: dlq:audit:{NAMESPACE}/<name>/*; settled: dlq:settled:{NAMESPACE}/<name>/*; state: dlq:replay:{NAMESPACE}/<name>; claims: the idempotency keys holding a claim, not the done marks; ledger and routes: dlq:moves:*, dlq:routes:* of the DLQ); used_memory: INFO memory, minus its value just before the replay started. Peak: the largest figure over samples every ~{} ms (plus the sample's own time) while the replay runs and the one after it ends; total's peak is the largest sum within one sample. After Done: once the process exited.", REDIS_SAMPLE_EVERY.as_millis());
    let base = Section::classic_3_10();
    for (label, scenario, mode, audit_log) in [
        ("Check, audit in Redis", "redischeck", "Check", false),
        ("Claim, audit in Redis", "redisclaim", "Claim", false),
        ("Check, audit to the log", "redislog", "Check", true),
    ] {
        let extras = Extras {
            audit_log,
            footprint: true,
            ..Default::default()
        };
        // Before building a DLQ for it: a binary older than `spec.audit.sink` refuses it.
        if audit_log {
            if let Err(why) = b.accepts(&base, scenario, mode, extras).await {
                println!("{label}: not supported by this binary ({why})");
                continue;
            }
        }
        let (run, _) = b.replay(&base, scenario, n, mode, extras).await;
        match &run.footprint {
            Some(f) => print_footprint(label, f),
            None => println!("{label}: no Redis figures (see PROBLEMS)"),
        }
    }
}

/// One row of the redis section: its table of bytes per replayed message.
pub(crate) fn print_footprint(label: &str, f: &Footprint) {
    let (peak, after) = (&f.sampled.peak, &f.after);
    // Per message of the DLQ too (duplicates included: they have audit rows and settled
    // marks of their own), to compare with figures taken on a DLQ without duplicates.
    println!(
        "{label}: replayed {}, duplicates {}; {} samples; after Done {:.1} MiB in the replay's keys ({:.0} B per DLQ message), used_memory {:+.1} MiB",
        f.replayed,
        f.duplicates,
        f.sampled.samples,
        after.total() / 1048576.0,
        after.total() / (f.replayed + f.duplicates).max(1) as f64,
        (after.used_memory - f.before) / 1048576.0
    );
    let per = |bytes: f64| bytes / f.replayed.max(1) as f64;
    println!(
        "  {:<14} {:>11} {:>17} {:>15}",
        "kind", "peak B/msg", "after Done B/msg", "after Done B"
    );
    let estimated = peak.claims_estimated || after.claims_estimated;
    let claims = if estimated { "claims (est.)" } else { "claims" };
    let mut rows = vec![
        ("audit", peak.audit, after.audit),
        ("settled", peak.settled, after.settled),
        ("state", peak.state, after.state),
        (claims, peak.claims, after.claims),
        ("ledger", peak.ledger, after.ledger),
        ("routes", peak.routes, after.routes),
    ];
    // Keys under the run's names that are none of the kinds: none expected, shown if any.
    if peak.other > 0.0 {
        rows.push(("other", peak.other, after.other));
    }
    rows.push(("total", f.sampled.peak_total, after.total()));
    rows.push((
        "used_memory",
        peak.used_memory - f.before,
        after.used_memory - f.before,
    ));
    for (kind, p, a) in rows {
        println!("  {kind:<14} {:>11.1} {:>17.1} {a:>15.0}", per(p), per(a));
    }
    if estimated {
        println!("  claims (est.): MEMORY USAGE of a random sample of {CLAIM_SAMPLE} of the keys under the idempotency prefix (done marks included, counting for nothing), times their count over {CLAIM_SAMPLE}");
    }
}

/// The names of a replay's keys in Redis, by kind (`ns` being NAMESPACE and `name` the
/// replay's, as `Replay::state_name()` makes it for the CLI: metadata.name).
#[derive(Debug, Clone)]
pub(crate) struct ReplayKeys {
    /// What all of them contain: the replay's name, which its queues' names and its
    /// idempotency prefix start with too.
    pub(crate) name: String,
    /// `dlq:replay:<ns>/<name>`, a hash.
    pub(crate) state: String,
    /// `dlq:audit:<ns>/<name>/`: its streams (and anything the stream keeps beside it) start so.
    pub(crate) audit: String,
    /// `dlq:settled:<ns>/<name>/`, a hash per replay id.
    pub(crate) settled: String,
    /// The idempotency prefix: the claims and the done marks, `<prefix><32 hex>`.
    pub(crate) idem: String,
    /// The ledger (`dlq:moves:<broker>/<queue>`) and the routes (`dlq:routes:...`) of the DLQ
    /// end with `/<dlq>`.
    pub(crate) dlq_suffix: String,
}

impl ReplayKeys {
    pub(crate) fn new(name: &str, idem: &str, dlq: &str) -> Self {
        ReplayKeys {
            name: name.into(),
            state: store::Keys::state_of(store::Layout::Flat, NAMESPACE, name),
            audit: store::Keys::audit_of(store::Layout::Flat, NAMESPACE, name, ""),
            settled: format!("dlq:settled:{NAMESPACE}/{name}/"),
            idem: idem.into(),
            dlq_suffix: format!("/{dlq}"),
        }
    }

    /// An idempotency key, `<prefix><32 hex>`: a claim or a done mark.
    pub(crate) fn is_idem(&self, key: &str) -> bool {
        key.strip_prefix(&self.idem)
            .is_some_and(|h| h.len() == 32 && h.bytes().all(|c| c.is_ascii_hexdigit()))
    }
}

/// A replay's keys in Redis at one moment, in bytes by kind, with Redis's used_memory.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RedisBytes {
    pub(crate) audit: f64,
    pub(crate) settled: f64,
    pub(crate) state: f64,
    pub(crate) claims: f64,
    pub(crate) ledger: f64,
    pub(crate) routes: f64,
    /// Keys with the replay's name in them that are none of the above.
    pub(crate) other: f64,
    /// `INFO memory` used_memory.
    pub(crate) used_memory: f64,
    /// The claims were weighed on a sample (more idempotency keys than CLAIM_SAMPLE) that
    /// held some.
    pub(crate) claims_estimated: bool,
}

impl RedisBytes {
    /// The figure a key of the replay other than an idempotency key counts in.
    pub(crate) fn kind(&mut self, k: &ReplayKeys, key: &str) -> &mut f64 {
        if key == k.state {
            &mut self.state
        } else if key.starts_with(&k.audit) {
            &mut self.audit
        } else if key.starts_with(&k.settled) {
            &mut self.settled
        } else if key.starts_with("dlq:moves:") && key.ends_with(&k.dlq_suffix) {
            &mut self.ledger
        } else if key.starts_with("dlq:routes:") && key.ends_with(&k.dlq_suffix) {
            &mut self.routes
        } else {
            &mut self.other
        }
    }

    pub(crate) fn total(&self) -> f64 {
        self.audit
            + self.settled
            + self.state
            + self.claims
            + self.ledger
            + self.routes
            + self.other
    }
}

/// The samples of one replay: each figure's largest.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Sampled {
    /// Per kind and for used_memory, the largest of any sample.
    pub(crate) peak: RedisBytes,
    /// The largest total of one sample (the kinds peak at different moments).
    pub(crate) peak_total: f64,
    pub(crate) samples: usize,
}

impl Sampled {
    pub(crate) fn add(&mut self, b: &RedisBytes) {
        let p = &mut self.peak;
        for (peak, v) in [
            (&mut p.audit, b.audit),
            (&mut p.settled, b.settled),
            (&mut p.state, b.state),
            (&mut p.claims, b.claims),
            (&mut p.ledger, b.ledger),
            (&mut p.routes, b.routes),
            (&mut p.other, b.other),
            (&mut p.used_memory, b.used_memory),
        ] {
            *peak = peak.max(v);
        }
        p.claims_estimated |= b.claims_estimated;
        self.peak_total = self.peak_total.max(b.total());
        self.samples += 1;
    }
}

/// What the redis section measured of one replay.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Footprint {
    pub(crate) replayed: u64,
    pub(crate) duplicates: u64,
    /// used_memory just before the replay started.
    pub(crate) before: f64,
    /// While it ran, and the sample after it ended.
    pub(crate) sampled: Sampled,
    /// Once the process exited, `Done`.
    pub(crate) after: RedisBytes,
}

/// Sample the replay's keys until `stop`; the largest figures seen.
pub(crate) async fn sample_redis(
    mut con: Redis,
    keys: ReplayKeys,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> Sampled {
    let mut sampled = Sampled::default();
    loop {
        sampled.add(&redis_bytes(&mut con, &keys).await);
        tokio::select! {
            _ = tokio::time::sleep(REDIS_SAMPLE_EVERY) => {}
            _ = &mut stop => return sampled,
        }
    }
}

/// The replay's keys now, by kind.
pub(crate) async fn redis_bytes(con: &mut Redis, k: &ReplayKeys) -> RedisBytes {
    // First, so that the replies to this sample's own SCAN are not in it.
    let used_memory = used_memory(&redis_info(con, "memory").await);
    let mut b = RedisBytes {
        used_memory,
        ..Default::default()
    };
    // One pass over the keyspace: every key of the replay has its name in it.
    let (idem_keys, exact): (Vec<String>, Vec<String>) = scan(con, &format!("*{}*", k.name))
        .await
        .into_iter()
        .partition(|key| k.is_idem(key));
    // None yet, before the replay wrote its first (an empty pipeline is an error).
    if !exact.is_empty() {
        let mut p = redis::pipe();
        for key in &exact {
            p.cmd("MEMORY").arg("USAGE").arg(key).arg("SAMPLES").arg(0);
        }
        // A key gone since the SCAN (an expiry, the end of the replay) weighs nothing.
        let sizes: Vec<Option<u64>> = p.query_async(con).await.expect("MEMORY USAGE");
        for (key, size) in exact.iter().zip(sizes) {
            *b.kind(k, key) += size.unwrap_or(0) as f64;
        }
    }
    // The claims: the idempotency keys whose value is a replay's claim (the done marks the
    // bench set are the workers', not the replay's), weighed on a random sample.
    let sample: Vec<&String> = if idem_keys.len() <= CLAIM_SAMPLE {
        idem_keys.iter().collect()
    } else {
        rand::seq::index::sample(&mut rand::rng(), idem_keys.len(), CLAIM_SAMPLE)
            .into_iter()
            .map(|i| &idem_keys[i])
            .collect()
    };
    if !sample.is_empty() {
        let mut p = redis::pipe();
        for key in &sample {
            p.cmd("GET").arg(*key);
            p.cmd("MEMORY").arg("USAGE").arg(*key).arg("SAMPLES").arg(0);
        }
        let answers: Vec<(Option<String>, Option<u64>)> =
            p.query_async(con).await.expect("GET, MEMORY USAGE");
        let claims: f64 = answers
            .iter()
            .filter(|(value, _)| {
                matches!(
                    store::Held::of(value.as_deref(), "done"),
                    store::Held::Published(_) | store::Held::Unconfirmed(_)
                )
            })
            .map(|(_, size)| size.unwrap_or(0) as f64)
            // Not sum(): that of no claims is -0.0.
            .fold(0.0, |all, size| all + size);
        b.claims = claims * idem_keys.len() as f64 / sample.len() as f64;
        // No claim in the sample (Check mode: only done marks) says none, not an estimate.
        b.claims_estimated = sample.len() < idem_keys.len() && claims > 0.0;
    }
    b
}

/// Every key matching `pattern`.
pub(crate) async fn scan(con: &mut Redis, pattern: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(5000)
            .query_async(con)
            .await
            .expect("SCAN");
        out.extend(keys);
        if next == 0 {
            return out;
        }
        cursor = next;
    }
}

/// `INFO <section>` of Redis (empty if it fails).
pub(crate) async fn redis_info(con: &mut Redis, section: &str) -> String {
    redis::cmd("INFO")
        .arg(section)
        .query_async(con)
        .await
        .unwrap_or_default()
}

/// A field's value in an `INFO` reply.
pub(crate) fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}

pub(crate) fn used_memory(info: &str) -> f64 {
    info_field(info, "used_memory")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// used_memory once Redis has freed what UNLINK left to its background thread (the keys of
/// the runs before), so that it does not count against the next.
pub(crate) async fn used_memory_settled(con: &mut Redis) -> f64 {
    for _ in 0..100 {
        let info = redis_info(con, "memory").await;
        if info_field(&info, "lazyfree_pending_objects") == Some("0") {
            return used_memory(&info);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    used_memory(&redis_info(con, "memory").await)
}
