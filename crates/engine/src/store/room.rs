//! The pre-flight on the replay's Redis: can our writes evict the workers' done marks?
//!
//! The idempotency Redis is the workers' store before it is ours. With a `maxmemory` and an
//! eviction policy, what a replay writes (audit rows, settled marks, claims) can push the
//! workers' done marks out, and the next replay would republish work that already happened: the
//! one thing this tool exists to prevent. So before anything moves, the replay reads the policy
//! and the room left, and refuses to start when either is a risk, unless the spec accepts it.

use std::collections::HashMap;

use super::Redis;

use crate::Error;

/// What a replay writes to Redis per message at its peak, in bytes, rounded up from what the
/// bench's `redis` section measured (bench/RESULTS.md, "Redis footprint": 100,000 messages,
/// Redis 7.0): the settled marks (235 B per replayed message, until the replay ends `Done`),
/// the audit row (89 B, when the rows go to Redis) and, in Claim mode, the claim (167 B, kept
/// for `ttlSeconds`: it is what keeps another replay from publishing the key again).
pub const PEAK_BYTES_SETTLED: u64 = 250;
/// See [`PEAK_BYTES_SETTLED`].
pub const PEAK_BYTES_AUDIT: u64 = 100;
/// See [`PEAK_BYTES_SETTLED`].
pub const PEAK_BYTES_CLAIM: u64 = 180;

/// How the replay's Redis handles memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Room {
    /// `maxmemory-policy` (`noeviction`, `allkeys-lru`, `volatile-ttl`, ...).
    pub policy: String,
    /// `maxmemory` in bytes; 0: no limit.
    pub maxmemory: u64,
    /// `used_memory` in bytes.
    pub used: u64,
}

impl Room {
    /// Read it from `INFO memory`, which every Redis answers (managed ones that refuse
    /// `CONFIG` included); `CONFIG GET` only where `INFO` leaves the policy out. In a Cluster
    /// every master answers: the one with the least room speaks for all (the replay's keys and
    /// the workers' are spread over them).
    pub async fn read(con: &mut Redis) -> Result<Self, Error> {
        let info: redis::Value = redis::cmd("INFO")
            .arg("memory")
            .query_async(con)
            .await
            .map_err(|e| Error::Redis(format!("reading INFO memory for the pre-flight: {e}")))?;
        let mut rooms = Vec::new();
        for text in info_texts(info)? {
            rooms.push(Self::of_info(con, &text).await?);
        }
        rooms
            .into_iter()
            .min_by_key(|r| (!r.policy.starts_with("allkeys-"), r.room_left()))
            .ok_or_else(|| Error::Redis("INFO memory gave no answer".into()))
    }

    fn room_left(&self) -> u64 {
        if self.maxmemory == 0 {
            u64::MAX
        } else {
            self.maxmemory.saturating_sub(self.used)
        }
    }

    async fn of_info(con: &mut Redis, info: &str) -> Result<Self, Error> {
        let fields: HashMap<&str, &str> = info
            .lines()
            .filter_map(|l| l.trim_end().split_once(':'))
            .collect();
        let number = |f: &str| fields.get(f).and_then(|v| v.parse::<u64>().ok());
        let used = number("used_memory").unwrap_or(0);
        if let (Some(policy), Some(maxmemory)) =
            (fields.get("maxmemory_policy"), number("maxmemory"))
        {
            return Ok(Self {
                policy: policy.to_string(),
                maxmemory,
                used,
            });
        }
        let config: HashMap<String, String> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory*")
            .query_async(con)
            .await
            .map_err(|e| {
                Error::Redis(format!(
                    "INFO memory names no maxmemory-policy and CONFIG GET was refused ({e})"
                ))
            })?;
        Ok(Self {
            policy: config.get("maxmemory-policy").cloned().unwrap_or_default(),
            maxmemory: config
                .get("maxmemory")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            used,
        })
    }

    /// Why a replay expected to write `expected` bytes at its peak must not start here, if it
    /// must not: a policy that evicts any key, or too little room under `maxmemory` (where
    /// `volatile-*` evicts done marks that have an expiry, and `noeviction` fails the replay's
    /// writes halfway).
    pub fn risk(&self, expected: u64) -> Option<String> {
        if self.policy.starts_with("allkeys-") {
            return Some(format!(
                "maxmemory-policy is {}: Redis may evict any key, the workers' done marks included, to make room for this replay's writes",
                self.policy
            ));
        }
        let room = self.maxmemory.saturating_sub(self.used);
        (self.maxmemory > 0 && expected > room).then(|| {
            format!(
                "maxmemory {} leaves {} free and this replay may write up to {} (maxmemory-policy {})",
                human_bytes(self.maxmemory),
                human_bytes(room),
                human_bytes(expected),
                self.policy
            )
        })
    }
}

/// The `INFO` text of each server that answered: one, or one per master of a Cluster (a map of
/// node to text).
fn info_texts(info: redis::Value) -> Result<Vec<String>, Error> {
    let texts = match info {
        redis::Value::Map(nodes) => nodes.into_iter().map(|(_, text)| text).collect(),
        one => vec![one],
    };
    texts
        .into_iter()
        .map(|t| redis::from_redis_value::<String>(t).map_err(|e| Error::Redis(e.to_string())))
        .collect()
}

/// What a replay of `messages` writes at its peak, by the measured [`PEAK_BYTES_SETTLED`] and
/// its siblings.
pub fn expected_bytes(messages: u64, audit_in_redis: bool, claims: bool) -> u64 {
    let per = PEAK_BYTES_SETTLED
        + if audit_in_redis { PEAK_BYTES_AUDIT } else { 0 }
        + if claims { PEAK_BYTES_CLAIM } else { 0 };
    messages.saturating_mul(per)
}

/// Bytes as a person reads them: KiB below a MiB, MiB above.
pub fn human_bytes(bytes: u64) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    if (bytes as f64) < MIB {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    } else {
        format!("{:.1} MiB", bytes as f64 / MIB)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn room(policy: &str, maxmemory: u64, used: u64) -> Room {
        Room {
            policy: policy.into(),
            maxmemory,
            used,
        }
    }

    #[test]
    fn an_allkeys_policy_is_a_risk_whatever_the_room() {
        for p in ["allkeys-lru", "allkeys-lfu", "allkeys-random"] {
            let why = room(p, 0, 0).risk(1).expect(p);
            assert!(why.contains(p), "{why}");
        }
    }

    #[test]
    fn too_little_room_is_a_risk_for_the_other_policies() {
        let mib = 1024 * 1024;
        for p in ["noeviction", "volatile-lru", "volatile-ttl"] {
            assert_eq!(room(p, 0, 5 * mib).risk(u64::MAX), None, "no limit");
            assert_eq!(room(p, 100 * mib, 50 * mib).risk(40 * mib), None);
            let why = room(p, 100 * mib, 50 * mib).risk(60 * mib).expect(p);
            assert!(why.contains("50.0 MiB free") && why.contains(p), "{why}");
        }
    }

    #[test]
    fn the_expected_footprint_follows_what_the_replay_writes() {
        assert_eq!(expected_bytes(10, false, false), 10 * PEAK_BYTES_SETTLED);
        assert_eq!(
            expected_bytes(10, true, true),
            10 * (PEAK_BYTES_SETTLED + PEAK_BYTES_AUDIT + PEAK_BYTES_CLAIM)
        );
    }
}
