//! Redis: the idempotency gate (check / claim), the replay's own state, and the audit stream.
//!
//! Each batch costs two round trips: one pipeline that asks about every key of the batch, and one
//! script that writes the audit rows, the "settled" marks and the counts together (atomically,
//! once), so the counts and the audit trail can never disagree, even across a crash or a retry.
//!
//! By stage: `lookup` (the gate's round trip), `commit` (a batch's outcome), `held` (what a
//! key's value means), `audit` (the trail), `retry` (lost answers), `retain` (expiry), `room`
//! (the pre-flight on eviction).

mod audit;
mod commit;
mod conn;
mod held;
mod lookup;
mod retain;
mod retry;
mod room;

use std::collections::HashMap;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::spec::AuditSink;
use crate::status::Counts;
use crate::Error;

pub use audit::{read_audit, rows_of_log, AuditRow, Decision};
pub use commit::ClaimEnd;
pub use conn::{connect, Layout, Redis};
pub use held::{claim_value, confirmed_claim, Held};
pub use lookup::{key_field, Lookup};
pub use retain::{reopen, retain, retention};
use retry::Retries;
pub use room::{expected_bytes, human_bytes, Room};

/// The replay's durable state, as stored under its state key.
#[derive(Debug, Clone, Default)]
pub struct State {
    /// The replay id (created on the first run, kept by every later one).
    pub replay_id: String,
    /// How many times this replay has been started (1 on the first run).
    pub attempt: u64,
    /// The source depth when the replay first started.
    pub depth_at_start: u64,
    /// When the replay first started (RFC 3339).
    pub started_at: String,
    /// Counts so far.
    pub counts: Counts,
    /// Audit rows so far.
    pub records: u64,
    /// The final status (JSON) once the replay reached a final phase.
    pub final_status: Option<String>,
    /// The canary results (JSON) once the canary phase decided.
    pub canary: Option<String>,
}

const AUDIT_PREFIX: &str = "dlq:audit:";

/// Redis keys of one replay.
#[derive(Debug, Clone)]
pub struct Keys {
    /// The state hash.
    pub state: String,
    /// The audit stream (set once the replay id is known).
    pub audit: String,
    /// The hash of settled messages: field = idempotency key or message identity. Only a
    /// resume needs it: it is removed when the replay ends `Done`.
    pub settled: String,
    /// The audit stream's dictionary (the key prefix, destinations and signatures its rows
    /// number; see `audit`).
    pub dict: String,
}

impl Keys {
    /// The state key of a replay named `namespace/name`.
    pub fn state_of(layout: Layout, namespace: &str, name: &str) -> String {
        format!("dlq:replay:{}", tag(layout, namespace, name))
    }

    /// The audit stream key of run `replay_id` of a replay named `namespace/name`.
    pub fn audit_of(layout: Layout, namespace: &str, name: &str, replay_id: &str) -> String {
        format!("{AUDIT_PREFIX}{}/{replay_id}", tag(layout, namespace, name))
    }

    /// The dictionary of the audit stream `key`.
    pub fn dict_of_audit(key: &str) -> String {
        format!("{key}#dict")
    }

    /// The namespace and name in an audit stream key (the inverse of [`Keys::audit_of`], in
    /// either layout).
    pub fn names_of_audit(key: &str) -> Option<(String, String)> {
        let rest = key.strip_prefix(AUDIT_PREFIX)?;
        let (ns, name, id) = match rest.strip_prefix('{') {
            Some(tagged) => {
                let (names, id) = tagged.split_once('}')?;
                let (ns, name) = names.split_once('/')?;
                (ns, name, id.strip_prefix('/')?)
            }
            None => {
                let mut parts = rest.splitn(3, '/');
                (parts.next()?, parts.next()?, parts.next()?)
            }
        };
        (!ns.is_empty() && !name.is_empty() && !id.is_empty()).then(|| (ns.into(), name.into()))
    }

    fn new(layout: Layout, namespace: &str, name: &str, replay_id: &str) -> Self {
        let audit = Self::audit_of(layout, namespace, name, replay_id);
        Self {
            state: Self::state_of(layout, namespace, name),
            dict: Self::dict_of_audit(&audit),
            audit,
            settled: format!("dlq:settled:{}/{replay_id}", tag(layout, namespace, name)),
        }
    }

    /// Every key of the replay, for their expiry.
    pub fn all(&self) -> [&str; 4] {
        [&self.state, &self.settled, &self.audit, &self.dict]
    }
}

/// A replay's `namespace/name` as its keys hold it: in a Cluster as a `{hash tag}`, so that every
/// key of the replay is in one slot (its commit script touches four of them).
fn tag(layout: Layout, namespace: &str, name: &str) -> String {
    match layout {
        Layout::Flat => format!("{namespace}/{name}"),
        Layout::Tagged => format!("{{{namespace}/{name}}}"),
    }
}

/// A Redis connection for one replay (a clone shares the connection: its calls are pipelined
/// with the original's, in the order they are made).
#[derive(Clone)]
pub struct Store {
    con: Redis,
    keys: Keys,
    retry_for: Duration,
    /// Where a wait for Redis is said (the replay's status message), if anywhere.
    waits: Option<crate::Progress>,
    /// The replay's stop: it ends a wait between retries (see [`Store::stop_on`]).
    stop: Option<CancellationToken>,
    /// Where the audit rows go.
    sink: AuditSink,
    /// How rows become stream entries (shared by the clones).
    encoder: audit::Encoder,
    /// The replay's namespace and name, as log rows say them.
    names: (String, String),
}

