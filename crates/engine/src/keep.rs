//! Leaving a message where it is, on every queue type: move it to the queue's tail.
//!
//! A message a pass does not take (skipped by the selector, held back by a failed canary, a
//! failed publish) and every message `plan` or the canary looks at must stay in the DLQ with
//! its body, properties and headers. Handing it back (nack with requeue, or leaving it unacked
//! until the channel closes) is free on a classic queue, but on a quorum queue every hand-back
//! is a delivery: past the queue's delivery limit (20 by default on RabbitMQ 4) the broker drops
//! the message or dead-letters it onward, so a dry run repeated a few times would empty the DLQ.
//! Holding messages unacked for a whole pass also caps it at 65,535 (the largest prefetch) and
//! ties it to `consumer_timeout`.
//!
//! So a kept message is *moved*: a copy with the same body, properties and headers (`x-death`
//! included; the broker keeps a client-set `x-death` on 3.x and 4.x) is published to the DLQ
//! through the default exchange, its confirm awaited, and only then the original acked. The copy
//! starts with a fresh delivery count, nothing depends on prefetch or `consumer_timeout`, and
//! after a full pass the kept messages stand in their old order. The one field not copied is
//! `x-delivery-count`: the broker writes it on each redelivery from a quorum queue; the copy
//! has not been redelivered. And a `user-id` that is not the replay's own user cannot be
//! published again (the broker refuses it): it moves to the `x-original-user-id` header, as on
//! replayed messages.
//!
//! The crash window (copy confirmed, original not yet acked) would leave two copies that a later
//! replay could both publish. The [`Ledger`] closes it: before the copies are published, each
//! message's digest is counted in a per-queue Redis hash ("this message may exist twice"), and
//! the count is taken back only once the broker has processed the original's ack. A pass that
//! meets, within one traversal, a message whose digest the ledger counts *and* has already met
//! that very message, drops the second one (acks it): one of the two always survives, and
//! nothing is dropped that the ledger does not say may have been doubled.

use crate::amqp::{Channel, Confirm, Connection, Properties, Publishable, TableWriter};
use crate::store::Redis;
use std::collections::{HashMap, HashSet};

use sha2::{Digest, Sha256};

use crate::publish;
use crate::Error;

/// The header a quorum queue adds to a redelivered message; not part of the message itself.
const DELIVERY_COUNT: &str = "x-delivery-count";

/// The properties of a moved copy: everything but the broker's redelivery count, the other
/// headers byte for byte.
pub fn copy_properties(props: &Properties) -> Properties {
    without_count(props).unwrap_or_else(|| props.clone())
}

/// `props` less the redelivery count, or `None` when they hold none (a copy would be `props`).
fn without_count(props: &Properties) -> Option<Properties> {
    props.headers().filter(|h| h.contains(DELIVERY_COUNT))?;
    let w = TableWriter::copy_of(props, 0, |name| name == DELIVERY_COUNT);
    Some(props.with_header_bytes(Some(w.into_bytes())))
}

/// A digest of the whole message as a copy would carry it (properties, headers, body): two
/// messages with the same digest are the same message, one being a leftover copy of the other.
/// It hashes the copy's content header as it would go on the wire (the headers' bytes as they
/// came, less the redelivery count), then the body; it only has to be stable between a crash
/// and the next pass of the same binary version.
pub fn digest(props: &Properties, body: &[u8]) -> String {
    let mut header = Vec::with_capacity(64 + props.header_bytes().map_or(0, <[u8]>::len));
    // Copied only when there is a redelivery count to leave out.
    match without_count(props) {
        Some(copy) => copy.write_header(&mut header, body.len() as u64),
        None => props.write_header(&mut header, body.len() as u64),
    }
    let mut h = Sha256::new();
    h.update(&header);
    h.update([0]);
    h.update(body);
    hex::encode(&h.finalize()[..16])
}

