//! Redis: the idempotency gate (check / claim), the replay's own state, and the audit stream.
//!
//! Each batch costs two round trips: one pipeline that asks about every key of the batch, and one
//! script that writes the audit rows, the "settled" marks and the counts together (atomically,
//! once), so the counts and the audit trail can never disagree, even across a crash or a retry.

use std::collections::HashMap;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::Value;
use tokio_util::sync::CancellationToken;

use crate::api::Counts;
use crate::Error;

/// A batch's outcome, applied once. KEYS: the audit stream, the settled hash, the state hash,
/// then the claims the batch ends. ARGV: the commit id; the audit field names (count first); the
/// rows (count first, one value per field each); the settled marks and then the `key:` marks
/// (each count first, field and value each); the ended claims (count first, then per claim its
/// value and the value it takes once published, or "" to release it); the count deltas (count
/// first, field and increment each). Ended claims are compare-and-set or compare-and-delete, so a
/// batch ends only its own claims. `key:` marks are
/// HSETNX, and those that existed already are counted. The commit id kept in the state hash
/// makes a retry of a commit that did go through (its answer was lost) change nothing.
const COMMIT: &str = r#"
local audit, settled, state = KEYS[1], KEYS[2], KEYS[3]
if redis.call('HGET', state, 'commit') == ARGV[1] then
  return {redis.call('XLEN', audit), 0, 0}
end
local i = 2
local function take()
  local v = ARGV[i]
  i = i + 1
  return v
end
local nfields = tonumber(take())
local names = {}
for f = 1, nfields do names[f] = take() end
for _ = 1, tonumber(take()) do
  local xadd = {'XADD', audit, '*'}
  for f = 1, nfields do
    xadd[#xadd + 1] = names[f]
    xadd[#xadd + 1] = take()
  end
  redis.call(unpack(xadd))
end
for _ = 1, tonumber(take()) do
  redis.call('HSET', settled, take(), take())
end
local again = 0
for _ = 1, tonumber(take()) do
  again = again + (1 - redis.call('HSETNX', settled, take(), take()))
end
for k = 1, tonumber(take()) do
  local key, value, confirmed = KEYS[3 + k], take(), take()
  if redis.call('GET', key) == value then
    if confirmed == '' then
      redis.call('DEL', key)
    else
      redis.call('SET', key, confirmed, 'KEEPTTL')
    end
  end
end
for _ = 1, tonumber(take()) do
  redis.call('HINCRBY', state, take(), take())
end
redis.call('HSET', state, 'commit', ARGV[1])
return {redis.call('XLEN', audit), again, 1}
"#;

/// Compare-and-delete a claim (KEYS[1]) of ours (ARGV[1]) unless its key was published by this
/// replay (a `key:` mark in the settled hash, KEYS[2]).
const HAND_BACK: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] and redis.call('HEXISTS', KEYS[2], 'key:' .. KEYS[1]) == 0 then return redis.call('DEL', KEYS[1]) else return 0 end";

fn commit_script() -> &'static redis::Script {
    static SCRIPT: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| redis::Script::new(COMMIT))
}

/// The audit stream's length and the `key:` marks that existed, from the script's answer
/// (those two, and whether this call applied the commit).
fn commit_answer((len, again, applied): (u64, u64, u64)) -> (u64, u64) {
    if applied == 0 {
        tracing::info!(
            "a batch's outcome was already recorded by the commit whose answer was lost"
        );
    }
    (len, again)
}

const RETRY_MAX_DELAY: Duration = Duration::from_secs(4);

/// After the replay was stopped, a lost call is still asked again for this long (a Redis blip
/// is short, and a commit's publishes are confirmed), and then given up, leaving the batch as a
/// crash would: the stop must take effect within seconds, not after the whole budget.
const RETRY_AFTER_STOP: Duration = Duration::from_secs(5);

/// The retries of one Redis call whose answer was lost: 0.25 s doubling to 4 s with jitter (a
/// Redis that paused or restarted is back soon, and the batch's messages are held meanwhile),
/// for as long as the budget allows.
struct Retries {
    started: tokio::time::Instant,
    budget: Duration,
    delays: backon::ExponentialBackoff,
    /// The replay's stop, and when this call first saw it.
    stop: Option<CancellationToken>,
    stopped_at: Option<tokio::time::Instant>,
}

