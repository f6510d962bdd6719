//! A batch's outcome, written once: the audit rows, the settled marks, the ends of its claims
//! and the count deltas, in one script call that a retry after a lost answer cannot apply twice.

use super::audit;
use super::{confirmed_claim, AuditRow, Retries, Store};
use crate::spec::AuditSink;
use crate::status::Counts;
use crate::Error;

/// A batch's outcome, applied once. KEYS: the audit stream, the settled hash, the state hash,
/// the audit dictionary, then the claims the batch ends. ARGV: the commit id; the count deltas
/// (count first, field and increment each); the dictionary's new fields (count first, field and
/// value each); the audit field names (count first: none when the rows went to the log); the
/// rows (count first, one value per field each); the settled marks and then the `key:` marks
/// (each count first, field and value each); the ended claims (count first, then per claim its
/// value and the value it takes once published, or "" to release it).
///
/// Ended claims are compare-and-set or compare-and-delete, so a batch ends only its own claims.
/// `key:` marks are set where none exists (as HSETNX one by one would), and those that existed
/// already are counted. Each group is one variadic command (HSET, HMGET, MGET, DEL), not one per
/// message, and the state hash is read once and written once (the counts are added up here, not
/// one HINCRBY each): the commands per step do not grow with what the step holds, only the
/// audit rows and the ended claims count one each. The commit id kept in the state hash makes a
/// retry of a commit that did go through (its answer was lost) change nothing. Returns the audit
/// rows so far: the stream's length, or (rows in the log) the state's `records` count.
const COMMIT: &str = include_str!("commit.lua");

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

impl Store {
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
        if self.sink == AuditSink::Log && !rows.is_empty() {
            // Written before the commit, as a stream entry would be: the messages are acked
            // only after both. A commit retried after a lost answer does not write them again.
            audit::log_rows(rows, &self.names.0, &self.names.1)?;
        }
        // In a Cluster the claims' keys are in other slots than the replay's: they are ended one
        // by one beside the script (each end is a compare-and-set, so a retry ends none twice).
        let (in_script, apart) = if self.con.spans_slots() {
            (release, &[][..])
        } else {
            (&[][..], release)
        };
        let (invocation, defined) = self.commit_invocation(rows, settled, in_script, delta);
        let mut retries = Retries::new(self.retry_for, self.stop.clone());
        loop {
            let attempt = async {
                if let Some(wait) = self.con.inline_wait() {
                    // One server or Sentinel (the claims are ended in the script): one round trip,
                    // the script, then the WAIT for it.
                    let mut p = redis::pipe();
                    p.add_command(invocation.clone()).add_command(wait);
                    let (answer, got) = eval_pipeline(&mut self.con, commit_script(), &p).await?;
                    self.con.enough(got)?;
                    return Ok(answer);
                }
                let answer = eval(&mut self.con, commit_script(), &invocation).await?;
                end_claims(&mut self.con, apart).await?;
                let mut written = vec![self.keys.state.as_str()];
                written.extend(apart.iter().map(|c| c.key.as_str()));
                self.con.replicated(&written).await?;
                Ok::<_, Error>(answer)
            };
            let e = match attempt.await {
                Ok(answer) => {
                    self.encoder.stored(defined);
                    return Ok(commit_answer(answer));
                }
                Err(e) => e,
            };
            let Some(delay) = retries.next(&e) else {
                return Err(e);
            };
            self.wait_to_retry("redis_commit", &e, delay).await;
        }
    }

    /// The script call of a commit, and how much of the audit dictionary it stores: one
    /// `EVALSHA` command whose arguments are packed into one buffer as they are added (a
    /// `ScriptInvocation` allocates each argument, then copies them all into a command: about
    /// ten allocations per replayed message, measured with dhat).
    fn commit_invocation(
        &self,
        rows: &[AuditRow],
        settled: &[(String, String)],
        release: &[ClaimEnd],
        delta: &Counts,
    ) -> (redis::Cmd, usize) {
        let mut inv = redis::cmd("EVALSHA");
        inv.arg(commit_script().get_hash()).arg(4 + release.len());
        inv.arg(&self.keys.audit)
            .arg(&self.keys.settled)
            .arg(&self.keys.state)
            .arg(&self.keys.dict);
        for c in release {
            inv.arg(&c.key);
        }
        inv.arg(uuid::Uuid::new_v4().simple().to_string());
        let counts: Vec<_> = delta
            .by_field()
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .collect();
        inv.arg(counts.len());
        for (name, n) in counts {
            inv.arg(count_field(name)).arg(n);
        }
        let mut values = Vec::with_capacity(rows.len() * audit::FIELDS.len());
        let defined = match self.sink {
            AuditSink::Redis => {
                let defs = self.encoder.encode(rows, &mut values);
                let fields = audit::definition_fields(&defs);
                inv.arg(fields.len() / 2).arg(fields);
                inv.arg(audit::FIELDS.len()).arg(audit::FIELDS.as_slice());
                defs.from + defs.values.len()
            }
            AuditSink::Log => {
                inv.arg(0).arg(0);
                0
            }
        };
        inv.arg(rows.len()).arg(values);
        let keys = settled.iter().filter(|(f, _)| f.starts_with("key:"));
        let marks = settled.iter().filter(|(f, _)| !f.starts_with("key:"));
        inv.arg(marks.clone().count());
        for (f, v) in marks {
            inv.arg(f).arg(v);
        }
        inv.arg(keys.clone().count());
        for (f, v) in keys {
            inv.arg(f).arg(v);
        }
        inv.arg(release.len());
        for c in release {
            if c.published {
                inv.arg(&c.value).arg(confirmed_claim(&c.value));
            } else {
                inv.arg(&c.value).arg("");
            }
        }
        (inv, defined)
    }
}