/// The Redis hash that counts, per message digest, the copies that may exist twice in one queue
/// of one broker. A clustered broker is one broker whichever node a run reaches it through: its
/// scope is every endpoint's host and port, sorted, and the vhost.
pub fn ledger_key(amqp_url: &str, queue: &str) -> String {
    let mut hosts = Vec::new();
    let mut vhost = String::new();
    for u in crate::endpoints::split(amqp_url).unwrap_or_default() {
        if let Ok(u) = url::Url::parse(&u) {
            hosts.push(format!(
                "{}:{}",
                u.host_str().unwrap_or(""),
                u.port_or_known_default().unwrap_or(5672)
            ));
            vhost = u.path().to_string();
        }
    }
    hosts.sort();
    hosts.dedup();
    format!("dlq:moves:{}{vhost}/{queue}", hosts.join(","))
}

/// How long a queue's ledger outlives its last write. Its counts are taken back as the moves
/// settle, and the hash goes when the last one is; what a crash leaves is settled by the next
/// traversal of the queue. A queue nobody traverses for this long has its doubts forgotten (a
/// leftover copy would then be replayed like any message: Claim mode still publishes its key
/// once).
pub const LEDGER_TTL_SECONDS: u64 = 30 * 24 * 3600;

/// Take back counts, deleting fields that reach zero. KEYS[1] the hash; ARGV digest, n pairs.
const TAKE_BACK: &str = r#"
for i = 1, #ARGV, 2 do
  if redis.call('HINCRBY', KEYS[1], ARGV[i], -tonumber(ARGV[i + 1])) <= 0 then
    redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return 0
"#;

fn take_back_script() -> &'static redis::Script {
    static SCRIPT: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| redis::Script::new(TAKE_BACK))
}

/// The per-queue record of messages that a crash may have left twice, and one traversal's view
/// of it.
pub struct Ledger {
    con: Redis,
    key: String,
    /// Digests the ledger counted when this traversal began, and how many extra copies each may
    /// still have.
    doubtful: HashMap<String, u32>,
    /// Doubtful digests this traversal has met once already.
    met: HashSet<String>,
}

impl Ledger {
    /// Read the ledger of `queue` as a new traversal of it begins.
    pub async fn open(mut con: Redis, amqp_url: &str, queue: &str) -> Result<Self, Error> {
        let key = ledger_key(amqp_url, queue);
        let all: HashMap<String, i64> = redis::cmd("HGETALL")
            .arg(&key)
            .query_async(&mut con)
            .await?;
        let doubtful = all
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .map(|(d, n)| (d, u32::try_from(n).unwrap_or(u32::MAX)))
            .collect();
        Ok(Self {
            con,
            key,
            doubtful,
            met: HashSet::new(),
        })
    }

    /// Meet a message in this traversal: `None` when the ledger doubts no message of the queue
    /// (no digest is computed then); else its digest and whether it is a leftover copy
    /// ([`Ledger::is_leftover`]).
    pub fn meet(&mut self, props: &Properties, body: &[u8]) -> Option<(String, bool)> {
        if self.doubtful.is_empty() {
            return None;
        }
        let d = digest(props, body);
        let leftover = self.is_leftover(&d);
        Some((d, leftover))
    }

    /// Whether the message with `digest` is a leftover copy of one this traversal already met:
    /// only then may it be dropped (and its count taken back once the drop is acked).
    pub fn is_leftover(&mut self, digest: &str) -> bool {
        let Some(n) = self.doubtful.get_mut(digest) else {
            return false;
        };
        if !self.met.contains(digest) {
            self.met.insert(digest.to_string());
            return false;
        }
        if *n == 0 {
            return false;
        }
        *n -= 1;
        true
    }

    /// Count each digest once more: its message is about to be copied.
    pub async fn intend(&mut self, digests: &[String]) -> Result<(), Error> {
        if digests.is_empty() {
            return Ok(());
        }
        let mut p = redis::pipe();
        for d in digests {
            p.cmd("HINCRBY").arg(&self.key).arg(d).arg(1).ignore();
        }
        p.cmd("EXPIRE")
            .arg(&self.key)
            .arg(LEDGER_TTL_SECONDS)
            .ignore();
        p.query_async::<()>(&mut self.con).await?;
        Ok(())
    }

