//! Before anything moves: what the replay's Redis is (its eviction policy and room) weighed
//! against what the replay will write there, and how its audit rows are written.

use crate::spec::{AuditSink, DlqReplaySpec};
use crate::Error;
use crate::{store, Replay};

/// How the replay's audit rows are written.
pub(super) fn audit_config(spec: &DlqReplaySpec) -> store::AuditConfig {
    store::AuditConfig {
        sink: spec.audit_sink(),
        key_prefix: spec
            .idempotency
            .as_ref()
            .map(|i| i.key.prefix.clone())
            .unwrap_or_default(),
    }
}

/// What the pre-flight finds on the replay's Redis for a replay that decides `messages`
/// messages: its memory settings, what the replay would write at its peak, and the risk, if any
/// (see `store::Room`). `run` refuses on a risk; `plan` shows it to the reviewer.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RedisCheck {
    /// `maxmemory-policy`.
    pub policy: String,
    /// `maxmemory` (0: no limit).
    pub maxmemory: u64,
    /// `used_memory` now.
    pub used: u64,
    /// What the replay would write at its peak, in bytes.
    pub expected: u64,
    /// Why it must not run there, if it must not.
    pub risk: Option<String>,
}

/// Read the replay's Redis and weigh it against a replay of `messages` decisions.
pub async fn redis_check(
    spec: &DlqReplaySpec,
    con: &mut crate::store::Redis,
    messages: u64,
) -> Result<RedisCheck, Error> {
    let room = store::Room::read(con).await?;
    let claims = spec
        .idempotency
        .as_ref()
        .is_some_and(|i| i.mode == crate::spec::IdempotencyMode::Claim);
    let expected = store::expected_bytes(messages, spec.audit_sink() == AuditSink::Redis, claims);
    Ok(RedisCheck {
        risk: room.risk(expected),
        policy: room.policy,
        maxmemory: room.maxmemory,
        used: room.used,
        expected,
    })
}

/// Before anything moves: refuse a Redis whose eviction could take the workers' done marks (see
/// [`redis_check`]), unless `spec.audit.acceptRedisEviction` accepts the risk; then the risk is
/// returned, for status and the report to say.
pub(super) async fn redis_preflight(
    replay: &Replay,
    con: &mut crate::store::Redis,
    depth: u64,
) -> Result<Option<String>, Error> {
    let spec = &replay.spec;
    let accepted = spec.accepts_redis_eviction();
    let messages = spec.selector.limit.map_or(depth, |l| l.min(depth));
    let risk = match redis_check(spec, con, messages).await {
        Ok(check) => check.risk,
        Err(e) if accepted => return Ok(Some(format!("not checked: {e}"))),
        Err(e) => {
            return Err(Error::Config(format!(
                "{e}; nothing was touched (set spec.audit.acceptRedisEviction: true to run without the check)"
            )))
        }
    };
    let Some(risk) = risk else {
        return Ok(None);
    };
    if accepted {
        tracing::warn!(replay = %replay.name, risk = %risk, "running on an evicting Redis: spec.audit.acceptRedisEviction");
        return Ok(Some(format!(
            "accepted (spec.audit.acceptRedisEviction): {risk}"
        )));
    }
    Err(Error::Config(format!(
        "the replay's Redis may evict the workers' done marks: {risk}; nothing was touched. Set maxmemory-policy to noeviction (or volatile-* with room to spare), raise maxmemory, or accept the risk with spec.audit.acceptRedisEviction: true"
    )))
}