/// End claims one key at a time (KEYS[1]): set to ARGV[2] (published) or deleted (ARGV[2] empty:
/// released), only while the key holds this replay's claim ARGV[1].
const END_CLAIM: &str = r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '' then return redis.call('DEL', KEYS[1]) end
redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL')
return 1
"#;

fn end_claim_script() -> &'static redis::Script {
    static SCRIPT: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| redis::Script::new(END_CLAIM))
}

/// End `claims` each with its own one-key script, all sent together (where the commit script
/// cannot reach them: a Cluster).
pub(super) async fn end_claims(con: &mut super::Redis, claims: &[ClaimEnd]) -> Result<(), Error> {
    if claims.is_empty() {
        return Ok(());
    }
    let mut p = redis::pipe();
    for c in claims {
        let confirmed = if c.published {
            confirmed_claim(&c.value)
        } else {
            String::new()
        };
        p.cmd("EVALSHA")
            .arg(end_claim_script().get_hash())
            .arg(1)
            .arg(&c.key)
            .arg(&c.value)
            .arg(confirmed)
            .ignore();
    }
    match p.query_async::<()>(con).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            end_claim_script().prepare_invoke().load_async(con).await?;
            p.query_async::<()>(con).await?;
        }
        answer => answer?,
    }
    Ok(())
}

/// Run a script by its hash, loading it first when Redis does not hold it (a restarted Redis,
/// `SCRIPT FLUSH`), as `ScriptInvocation::invoke_async` does, for a command built by hand.
pub(super) async fn eval<T: redis::FromRedisValue>(
    con: &mut super::Redis,
    script: &redis::Script,
    cmd: &redis::Cmd,
) -> redis::RedisResult<T> {
    match cmd.query_async(con).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            script.prepare_invoke().load_async(con).await?;
            cmd.query_async(con).await
        }
        answer => answer,
    }
}

/// [`eval`] for a pipeline of a script call and then a `WAIT`: the script's answer, and the
/// `WAIT`'s.
async fn eval_pipeline<T: redis::FromRedisValue>(
    con: &mut super::Redis,
    script: &redis::Script,
    p: &redis::Pipeline,
) -> redis::RedisResult<(T, u64)> {
    match p.query_async(con).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            script.prepare_invoke().load_async(con).await?;
            p.query_async(con).await
        }
        answer => answer,
    }
}

/// A count's field in the state hash.
pub(super) fn count_field(name: &str) -> String {
    format!("c:{name}")
}

#[cfg(test)]
mod tests;
