//! Redis: the idempotency gate (check / claim), the replay's own state, and the audit stream.
//!
//! Each batch costs two round trips: one pipeline that asks about every key of the batch, and one
//! MULTI/EXEC that writes the audit rows, the "settled" marks and the counts together, so the
//! counts and the audit trail can never disagree, even across a crash.

use std::collections::HashMap;

use redis::aio::ConnectionManager;
use redis::Value;

use crate::api::Counts;
use crate::Error;

/// Compare-and-delete, so a failed publish releases only its own claim.
const RELEASE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end";

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

/// One row of the audit trail.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AuditRow {
    /// The stream entry id (set when read back).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub id: String,
    /// The replay id.
    pub replay: String,
    /// The message's identity (message id or body hash).
    pub message: String,
    /// replayed, duplicate, quarantined or failed.
    pub decision: String,
    /// The idempotency key, if any.
    pub key: String,
    /// Why.
    pub reason: String,
    /// Where it was published (exchange/routing key, or the quarantine queue).
    pub destination: String,
    /// Whether it was a canary.
    pub canary: bool,
    /// When (RFC 3339, milliseconds).
    pub time: String,
}

impl AuditRow {
    const FIELDS: [&'static str; 8] = [
        "replay",
        "message",
        "decision",
        "key",
        "reason",
        "destination",
        "canary",
        "time",
    ];

    fn values(&self) -> [&str; 8] {
        [
            &self.replay,
            &self.message,
            &self.decision,
            &self.key,
            &self.reason,
            &self.destination,
            if self.canary { "true" } else { "false" },
            &self.time,
        ]
    }
}

/// What the store knows about one key (or message) of a batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Lookup {
    /// The decision this replay recorded for this very message (by fingerprint).
    pub settled: Option<String>,
    /// The identity of the message this replay replayed under this key, if any.
    pub key_replayed: Option<String>,
    /// The key's value (Check mode), or the holder of the claim when the claim was refused.
    pub value: Option<String>,
    /// Claim mode: this call claimed the key.
    pub claimed: bool,
}

/// Redis keys of one replay.
#[derive(Debug, Clone)]
pub struct Keys {
    /// The state hash.
    pub state: String,
    /// The audit stream (set once the replay id is known).
    pub audit: String,
    /// The hash of settled messages: field = idempotency key or message identity.
    pub settled: String,
}

impl Keys {
    /// The state key of a replay named `namespace/name`.
    pub fn state_of(namespace: &str, name: &str) -> String {
        format!("dlq:replay:{namespace}/{name}")
    }

    fn new(namespace: &str, name: &str, replay_id: &str) -> Self {
        Self {
            state: Self::state_of(namespace, name),
            audit: format!("dlq:audit:{namespace}/{name}/{replay_id}"),
            settled: format!("dlq:settled:{namespace}/{name}/{replay_id}"),
        }
    }
}

/// A Redis connection for one replay.
pub struct Store {
    con: ConnectionManager,
    keys: Keys,
}

/// Connect to Redis; the error never repeats the URL.
pub async fn connect(url: &str) -> Result<ConnectionManager, Error> {
    crate::tls::install_provider();
    let client = redis::Client::open(url)
        .map_err(|e| Error::Redis(format!("bad Redis URL: {:?}", e.kind())))?;
    // Longer than a busy Redis takes to answer a batch's MULTI, short enough that a Redis that
    // stopped answering ends the pass (and the replay reconnects) instead of hanging it.
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_response_timeout(Some(std::time::Duration::from_secs(5)))
        .set_connection_timeout(Some(std::time::Duration::from_secs(5)));
    client
        .get_connection_manager_with_config(config)
        .await
        .map_err(|e| {
            if crate::redis_connection_lost(&e) {
                Error::Connection(crate::tls::hint(format!("redis: cannot connect: {e}")))
            } else {
                Error::Redis(crate::tls::hint(e.to_string()))
            }
        })
}