impl Retries {
    fn new(budget: Duration, stop: Option<CancellationToken>) -> Self {
        Self {
            started: tokio::time::Instant::now(),
            budget,
            delays: crate::engine::backoff(RETRY_MAX_DELAY),
            stop,
            stopped_at: None,
        }
    }

    /// How long to wait before asking again after `e`; `None`: give up (not a lost answer, or
    /// the budget is spent, or the replay was stopped more than [`RETRY_AFTER_STOP`] ago).
    fn next(&mut self, e: &Error) -> Option<Duration> {
        let delay = self.delays.next().unwrap_or(RETRY_MAX_DELAY);
        let mut ok = e.is_transient() && self.started.elapsed() + delay <= self.budget;
        if self.stop.as_ref().is_some_and(|s| s.is_cancelled()) {
            let since = *self
                .stopped_at
                .get_or_insert_with(tokio::time::Instant::now);
            ok &= since.elapsed() + delay <= RETRY_AFTER_STOP;
        }
        ok.then_some(delay)
    }
}

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

/// How a claim of this replay ends with the batch that took it: marked as published (its publish
/// is confirmed), or released (nothing went out). Both only if the key still holds `value`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimEnd {
    /// The idempotency key.
    pub key: String,
    /// The claim value this replay set (`<replay id>/<attempt>`).
    pub value: String,
    /// Whether the publish under this claim was confirmed.
    pub published: bool,
}

/// The value a claim takes once its publish is confirmed.
pub fn confirmed_claim(claim: &str) -> String {
    format!("{claim}{PUBLISHED}")
}

/// What a confirmed claim's value ends with.
const PUBLISHED: &str = "+published";

/// What an idempotency key's value says, to anyone but the replay attempt that holds it: the one
/// rule by which the drain, the canary and `plan` tell a duplicate from a key whose work may
/// never have gone out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Held {
    /// No value: the key is free.
    Free,
    /// The worker marked it done.
    Done,
    /// Claimed by a replay (`<replay id>/<attempt>`) whose publish is confirmed: a duplicate.
    Published(String),
    /// Claimed by a replay whose publish was never confirmed (a crash, a failed publish): it
    /// may never have gone out, so nothing may be dropped on its account.
    Unconfirmed(String),
    /// Some other value (Claim mode: held by something else): a duplicate.
    Other(String),
}

impl Held {
    /// Read a key's value (`None`: no value) with the worker's done value.
    pub fn of(value: Option<&str>, done: &str) -> Self {
        let Some(v) = value else {
            return Held::Free;
        };
        if v == done {
            return Held::Done;
        }
        let claim = v.strip_suffix(PUBLISHED).unwrap_or(v);
        let is_claim = claim.split_once('/').is_some_and(|(id, attempt)| {
            id.len() == 32
                && id.bytes().all(|b| b.is_ascii_hexdigit())
                && !attempt.is_empty()
                && attempt.bytes().all(|b| b.is_ascii_digit())
        });
        match (is_claim, claim.len() < v.len()) {
            (true, true) => Held::Published(claim.to_string()),
            (true, false) => Held::Unconfirmed(claim.to_string()),
            (false, _) => Held::Other(v.to_string()),
        }
    }