    /// Take one count back for each digest: its original is acked (and the broker has
    /// processed the ack), or its copy was refused, or it was a leftover that is now dropped.
    pub async fn take_back(&mut self, digests: &[String]) -> Result<(), Error> {
        if digests.is_empty() {
            return Ok(());
        }
        let mut n: HashMap<&str, u32> = HashMap::new();
        for d in digests {
            *n.entry(d.as_str()).or_default() += 1;
        }
        let mut inv = take_back_script().prepare_invoke();
        inv.key(&self.key);
        for (d, k) in n {
            inv.arg(d).arg(k);
        }
        inv.invoke_async::<()>(&mut self.con).await?;
        Ok(())
    }

    /// After a traversal that met every message the queue held when it began: the doubtful
    /// digests it met at most once have no second copy left (and the ones it met twice had
    /// theirs dropped), so their counts from before the traversal are taken back.
    pub async fn resolved(&mut self) -> Result<(), Error> {
        let before: Vec<String> = self
            .doubtful
            .iter()
            .flat_map(|(d, n)| std::iter::repeat_n(d.clone(), *n as usize))
            .collect();
        self.doubtful.clear();
        self.take_back(&before).await
    }
}

/// Publishes the copies of kept messages to the tail of one queue, confirmed.
pub struct Mover {
    channel: Channel,
    user: String,
    queue: String,
}

/// What became of a message to be kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Moved {
    /// The copy is confirmed at the tail: ack the original.
    Copied,
    /// The broker refused the copy (nack, or returned): leave the original unacked; no copy.
    Refused,
    /// The copy's confirm never came (the channel or connection went away): leave the original
    /// unacked; a copy may exist, and the ledger keeps counting it.
    Unknown,
}

impl Mover {
    /// A confirming channel of its own on `conn`, so that a replay publish that closes its
    /// channel (a deleted exchange) does not take the copies with it.
    pub async fn open(conn: &Connection, user: &str, queue: &str) -> Result<Self, Error> {
        let channel = publish::confirming_channel(conn).await?;
        Ok(Self {
            channel,
            user: user.into(),
            queue: queue.into(),
        })
    }

    /// Publish a copy of each message to the queue's tail and wait for every confirm. The
    /// caller has counted their digests in the ledger.
    pub async fn copy(&mut self, messages: &[(&Properties, &[u8])]) -> Result<Vec<Moved>, Error> {
        let sent = self.send(messages).await?;
        Ok(futures::future::join_all(sent.into_iter().map(Copy::moved)).await)
    }

    /// Publish a copy of each message to the queue's tail; the confirms are not awaited (see
    /// [`Copy::moved`]). The caller has counted their digests in the ledger.
    pub async fn send(&mut self, messages: &[(&Properties, &[u8])]) -> Result<Vec<Copy>, Error> {
        if messages.is_empty() {
            return Ok(Vec::new());
        }
        if !self.channel.is_open() {
            // Only a lost connection closes it (the default exchange always exists): the pass
            // ends and the next one starts on new connections.
            return Err(Error::Connection(
                "the channel moving kept messages to the tail closed".into(),
            ));
        }
        // Each publish is queued in order; the writer sends them together.
        let (queue, user) = (self.queue.as_str(), self.user.as_str());
        Ok(messages
            .iter()
            .map(|(props, body)| {
                let props = publish::as_user(copy_properties(props), user);
                match publish::confirmed(self.channel.basic_publish("", queue, true, props, body)) {
                    Ok(confirm) => Copy(Some(confirm)),
                    // Refused before it left: no copy exists.
                    Err(_) => Copy(None),
                }
            })
            .collect())
    }
}

/// A copy on its way to the tail: its confirm, or `None` when it was refused before it left.
pub struct Copy(Option<Confirm>);

