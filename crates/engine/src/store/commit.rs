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
const COMMIT: &str = r#"
-- Written for Redis's Lua 5.1, where the per-call and per-table costs are the commit's: ARGV is
-- read by index (no closure call per argument), each command's table is built once with its
-- arguments in place (no second table to copy it into, no table per audit row), and what the
-- script needs of ARGV later (the deltas, the `key:` marks) is read there again, not copied.
-- That took the script from about 200 to 155 us a step of 16 (bench/RESULTS.md).
local audit, settled, state, dict = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local A = ARGV
local i = 2
local nd = tonumber(A[i])
i = i + 1
local dfrom = i
local ask = {'HMGET', state, 'commit', 'records'}
for d = 1, nd do
  ask[d + 4] = A[i]
  i = i + 2
end
local cur = redis.call(unpack(ask))
if cur[1] == A[1] then
  -- A retry of a commit that went through: which sink it wrote to does not matter here.
  local len = redis.call('XLEN', audit)
  return {len > 0 and len or tonumber(cur[2] or '0'), 0, 0}
end
-- A command of `head` and then `n` arguments of ARGV from `i` on, in chunks of 1,000 (for
-- unpack); array replies are joined in order (a missing value is `false`, so none is skipped).
-- `stride` 2 takes every other argument (the fields of field/value pairs).
local function chunked(head, n, stride)
  local out = {}
  for from = 0, n - 1, 1000 do
    local args = {unpack(head)}
    local o = #args
    for j = from, math.min(from + 999, n - 1) do
      args[o + 1 + j - from] = A[i + j * stride]
    end
    local got = redis.call(unpack(args))
    if type(got) == 'table' then
      for _, v in ipairs(got) do out[#out + 1] = v end
    end
  end
  return out
end
local ndict = tonumber(A[i])
i = i + 1
if ndict > 0 then
  chunked({'HSET', dict}, 2 * ndict, 1)
  i = i + 2 * ndict
end
-- The rows: one XADD table, its field names set once and its values overwritten per row.
local nfields = tonumber(A[i])
i = i + 1
local xadd = {'XADD', audit, '*'}
for f = 1, nfields do
  xadd[2 + 2 * f] = A[i]
  i = i + 1
end
local nrows = tonumber(A[i])
i = i + 1
if nfields > 0 then
  for _ = 1, nrows do
    for f = 1, nfields do
      xadd[3 + 2 * f] = A[i]
      i = i + 1
    end
    redis.call(unpack(xadd))
  end
end
-- The settled marks and the new `key:` marks go out in one HSET. `key:` marks are set only where
-- none exists (the first message of the batch to publish a key keeps it); those that existed
-- already, or came twice in the batch, are counted.
local nm = tonumber(A[i])
i = i + 1
local marks = {}
for j = 1, 2 * nm do
  marks[j] = A[i]
  i = i + 1
end
local again = 0
local nkeys = tonumber(A[i])
i = i + 1
if nkeys > 0 then
  local had = chunked({'HMGET', settled}, nkeys, 2)
  local seen = {}
  local m = #marks
  for k = 0, nkeys - 1 do
    local f = A[i + 2 * k]
    if had[k + 1] or seen[f] then
      again = again + 1
    else
      seen[f] = true
      marks[m + 1] = f
      marks[m + 2] = A[i + 2 * k + 1]
      m = m + 2
    end
  end
  i = i + 2 * nkeys
end
for from = 1, #marks, 1000 do
  local args = {'HSET', settled}
  for j = from, math.min(from + 999, #marks) do args[j - from + 3] = marks[j] end
  redis.call(unpack(args))
end
-- Ended claims: one MGET for all, then each of ours set (published) or deleted (released).
local nclaims = tonumber(A[i])
i = i + 1
if nclaims > 0 then
  -- The value each key holds as the claims are ended one after the other (a key ended twice
  -- sees what the first end left).
  local now = {}
  for from = 1, nclaims, 1000 do
    local args = {'MGET'}
    local to = math.min(from + 999, nclaims)
    for k = from, to do args[k - from + 2] = KEYS[4 + k] end
    local got = redis.call(unpack(args))
    for k = from, to do now[KEYS[4 + k]] = got[k - from + 1] end
  end
  local released = {}
  for k = 1, nclaims do
    local key, value, confirmed = KEYS[4 + k], A[i], A[i + 1]
    i = i + 2
    if now[key] == value then
      if confirmed == '' then
        released[#released + 1] = key
        now[key] = false
      else
        redis.call('SET', key, confirmed, 'KEEPTTL')
        now[key] = confirmed
      end
    end
  end
  for from = 1, #released, 1000 do
    redis.call('DEL', unpack(released, from, math.min(from + 999, #released)))
  end
end
-- The state, written once: the commit id, the counts with their deltas added, and the rows
-- kept in the log (the stream counts its own).
local records = tonumber(cur[2] or '0')
local write = {'HSET', state, 'commit', A[1]}
if nfields == 0 then
  records = records + nrows
  write[#write + 1] = 'records'
  write[#write + 1] = records
else
  records = redis.call('XLEN', audit)
end
for d = 1, nd do
  local at = dfrom + 2 * (d - 1)
  write[#write + 1] = A[at]
  write[#write + 1] = tonumber(cur[2 + d] or '0') + tonumber(A[at + 1])
end
redis.call(unpack(write))
return {records, again, 1}
"#;

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
mod tests {
    //! Against the real Redis (REDIS_URL, else the local one), under keys of their own.
    use super::*;
    use crate::store::testing::*;
    use std::collections::HashMap;

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
    async fn counts_add_up_over_commits_and_a_key_marked_before_is_counted_again() {
        let mut s = store("counts").await;
        let d = |replayed, failed| Counts {
            replayed,
            failed,
            ..Default::default()
        };
        let marks = |k: &str| {
            vec![
                (format!("fp-{k}"), "replayed".to_string()),
                (crate::store::key_field(k), "replayed".to_string()),
            ]
        };
        let first = s.commit(&[row("a")], &marks("k1"), &[], &d(3, 0)).await;
        assert_eq!(first.expect("first"), (1, 0));
        // k1 was marked by the first commit; k2 comes twice in this one: both count again.
        let mut second = marks("k1");
        second.extend(marks("k2"));
        second.extend(marks("k2"));
        let (len, again) = s
            .commit(&[row("b"), row("c")], &second, &[], &d(4, 1))
            .await
            .expect("second");
        assert_eq!((len, again), (3, 2));
        let state: HashMap<String, String> = redis::cmd("HGETALL")
            .arg(&s.keys().state)
            .query_async(&mut s.con)
            .await
            .expect("state");
        assert_eq!(state.get("c:replayed").map(String::as_str), Some("7"));
        assert_eq!(state.get("c:failed").map(String::as_str), Some("1"));
        let settled: HashMap<String, String> = redis::cmd("HGETALL")
            .arg(&s.keys().settled)
            .query_async(&mut s.con)
            .await
            .expect("settled");
        for f in ["fp-k1", "key:k1", "fp-k2", "key:k2"] {
            assert_eq!(settled.get(f).map(String::as_str), Some("replayed"), "{f}");
        }
        cleanup(&mut s, &[]).await;
    }

    #[tokio::test]
    async fn a_commit_larger_than_one_chunk_writes_every_row_mark_and_claim_end() {
        // Past the script's chunks of 1,000 arguments: every settled mark, `key:` mark and claim
        // end is applied once, and the first `key:` mark of a key is the one kept.
        let mut s = store("chunks").await;
        let mut con = s.redis();
        let id = uuid::Uuid::new_v4().simple().to_string();
        let mine = format!("{id}/1");
        let n = 1_500;
        let claim = |i: usize| format!("test:chunks:{id}:{i}");
        let mut p = redis::pipe();
        for i in 0..n {
            p.cmd("SET")
                .arg(claim(i))
                .arg(&mine)
                .arg("EX")
                .arg(60)
                .ignore();
        }
        p.query_async::<()>(&mut con).await.unwrap();
        let rows: Vec<AuditRow> = (0..n).map(|i| row(&format!("m{i}"))).collect();
        let mut marks: Vec<(String, String)> = (0..n)
            .map(|i| (format!("fp-{i}"), "replayed".to_string()))
            .collect();
        marks.extend((0..n).map(|i| (crate::store::key_field(&format!("k{i}")), format!("m{i}"))));
        // k0 comes again at the end: counted, and its first mark kept.
        marks.push((crate::store::key_field("k0"), "late".into()));
        let ends: Vec<ClaimEnd> = (0..n)
            .map(|i| ClaimEnd {
                key: claim(i),
                value: mine.clone(),
                published: i % 2 == 0,
            })
            .collect();
        let delta = Counts {
            replayed: n as u64,
            ..Default::default()
        };
        let (len, again) = s.commit(&rows, &marks, &ends, &delta).await.unwrap();
        assert_eq!((len, again), (n as u64, 1));
        let settled: HashMap<String, String> = redis::cmd("HGETALL")
            .arg(&s.keys().settled)
            .query_async(&mut s.con)
            .await
            .unwrap();
        assert_eq!(settled.len(), 2 * n);
        assert_eq!(settled.get("key:k0").map(String::as_str), Some("m0"));
        assert_eq!(
            settled.get(&format!("key:k{}", n - 1)).map(String::as_str),
            Some(&*format!("m{}", n - 1))
        );
        assert_eq!(
            settled.get(&format!("fp-{}", n - 1)).map(String::as_str),
            Some("replayed")
        );
        let keys: Vec<String> = (0..n).map(claim).collect();
        let values: Vec<Option<String>> = redis::cmd("MGET")
            .arg(&keys)
            .query_async(&mut con)
            .await
            .unwrap();
        for (i, v) in values.iter().enumerate() {
            let want = (i % 2 == 0).then(|| confirmed_claim(&mine));
            assert_eq!(v, &want, "claim {i}");
        }
        let mut p = redis::pipe();
        for k in &keys {
            p.cmd("DEL").arg(k).ignore();
        }
        p.query_async::<()>(&mut con).await.unwrap();
        cleanup(&mut s, &[]).await;
    }

    #[tokio::test]
    async fn a_commit_loads_its_script_again_when_redis_lost_it() {
        let mut s = store("noscript").await;
        // What a restarted Redis (or SCRIPT FLUSH) leaves: no script cached. Other tests
        // running meanwhile reload theirs the same way.
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut s.con)
            .await
            .expect("flush");
        let (len, _) = s
            .commit(&[row("a")], &[], &[], &Counts::default())
            .await
            .expect("commit after a flush");
        assert_eq!(len, 1);
        cleanup(&mut s, &[]).await;
    }

    #[tokio::test]
    async fn rows_written_to_the_log_are_counted_in_the_state() {
        let mut s = store("log-records").await;
        s.sink = AuditSink::Log;
        let (len, _) = s
            .commit(&[row("a"), row("b")], &[], &[], &Counts::default())
            .await
            .expect("first");
        assert_eq!(len, 2);
        let (len, _) = s
            .commit(&[row("c")], &[], &[], &Counts::default())
            .await
            .expect("second");
        assert_eq!(len, 3);
        let (inv, _) = s.commit_invocation(&[row("d")], &[], &[], &Counts::default());
        let first: Vec<u64> = eval(&mut s.con, commit_script(), &inv)
            .await
            .expect("third");
        let again: Vec<u64> = eval(&mut s.con, commit_script(), &inv)
            .await
            .expect("again");
        assert_eq!(first, vec![4, 0, 1]);
        assert_eq!(again, vec![4, 0, 0], "a retry counts nothing twice");
        let exists: bool = redis::cmd("EXISTS")
            .arg(&s.keys().audit)
            .query_async(&mut s.con)
            .await
            .expect("exists");
        assert!(
            !exists,
            "rows sent to the log are not written to the stream"
        );
        cleanup(&mut s, &[]).await;
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
        let (inv, _) = s.commit_invocation(&[row("a"), row("b")], &settled, &[], &delta);
        let first: Vec<u64> = eval(&mut s.con, commit_script(), &inv)
            .await
            .expect("first");
        // The same invocation again, as a retry after a timed-out answer sends it.
        let again: Vec<u64> = eval(&mut s.con, commit_script(), &inv)
            .await
            .expect("again");
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
}