    /// The replay id of a replay's claim.
    pub fn replay(&self) -> Option<&str> {
        match self {
            Held::Published(c) | Held::Unconfirmed(c) => c.split_once('/').map(|(id, _)| id),
            _ => None,
        }
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

const AUDIT_PREFIX: &str = "dlq:audit:";

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

    /// The audit stream key of run `replay_id` of a replay named `namespace/name`.
    pub fn audit_of(namespace: &str, name: &str, replay_id: &str) -> String {
        format!("{AUDIT_PREFIX}{namespace}/{name}/{replay_id}")
    }

    /// The namespace and name in an audit stream key (the inverse of [`Keys::audit_of`]).
    pub fn names_of_audit(key: &str) -> Option<(String, String)> {
        let rest = key.strip_prefix(AUDIT_PREFIX)?;
        let mut parts = rest.splitn(3, '/');
        let (ns, name, id) = (parts.next()?, parts.next()?, parts.next()?);
        (!ns.is_empty() && !name.is_empty() && !id.is_empty()).then(|| (ns.into(), name.into()))
    }

    fn new(namespace: &str, name: &str, replay_id: &str) -> Self {
        Self {
            state: Self::state_of(namespace, name),
            audit: Self::audit_of(namespace, name, replay_id),
            settled: format!("dlq:settled:{namespace}/{name}/{replay_id}"),
        }
    }
}

/// A Redis connection for one replay (a clone shares the connection: its calls are pipelined
/// with the original's, in the order they are made).
#[derive(Clone)]
pub struct Store {
    con: ConnectionManager,
    keys: Keys,
    retry_for: Duration,
    /// Where a wait for Redis is said (the replay's status message), if anywhere.
    waits: Option<crate::engine::Progress>,
    /// The replay's stop: it ends a wait between retries (see [`Store::stop_on`]).
    stop: Option<CancellationToken>,
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
        Ok((
            Self {
                con,
                keys,
                retry_for: Duration::ZERO,
                waits: None,
                stop: None,
            },
            state,
        ))
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
    ///
    /// A lookup whose answer was lost is asked again, within the commit retry budget: nothing of
    /// the batch is published yet. Claims the lost lookup may have taken are handed back first
    /// (those of this claim value whose key has no `key:` mark, i.e. not published by this
    /// attempt), so the second answer tells this batch's claims apart from earlier ones.
    pub async fn lookup(
        &mut self,
        fields: &[(&str, Option<&str>)],
        keys: &[Option<&str>],
        claim: Option<(&str, u64)>,
    ) -> Result<Vec<Lookup>, Error> {
        let mut retries = Retries::new(self.retry_for, self.stop.clone());
        let mut lost = false;
        loop {
            let attempt = async {
                if let (true, Some((mine, _))) = (lost, claim) {
                    self.hand_back(keys, mine).await?;
                }
                self.lookup_once(fields, keys, claim).await
            };
            let e = match attempt.await {
                Ok(answer) => return Ok(answer),
                Err(e) => e,
            };
            let Some(delay) = retries.next(&e) else {
                return Err(e);
            };
            lost = true;
            self.wait_to_retry("redis_lookup", &e, delay).await;
        }
    }

    /// Delete the claims of `mine` on `keys` that this attempt did not publish.
    async fn hand_back(&mut self, keys: &[Option<&str>], mine: &str) -> Result<(), Error> {
        let mut p = redis::pipe();
        for key in keys.iter().flatten() {
            p.cmd("EVAL")
                .arg(HAND_BACK)
                .arg(2)
                .arg(key)
                .arg(&self.keys.settled)
                .arg(mine)
                .ignore();
        }
        p.query_async::<()>(&mut self.con).await?;
        Ok(())
    }