impl Store {
    /// Load the state of `namespace/name`, creating it (with a new replay id) on the first run,
    /// and count this start as one more attempt.
    pub async fn begin(
        mut con: ConnectionManager,
        namespace: &str,
        name: &str,
        depth_now: u64,
        now: &str,
    ) -> Result<(Self, State), Error> {
        let state_key = Keys::state_of(namespace, name);
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
        let keys = Keys::new(namespace, name, &state.replay_id);
        state.records = redis::cmd("XLEN")
            .arg(&keys.audit)
            .query_async(&mut con)
            .await?;
        Ok((Self { con, keys }, state))
    }

    /// Read the stored state without starting an attempt (`None` if the replay never ran).
    pub async fn peek(
        mut con: ConnectionManager,
        namespace: &str,
        name: &str,
    ) -> Result<Option<State>, Error> {
        let map: HashMap<String, String> = redis::cmd("HGETALL")
            .arg(Keys::state_of(namespace, name))
            .query_async(&mut con)
            .await?;
        Ok((!map.is_empty()).then(|| parse_state(&map)))
    }

    /// The replay's keys.
    pub fn keys(&self) -> &Keys {
        &self.keys
    }

    /// Ask about a batch in one round trip. `fields` are, per message, its fingerprint and its
    /// `key:` field in the settled hash; `keys` the idempotency keys to check (or claim, when
    /// `claim` holds the claim value and its expiry).
    pub async fn lookup(
        &mut self,
        fields: &[(&str, Option<&str>)],
        keys: &[Option<&str>],
        claim: Option<(&str, u64)>,
    ) -> Result<Vec<Lookup>, Error> {
        if fields.is_empty() {
            return Ok(Vec::new());
        }
        let mut p = redis::pipe();
        let hm = p.cmd("HMGET").arg(&self.keys.settled);
        for (fp, key_field) in fields {
            // A message without key asks for its fingerprint twice; the answer is ignored.
            hm.arg(*fp).arg(key_field.unwrap_or(fp));
        }
        for key in keys.iter().flatten() {
            match claim {
                Some((value, ttl)) => {
                    p.cmd("SET")
                        .arg(key)
                        .arg(value)
                        .arg("NX")
                        .arg("EX")
                        .arg(ttl);
                    p.cmd("GET").arg(key);
                }
                None => {
                    p.cmd("GET").arg(key);
                }
            }
        }
        let values: Vec<Value> = p.query_async(&mut self.con).await?;
        let mut it = values.into_iter();
        let settled: Vec<Option<String>> =
            redis::from_redis_value(it.next().unwrap_or(Value::Nil))?;
        let mut out = Vec::with_capacity(fields.len());
        for (i, key) in keys.iter().enumerate() {
            let mut l = Lookup {
                settled: settled.get(2 * i).cloned().flatten(),
                key_replayed: fields[i].1.and(settled.get(2 * i + 1).cloned().flatten()),
                ..Default::default()
            };
            if key.is_some() {
                if claim.is_some() {
                    l.claimed =
                        matches!(it.next(), Some(Value::Okay) | Some(Value::SimpleString(_)));
                }
                l.value = redis::from_redis_value(it.next().unwrap_or(Value::Nil))?;
            }
            out.push(l);
        }
        Ok(out)
    }