impl Copy {
    /// What became of the message, once the broker has answered for its copy.
    pub async fn moved(self) -> Moved {
        let Some(confirm) = self.0 else {
            return Moved::Refused;
        };
        let res = confirm.await;
        let unconfirmed = res.is_err();
        match publish::outcome(res) {
            Ok(()) => Moved::Copied,
            Err(_) if unconfirmed => Moved::Unknown,
            Err(_) => Moved::Refused,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::{AMQPValue, BasicProperties, FieldTable};

    #[test]
    fn the_digest_is_that_of_the_copys_header_and_body() {
        for p in [props(None), props(Some(3)), Properties::default()] {
            let mut header = Vec::new();
            copy_properties(&p).write_header(&mut header, 4);
            let mut h = Sha256::new();
            h.update(&header);
            h.update([0]);
            h.update(b"body");
            let expected = hex::encode(&h.finalize()[..16]);
            assert_eq!(digest(&p, b"body"), expected);
        }
    }

    fn basic(count: Option<i64>) -> BasicProperties {
        let mut h = FieldTable::default();
        h.insert("x-death".into(), AMQPValue::FieldArray(Default::default()));
        h.insert("x-exception-type".into(), AMQPValue::LongString("E".into()));
        if let Some(n) = count {
            h.insert(DELIVERY_COUNT.into(), AMQPValue::LongLongInt(n));
        }
        BasicProperties::default()
            .with_message_id("m1".into())
            .with_headers(h)
    }

    fn props(count: Option<i64>) -> Properties {
        basic(count).into()
    }

    #[test]
    fn a_copy_keeps_every_header_but_the_delivery_count() {
        let p = copy_properties(&props(Some(4))).to_basic();
        let h = p.headers().clone().unwrap();
        assert!(h.contains_key("x-death") && h.contains_key("x-exception-type"));
        assert!(!h.contains_key(DELIVERY_COUNT));
        assert_eq!(copy_properties(&props(None)), props(None));
    }

    #[test]
    fn the_digest_ignores_only_the_delivery_count() {
        assert_eq!(digest(&props(Some(2)), b"x"), digest(&props(None), b"x"));
        assert_ne!(digest(&props(None), b"x"), digest(&props(None), b"y"));
        let other: Properties = basic(None).with_priority(3).into();
        assert_ne!(digest(&other, b"x"), digest(&props(None), b"x"));
    }

    #[test]
    fn the_ledger_key_names_broker_vhost_and_queue_never_credentials() {
        let k = ledger_key("amqp://alice:secret@mq.example:5673/prod", "media.dlq");
        assert_eq!(k, "dlq:moves:mq.example:5673/prod/media.dlq");
    }

    #[tokio::test]
    async fn only_a_second_meeting_of_a_doubtful_message_is_a_leftover() {
        let con = crate::store::connect("redis://127.0.0.1:6379/")
            .await
            .expect("redis");
        let queue = format!("keep-unit-{}", uuid::Uuid::new_v4().simple());
        let url = "amqp://127.0.0.1:5672/%2f";
        let mut l = Ledger::open(con.clone(), url, &queue).await.unwrap();
        l.intend(&["a".into(), "a".into(), "b".into()])
            .await
            .unwrap();
        l.take_back(&["a".into()]).await.unwrap();
        let mut l = Ledger::open(con.clone(), url, &queue).await.unwrap();
        assert!(!l.is_leftover("c"), "never counted: never a leftover");
        assert!(!l.is_leftover("a"), "the first meeting is the message");
        assert!(l.is_leftover("a"), "the second is the leftover copy");
        assert!(!l.is_leftover("a"), "a counted once: only one copy dropped");
        assert!(!l.is_leftover("b"));
        l.take_back(&["a".into()]).await.unwrap();
        l.resolved().await.unwrap();
        let mut con = con;
        let left: HashMap<String, i64> = redis::cmd("HGETALL")
            .arg(ledger_key(url, &queue))
            .query_async(&mut con)
            .await
            .unwrap();
        assert!(left.is_empty(), "{left:?}");
    }
}