    async fn lookup_once(
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
    ///
    /// A commit whose answer was lost (Redis timed out or went away) is tried again for as long
    /// as [`Store::retry_for`] allows, holding the batch's messages: their publishes are
    /// confirmed, and giving up here would leave them unknown. The commit carries an id that the
    /// script records with it, so a retry of a commit that did go through writes nothing twice.
    pub async fn commit(
        &mut self,
        rows: &[AuditRow],
        settled: &[(String, String)],
        release: &[ClaimEnd],
        delta: &Counts,
    ) -> Result<(u64, u64), Error> {
        let invocation = self.commit_invocation(rows, settled, release, delta);
        let mut retries = Retries::new(self.retry_for, self.stop.clone());
        loop {
            let e = match invocation.invoke_async(&mut self.con).await {
                Ok(answer) => return Ok(commit_answer(answer)),
                Err(e) => Error::from(e),
            };
            let Some(delay) = retries.next(&e) else {
                return Err(e);
            };
            self.wait_to_retry("redis_commit", &e, delay).await;
        }
    }

    /// How long a lookup or commit whose answer was lost is tried again (zero: not at all).
    pub fn retry_for(&mut self, budget: Duration) {
        self.retry_for = budget;
    }

    /// Let `stop` (the replay's cancellation) end a wait between retries: the call is then asked
    /// again only for a few seconds more ([`RETRY_AFTER_STOP`]) before it is given up.
    pub fn stop_on(&mut self, stop: CancellationToken) {
        self.stop = Some(stop);
    }

    /// Say in `progress`'s status message when a batch waits for Redis (the next report of
    /// the drain replaces it).
    pub fn report_waits_to(&mut self, progress: crate::engine::Progress) {
        self.waits = Some(progress);
    }

    /// One more retry of `what`: counted, logged, said in the status, then waited for.
    async fn wait_to_retry(&self, what: &str, e: &Error, delay: Duration) {
        crate::metrics::Metrics::global().retried(what);
        tracing::warn!(error = %e, retry_in_ms = delay.as_millis() as u64, call = what, "a Redis answer was lost; asking again");
        if let Some(p) = &self.waits {
            p.send_modify(|s| {
                s.message = Some(format!(
                    "WaitingForRedis: {e}; the batch in hand is held (nothing published unchecked, nothing acked unrecorded); asking again in {:.1}s",
                    delay.as_secs_f64()
                ))
            });
        }
        match &self.stop {
            // The first wait after a stop is cut short; those of the few seconds after it are not
            // (they are what spaces the last asks).
            Some(stop) if !stop.is_cancelled() => {
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = stop.cancelled() => {}
                }
            }
            _ => tokio::time::sleep(delay).await,
        }
    }