/// How a replay's audit rows are written: `spec.audit.sink` and `spec.idempotency.key.prefix`.
#[derive(Debug, Clone, Default)]
pub struct AuditConfig {
    /// Where the rows go.
    pub sink: AuditSink,
    /// The prefix every idempotency key of the replay starts with (rows keep the rest).
    pub key_prefix: String,
}

impl Store {
    /// Load the state of `namespace/name`, creating it (with a new replay id) on the first run,
    /// and count this start as one more attempt.
    pub async fn begin(
        mut con: Redis,
        namespace: &str,
        name: &str,
        depth_now: u64,
        now: &str,
        audit: &AuditConfig,
    ) -> Result<(Self, State), Error> {
        let state_key = Keys::state_of(con.layout(), namespace, name);
        let fresh_id = uuid::Uuid::new_v4().simple().to_string();
        let mut p = redis::pipe();
        p.atomic()
            .cmd("HSETNX")
            .arg(&state_key)
            .arg("id")
            .arg(&fresh_id)
            .ignore()
            .cmd("HSETNX")
            .arg(&state_key)
            .arg("depthAtStart")
            .arg(depth_now)
            .ignore()
            .cmd("HSETNX")
            .arg(&state_key)
            .arg("startedAt")
            .arg(now)
            .ignore()
            .cmd("HINCRBY")
            .arg(&state_key)
            .arg("attempt")
            .arg(1)
            .ignore()
            .cmd("HGETALL")
            .arg(&state_key);
        let (map,): (HashMap<String, String>,) = p.query_async(&mut con).await?;
        let mut state = parse_state(&map);
        let keys = Keys::new(con.layout(), namespace, name, &state.replay_id);
        let (len, dict): (u64, HashMap<String, String>) = redis::pipe()
            .cmd("XLEN")
            .arg(&keys.audit)
            .cmd("HGETALL")
            .arg(&keys.dict)
            .query_async(&mut con)
            .await?;
        // Rows sent to the log are counted in the state; a stream counts itself.
        state.records = len.max(state.records);
        Ok((
            Self {
                con,
                keys,
                retry_for: Duration::ZERO,
                waits: None,
                stop: None,
                sink: audit.sink,
                encoder: audit::Encoder::new(&audit.key_prefix, dict),
                names: (namespace.to_string(), name.to_string()),
            },
            state,
        ))
    }

    /// Read the stored state without starting an attempt (`None` if the replay never ran).
    pub async fn peek(mut con: Redis, namespace: &str, name: &str) -> Result<Option<State>, Error> {
        let map: HashMap<String, String> = redis::cmd("HGETALL")
            .arg(Keys::state_of(con.layout(), namespace, name))
            .query_async(&mut con)
            .await?;
        Ok((!map.is_empty()).then(|| parse_state(&map)))
    }

    /// The replay's keys.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// A handle on the same Redis.
    pub fn redis(&self) -> Redis {
        self.con.clone()
    }

    /// Record the canary results, so a resumed replay does not send canaries again.
    pub async fn save_canary(&mut self, json: &str) -> Result<(), Error> {
        redis::cmd("HSET")
            .arg(&self.keys.state)
            .arg("canary")
            .arg(json)
            .query_async::<()>(&mut self.con)
            .await?;
        Ok(())
    }

    /// Record the final status; a later run of the same replay reports it and replays nothing.
    /// A replay that ended `Done` needs its settled marks no more (they serve a resume, and it
    /// will not resume): they go with the same transaction, so the replay's footprint in the
    /// workers' Redis after its end is its audit trail and its state.
    pub async fn finish(&mut self, status_json: &str, done: bool) -> Result<(), Error> {
        let mut p = redis::pipe();
        p.atomic()
            .cmd("HSET")
            .arg(&self.keys.state)
            .arg("final")
            .arg(status_json)
            .ignore();
        if done {
            p.cmd("DEL").arg(&self.keys.settled).ignore();
        }
        p.query_async::<()>(&mut self.con).await?;
        Ok(())
    }
}

fn parse_state(map: &HashMap<String, String>) -> State {
    let n = |k: &str| map.get(k).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    State {
        replay_id: map.get("id").cloned().unwrap_or_default(),
        attempt: n("attempt"),
        depth_at_start: n("depthAtStart"),
        started_at: map.get("startedAt").cloned().unwrap_or_default(),
        counts: Counts::from_fields(|name| n(&commit::count_field(name))),
        records: n("records"),
        final_status: map.get("final").cloned(),
        canary: map.get("canary").cloned(),
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! A store of its own for a unit test, and its cleanup.
    use super::*;

    pub(crate) async fn store(name: &str) -> Store {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
        let con = connect(&url).await.expect("redis");
        let ns = format!("unit-{}", uuid::Uuid::new_v4().simple());
        let audit = AuditConfig {
            sink: AuditSink::Redis,
            key_prefix: "idem:".into(),
        };
        Store::begin(con, &ns, name, 0, "now", &audit)
            .await
            .expect("begin")
            .0
    }

    pub(crate) async fn cleanup(s: &mut Store, extra: &[&str]) {
        let k = s.keys().clone();
        let mut cmd = redis::cmd("DEL");
        cmd.arg(k.all().as_slice()).arg(extra);
        cmd.query_async::<()>(&mut s.con).await.expect("del");
    }

    pub(crate) fn row(message: &str) -> AuditRow {
        AuditRow {
            message: message.into(),
            decision: "replayed".into(),
            ..Default::default()
        }
    }
}