    /// Write a batch's outcome atomically: the audit rows, the settled marks, the released
    /// claims and the count deltas. Returns the audit stream's length afterwards, and how many
    /// `key:` marks already existed (keys this replay had replayed before: in Claim mode, a key
    /// published twice, which must never happen).
    pub async fn commit(
        &mut self,
        rows: &[AuditRow],
        settled: &[(String, String)],
        release: &[(String, String)],
        delta: &Counts,
    ) -> Result<(u64, u64), Error> {
        let mut p = redis::pipe();
        p.atomic();
        let (keys, marks): (Vec<_>, Vec<_>) =
            settled.iter().partition(|(f, _)| f.starts_with("key:"));
        for row in rows {
            let c = p.cmd("XADD").arg(&self.keys.audit).arg("*");
            for (f, v) in AuditRow::FIELDS.iter().zip(row.values()) {
                c.arg(*f).arg(v);
            }
            c.ignore();
        }
        if !marks.is_empty() {
            p.cmd("HSET").arg(&self.keys.settled).arg(marks).ignore();
        }
        for (field, value) in &keys {
            p.cmd("HSETNX")
                .arg(&self.keys.settled)
                .arg(field)
                .arg(value);
        }
        for (key, value) in release {
            p.cmd("EVAL")
                .arg(RELEASE)
                .arg(1)
                .arg(key)
                .arg(value)
                .ignore();
        }
        for (field, n) in count_fields(delta) {
            if n > 0 {
                p.cmd("HINCRBY")
                    .arg(&self.keys.state)
                    .arg(field)
                    .arg(n)
                    .ignore();
            }
        }
        p.cmd("XLEN").arg(&self.keys.audit);
        let mut answers: Vec<u64> = p.query_async(&mut self.con).await?;
        let len = answers.pop().unwrap_or(0);
        let again = answers.iter().filter(|set| **set == 0).count() as u64;
        Ok((len, again))
    }

    /// A handle on the same Redis.
    pub fn redis(&self) -> ConnectionManager {
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
    pub async fn finish(&mut self, status_json: &str) -> Result<(), Error> {
        redis::cmd("HSET")
            .arg(&self.keys.state)
            .arg("final")
            .arg(status_json)
            .query_async::<()>(&mut self.con)
            .await?;
        Ok(())
    }
}

/// Read an audit stream, oldest first.
pub async fn read_audit(con: &mut ConnectionManager, key: &str) -> Result<Vec<AuditRow>, Error> {
    let mut rows = Vec::new();
    let mut start = "-".to_string();
    loop {
        let page: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
            .arg(key)
            .arg(&start)
            .arg("+")
            .arg("COUNT")
            .arg(1000)
            .query_async(con)
            .await?;
        let Some((last, _)) = page.last() else { break };
        start = format!("({last}");
        let done = page.len() < 1000;
        rows.extend(page.into_iter().map(|(id, fields)| row_of(id, fields)));
        if done {
            break;
        }
    }
    Ok(rows)
}

fn row_of(id: String, fields: Vec<(String, String)>) -> AuditRow {
    let mut row = AuditRow {
        id,
        ..Default::default()
    };
    for (f, v) in fields {
        match f.as_str() {
            "replay" => row.replay = v,
            "message" => row.message = v,
            "decision" => row.decision = v,
            "key" => row.key = v,
            "reason" => row.reason = v,
            "destination" => row.destination = v,
            "canary" => row.canary = v == "true",
            "time" => row.time = v,
            _ => {}
        }
    }
    row
}

fn count_fields(c: &Counts) -> [(&'static str, u64); 7] {
    [
        ("c:scanned", c.scanned),
        ("c:replayed", c.replayed),
        ("c:duplicates", c.duplicates),
        ("c:quarantined", c.quarantined),
        ("c:skipped", c.skipped),
        ("c:failed", c.failed),
        ("c:returned", c.returned),
    ]
}

fn parse_state(map: &HashMap<String, String>) -> State {
    let n = |k: &str| map.get(k).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    State {
        replay_id: map.get("id").cloned().unwrap_or_default(),
        attempt: n("attempt"),
        depth_at_start: n("depthAtStart"),
        started_at: map.get("startedAt").cloned().unwrap_or_default(),
        counts: Counts {
            scanned: n("c:scanned"),
            replayed: n("c:replayed"),
            duplicates: n("c:duplicates"),
            quarantined: n("c:quarantined"),
            skipped: n("c:skipped"),
            failed: n("c:failed"),
            returned: n("c:returned"),
        },
        records: 0,
        final_status: map.get("final").cloned(),
        canary: map.get("canary").cloned(),
    }
}