    fn commit_invocation(
        &self,
        rows: &[AuditRow],
        settled: &[(String, String)],
        release: &[ClaimEnd],
        delta: &Counts,
    ) -> redis::ScriptInvocation<'static> {
        let (keys, marks): (Vec<_>, Vec<_>) =
            settled.iter().partition(|(f, _)| f.starts_with("key:"));
        let mut inv = commit_script().prepare_invoke();
        inv.key(&self.keys.audit)
            .key(&self.keys.settled)
            .key(&self.keys.state);
        inv.arg(uuid::Uuid::new_v4().simple().to_string());
        inv.arg(AuditRow::FIELDS.len())
            .arg(AuditRow::FIELDS.as_slice());
        inv.arg(rows.len());
        for row in rows {
            inv.arg(row.values().as_slice());
        }
        for pairs in [&marks, &keys] {
            inv.arg(pairs.len());
            for (f, v) in pairs.iter() {
                inv.arg(f).arg(v);
            }
        }
        inv.arg(release.len());
        for c in release {
            let confirmed = if c.published {
                confirmed_claim(&c.value)
            } else {
                String::new()
            };
            inv.key(&c.key).arg(&c.value).arg(confirmed);
        }
        let counts: Vec<_> = count_fields(delta)
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .collect();
        inv.arg(counts.len());
        for (field, n) in counts {
            inv.arg(field).arg(n);
        }
        inv
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

/// Set the expiry of a replay's keys (its state hash, settled hash and audit stream) to
/// `seconds` from now: `spec.audit.retentionSeconds`. Returns whether the replay has a state
/// (`false`: it never began, nothing to expire yet).
pub async fn retain(
    con: &mut ConnectionManager,
    namespace: &str,
    name: &str,
    seconds: u64,
) -> Result<bool, Error> {
    let state = Keys::state_of(namespace, name);
    let id: Option<String> = redis::cmd("HGET")
        .arg(&state)
        .arg("id")
        .query_async(con)
        .await?;
    let Some(id) = id else {
        return Ok(false);
    };
    let keys = Keys::new(namespace, name, &id);
    let mut p = redis::pipe();
    for key in [&keys.state, &keys.settled, &keys.audit] {
        p.cmd("EXPIRE").arg(key).arg(seconds).ignore();
    }
    p.query_async::<()>(con).await?;
    Ok(true)
}

/// How often [`retain_while`] sets the expiry again: a quarter of the retention, at most every
/// ten minutes.
fn keep_every(seconds: u64) -> Duration {
    Duration::from_secs((seconds / 4).clamp(1, 600))
}

/// Keep a replay's Redis keys for its `spec.audit.retentionSeconds` ([`retain`]) while it runs
/// and after it ends, on a task of its own: once `progress` shows a replay id (the engine has
/// begun), then every [`keep_every`] however long the replay runs or waits (a canary wait, a
/// pending pre-flight, a Redis outage), and a last time when `progress` closes (the engine
/// returned), so the keys expire that long after the replay's end. Failures are logged and
/// tried again at the next turn. `None` for a dry run, which writes nothing.
pub fn retention(
    replay: &crate::engine::Replay,
    progress: tokio::sync::watch::Receiver<crate::api::DlqReplayStatus>,
) -> Option<tokio::task::JoinHandle<()>> {
    if replay.spec.dry_run {
        return None;
    }
    let url = replay.redis_url.clone();
    let (namespace, name) = (replay.namespace.clone(), replay.state_name());
    let seconds = replay.spec.retention_seconds();
    Some(tokio::spawn(async move {
        match connect(&url).await {
            Ok(con) => retain_while(progress, con, &namespace, &name, seconds).await,
            Err(e) => {
                tracing::warn!(error = %e, replay = %format!("{namespace}/{name}"), "no Redis for the expiry of the replay's keys")
            }
        }
    }))
}

async fn retain_while(
    mut progress: tokio::sync::watch::Receiver<crate::api::DlqReplayStatus>,
    mut con: ConnectionManager,
    namespace: &str,
    name: &str,
    seconds: u64,
) {
    let every = keep_every(seconds);
    let mut last: Option<tokio::time::Instant> = None;
    let mut ended = false;
    loop {
        let begun = progress.borrow_and_update().replay_id.is_some();
        if ended || (begun && last.is_none_or(|t| t.elapsed() >= every)) {
            last = Some(tokio::time::Instant::now());
            if let Err(e) = retain(&mut con, namespace, name, seconds).await {
                tracing::warn!(error = %e, replay = %format!("{namespace}/{name}"), "setting the expiry of the replay's Redis keys");
            }
        }
        if ended {
            return;
        }
        tokio::select! {
            changed = progress.changed() => ended = changed.is_err(),
            _ = tokio::time::sleep(every) => {}
        }
    }
}

/// Removes a stored `CanaryFailed` final status with the canary decisions (see [`reopen`]);
/// returns the stored final status's phase, `''` for none.
const REOPEN: &str = r#"
local final = redis.call('HGET', KEYS[1], 'final')
if not final then return '' end
local ok, status = pcall(cjson.decode, final)
local phase = ok and type(status) == 'table' and status['phase'] or '?'
if phase == 'CanaryFailed' then
  redis.call('HDEL', KEYS[1], 'final', 'canary')
end
return phase
"#;

/// Open a finished replay for a retry in place (same replay id): a stored `CanaryFailed` final
/// status is removed with the canary decisions, so the next run sends new canaries and drains
/// as a rerun would. Returns the phase of the stored final status that was there (`None`: none,
/// as after `Failed`, which a rerun resumes anyway); any other (`Done`) is left as it is.
pub async fn reopen(
    con: &mut ConnectionManager,
    namespace: &str,
    name: &str,
) -> Result<Option<String>, Error> {
    let phase: String = redis::Script::new(REOPEN)
        .key(Keys::state_of(namespace, name))
        .invoke_async(con)
        .await?;
    Ok((!phase.is_empty()).then_some(phase))
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

#[cfg(test)]
mod tests {
    //! Against the real Redis (REDIS_URL, else the local one), under keys of their own.
    use super::*;

    #[test]
    fn a_claim_is_published_only_once_marked_so() {
        let id = "0123456789abcdef0123456789abcdef";
        let claim = format!("{id}/2");
        assert_eq!(Held::of(None, "done"), Held::Free);
        assert_eq!(Held::of(Some("done"), "done"), Held::Done);
        assert_eq!(
            Held::of(Some(&claim), "done"),
            Held::Unconfirmed(claim.clone())
        );
        let published = confirmed_claim(&claim);
        assert_eq!(
            Held::of(Some(&published), "done"),
            Held::Published(claim.clone())
        );
        assert_eq!(Held::of(Some(&published), "done").replay(), Some(id));
        for other in ["processing", "abc/1", "0123/x", &format!("{id}/")] {
            assert_eq!(Held::of(Some(other), "done"), Held::Other(other.into()));
        }
    }

    #[tokio::test]
    async fn a_commit_marks_published_claims_and_releases_failed_ones_of_its_own_only() {
        let mut s = store("claims").await;
        let mut con = s.redis();
        let id = uuid::Uuid::new_v4().simple().to_string();
        let mine = format!("{id}/1");
        let key = |n: &str| format!("test:claims:{id}:{n}");
        for (k, v) in [
            ("ok", mine.as_str()),
            ("bad", mine.as_str()),
            ("theirs", "x"),
        ] {
            redis::cmd("SET")
                .arg(key(k))
                .arg(v)
                .arg("EX")
                .arg(60)
                .query_async::<()>(&mut con)
                .await
                .unwrap();
        }
        let end = |n: &str, published| ClaimEnd {
            key: key(n),
            value: mine.clone(),
            published,
        };
        s.commit(
            &[],
            &[],
            &[end("ok", true), end("bad", false), end("theirs", false)],
            &Counts::default(),
        )
        .await
        .unwrap();
        let reader = con.clone();
        let get = |k: String| {
            let mut con = reader.clone();
            async move {
                let v: Option<String> = redis::cmd("GET")
                    .arg(k)
                    .query_async(&mut con)
                    .await
                    .unwrap();
                v
            }
        };
        assert_eq!(get(key("ok")).await, Some(confirmed_claim(&mine)));
        let ttl: i64 = redis::cmd("TTL")
            .arg(key("ok"))
            .query_async(&mut con)
            .await
            .unwrap();
        assert!(ttl > 0, "the claim keeps its expiry: {ttl}");
        assert_eq!(get(key("bad")).await, None);
        assert_eq!(get(key("theirs")).await, Some("x".into()));
        let _: () = redis::cmd("DEL")
            .arg(key("ok"))
            .arg(key("theirs"))
            .query_async(&mut con)
            .await
            .unwrap();
        cleanup(&mut s, &[]).await;
    }

    #[tokio::test]
    async fn retain_expires_the_three_keys_of_a_replay_that_began() {
        let mut s = store("retain").await;
        let mut con = s.redis();
        let ns = s.keys().state.trim_start_matches("dlq:replay:").to_string();
        let (ns, name) = ns.split_once('/').unwrap();
        s.commit(
            &[row("a")],
            &[("fp".into(), "replayed".into())],
            &[],
            &Counts::default(),
        )
        .await
        .unwrap();
        assert!(retain(&mut con, ns, name, 3600).await.unwrap());
        let k = s.keys().clone();
        for key in [&k.state, &k.settled, &k.audit] {
            let ttl: i64 = redis::cmd("TTL")
                .arg(key)
                .query_async(&mut con)
                .await
                .unwrap();
            assert!((3590..=3600).contains(&ttl), "{key}: {ttl}");
        }
        assert!(!retain(&mut con, ns, "never-ran", 3600).await.unwrap());
        cleanup(&mut s, &[]).await;
    }

    #[tokio::test]
    async fn reopen_clears_a_canary_failed_end_only() {
        let mut s = store("reopen").await;
        let mut con = s.redis();
        let state = s.keys().state.clone();
        let (ns, name) = state
            .trim_start_matches("dlq:replay:")
            .split_once('/')
            .unwrap();
        assert_eq!(reopen(&mut con, ns, name).await.unwrap(), None);
        s.save_canary("[]").await.unwrap();
        s.finish(r#"{"phase":"Done"}"#).await.unwrap();
        assert_eq!(
            reopen(&mut con, ns, name).await.unwrap().as_deref(),
            Some("Done")
        );
        s.finish(r#"{"phase":"CanaryFailed"}"#).await.unwrap();
        assert_eq!(
            reopen(&mut con, ns, name).await.unwrap().as_deref(),
            Some("CanaryFailed")
        );
        let left: HashMap<String, String> = redis::cmd("HGETALL")
            .arg(&state)
            .query_async(&mut con)
            .await
            .unwrap();
        assert!(
            !left.contains_key("final") && !left.contains_key("canary"),
            "{left:?}"
        );
        assert!(left.contains_key("id"), "the replay id stays: {left:?}");
        cleanup(&mut s, &[]).await;
    }

    async fn store(name: &str) -> Store {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
        let con = connect(&url).await.expect("redis");
        let ns = format!("unit-{}", uuid::Uuid::new_v4().simple());
        Store::begin(con, &ns, name, 0, "now")
            .await
            .expect("begin")
            .0
    }

    async fn cleanup(s: &mut Store, extra: &[&str]) {
        let k = s.keys().clone();
        let mut cmd = redis::cmd("DEL");
        cmd.arg(&k.state).arg(&k.audit).arg(&k.settled).arg(extra);
        cmd.query_async::<()>(&mut s.con).await.expect("del");
    }

    fn row(message: &str) -> AuditRow {
        AuditRow {
            message: message.into(),
            decision: "replayed".into(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_commit_sent_again_after_a_lost_answer_writes_nothing_twice() {
        let mut s = store("commit-once").await;
        let settled = [("fp1".to_string(), "replayed".to_string())];
        let delta = Counts {
            scanned: 2,
            replayed: 2,
            ..Default::default()
        };
        let inv = s.commit_invocation(&[row("a"), row("b")], &settled, &[], &delta);
        let first: Vec<u64> = inv.invoke_async(&mut s.con).await.expect("first");
        // The same invocation again, as a retry after a timed-out answer sends it.
        let again: Vec<u64> = inv.invoke_async(&mut s.con).await.expect("again");
        assert_eq!(first, vec![2, 0, 1]);
        assert_eq!(again, vec![2, 0, 0], "the retry must apply nothing");
        let state: HashMap<String, String> = redis::cmd("HGETALL")
            .arg(&s.keys().state)
            .query_async(&mut s.con)
            .await
            .expect("state");
        assert_eq!(state.get("c:replayed").map(String::as_str), Some("2"));
        // A new commit (a new id) is applied.
        let (len, _) = s
            .commit(&[row("c")], &[], &[], &Counts::default())
            .await
            .expect("next");
        assert_eq!(len, 3);
        cleanup(&mut s, &[]).await;
    }

    #[tokio::test]
    async fn hand_back_frees_only_our_unpublished_claims() {
        let mut s = store("hand-back").await;
        let tag = uuid::Uuid::new_v4().simple().to_string();
        let [ours, published, theirs] =
            ["ours", "published", "theirs"].map(|k| format!("unit-idem:{tag}:{k}"));
        let mine = "replay/7";
        let mut p = redis::pipe();
        p.cmd("SET").arg(&ours).arg(mine).ignore();
        p.cmd("SET").arg(&published).arg(mine).ignore();
        p.cmd("SET").arg(&theirs).arg("other/1").ignore();
        p.cmd("HSET")
            .arg(&s.keys().settled)
            .arg(format!("key:{published}"))
            .arg("m")
            .ignore();
        p.query_async::<()>(&mut s.con).await.expect("setup");
        let keys = [
            Some(ours.as_str()),
            Some(published.as_str()),
            Some(theirs.as_str()),
            None,
        ];
        s.hand_back(&keys, mine).await.expect("hand back");
        let left: Vec<Option<String>> = redis::cmd("MGET")
            .arg(&ours)
            .arg(&published)
            .arg(&theirs)
            .query_async(&mut s.con)
            .await
            .expect("mget");
        assert_eq!(
            left,
            vec![None, Some(mine.to_string()), Some("other/1".to_string())]
        );
        cleanup(&mut s, &[&ours, &published, &theirs]).await;
    }
}
