//! The gate's one round trip per batch: the settled marks of its messages and the values (or
//! claims) of their idempotency keys.

use redis::Value;

use super::{ClaimEnd, Retries, Store};

/// The settled-marks field that says an idempotency key was published by this replay (its value:
/// the identity of the message that published it).
pub fn key_field(key: &str) -> String {
    let mut f = String::with_capacity(4 + key.len());
    f.push_str("key:");
    f.push_str(key);
    f
}
use crate::Error;

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

impl Store {
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

    /// Delete the claims of `mine` on `keys` that this attempt did not publish (no `key:` mark
    /// in the settled hash). The marks are read first, then each claim is ended on its own: a
    /// script may not touch the workers' keys and the replay's together in a Cluster, and only
    /// this replay writes its marks, so nothing changes them in between.
    async fn hand_back(&mut self, keys: &[Option<&str>], mine: &str) -> Result<(), Error> {
        let keys: Vec<&str> = keys.iter().flatten().copied().collect();
        if keys.is_empty() {
            return Ok(());
        }
        let mut hm = redis::cmd("HMGET");
        hm.arg(&self.keys.settled);
        for key in &keys {
            hm.arg(key_field(key));
        }
        let marks: Vec<Option<String>> = hm.query_async(&mut self.con).await?;
        let unpublished: Vec<ClaimEnd> = keys
            .iter()
            .zip(marks)
            .filter(|(_, mark)| mark.is_none())
            .map(|(key, _)| ClaimEnd {
                key: key.to_string(),
                value: mine.to_string(),
                published: false,
            })
            .collect();
        super::commit::end_claims(&mut self.con, &unpublished).await
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
        // Claims first (one SET NX each), then every key's value in one MGET.
        let asked: Vec<&str> = keys.iter().flatten().copied().collect();
        if let Some((value, ttl)) = claim {
            for key in &asked {
                p.cmd("SET")
                    .arg(*key)
                    .arg(value)
                    .arg("NX")
                    .arg("EX")
                    .arg(ttl);
            }
        }
        // In a Cluster the commands of a pipeline go out one by one, each to its node: the
        // values are read once the claims are answered, as they are in one pipeline elsewhere.
        let apart = claim.is_some() && !self.con.spans_slots();
        if !asked.is_empty() && !apart {
            p.cmd("MGET").arg(&asked);
        }
        // A claim only the master holds is lost with it in a failover: nothing is published under
        // it before the replicas hold it too (a WAIT in the same round trip where it can be).
        let inline = claim.and(self.con.inline_wait());
        let waits = inline.is_some();
        if let Some(wait) = inline {
            p.add_command(wait);
        }
        let mut values: Vec<Value> = p.query_async(&mut self.con).await?;
        if waits {
            let got = values.pop().unwrap_or(Value::Nil);
            self.con.enough(redis::from_redis_value(got)?)?;
        }
        if !asked.is_empty() && apart {
            values.push(
                redis::cmd("MGET")
                    .arg(&asked)
                    .query_async(&mut self.con)
                    .await?,
            );
        }
        if claim.is_some() && !waits {
            self.con.replicated(&asked).await?;
        }
        let mut it = values.into_iter();
        let settled: Vec<Option<String>> =
            redis::from_redis_value(it.next().unwrap_or(Value::Nil))?;
        let claimed: Vec<bool> = match claim {
            Some(_) => (&mut it)
                .take(asked.len())
                .map(|v| matches!(v, Value::Okay | Value::SimpleString(_)))
                .collect(),
            None => Vec::new(),
        };
        let mut current: Vec<Option<String>> = if asked.is_empty() {
            Vec::new()
        } else {
            redis::from_redis_value(it.next().unwrap_or(Value::Nil))?
        };
        let mut settled = settled.into_iter();
        let mut next_key = 0;
        let mut out = Vec::with_capacity(fields.len());
        for (i, key) in keys.iter().enumerate() {
            let (fp, key_mark) = (settled.next().flatten(), settled.next().flatten());
            let mut l = Lookup {
                settled: fp,
                key_replayed: fields[i].1.and(key_mark),
                ..Default::default()
            };
            if key.is_some() {
                l.claimed = claimed.get(next_key).copied().unwrap_or(false);
                l.value = current.get_mut(next_key).and_then(Option::take);
                next_key += 1;
            }
            out.push(l);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    //! Against the real Redis (REDIS_URL, else the local one), under keys of their own.
    use crate::store::testing::*;

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
            .arg(super::key_field(&published))
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
