//! Reading what RabbitMQ put on a dead-lettered message: its deaths, its headers, its identity.
//!
//! Pure functions of (properties, body); no I/O.

use crate::amqp::{AMQPValue, Properties, Table, Value};
use sha2::{Digest, Sha256};
use std::borrow::Cow;

/// Header carrying the id of the replay that published a message.
pub const REPLAY_ID: &str = "x-replay-id";
/// Header carrying how many times replays have published a message.
pub const REPLAY_COUNT: &str = "x-replay-count";
/// Header carrying the idempotency key a replay derived.
pub const IDEMPOTENCY_KEY: &str = "x-idempotency-key";
/// Header telling why a message was quarantined.
pub const QUARANTINE_REASON: &str = "x-quarantine-reason";
/// Header keeping a `user-id` property that the replay's connection could not assert.
pub const ORIGINAL_USER_ID: &str = "x-original-user-id";

/// One entry of the `x-death` header, read in place (every message's deaths are read: text
/// fields borrow from the header where they are UTF-8 already).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Death<'a> {
    /// The queue the message died in.
    pub queue: Cow<'a, str>,
    /// `rejected`, `expired`, `maxlen` or `delivery_limit`.
    pub reason: Cow<'a, str>,
    /// How many times it died this way in this queue.
    pub count: u64,
    /// The exchange it had been published to.
    pub exchange: Cow<'a, str>,
    /// The routing keys it had been published with.
    pub routing_keys: Vec<Cow<'a, str>>,
}

/// The headers of a message, read in place.
pub fn headers(props: &Properties) -> Option<Table<'_>> {
    props.headers()
}

/// A header's value as text, for the header types a human would match on.
pub fn header_text(props: &Properties, name: &str) -> Option<String> {
    header_str(props, name).map(Cow::into_owned)
}

/// The text form of a scalar AMQP value (amq-protocol's type); tables, arrays and void have
/// none.
pub fn value_text(v: &AMQPValue) -> Option<String> {
    value_str(v).map(Cow::into_owned)
}

/// [`value_text`], borrowed from the value where it is text already.
pub fn value_str(v: &AMQPValue) -> Option<Cow<'_, str>> {
    Some(match v {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()),
        AMQPValue::ShortString(s) => Cow::Borrowed(s.as_str()),
        AMQPValue::Boolean(b) => Cow::Owned(b.to_string()),
        AMQPValue::ByteArray(b) => String::from_utf8_lossy(b.as_slice()),
        AMQPValue::Timestamp(t) => Cow::Owned(t.to_string()),
        other => Cow::Owned(value_int(other)?.to_string()),
    })
}

/// A header's text, borrowed from the header where it is UTF-8 text already (the common
/// case), so that reading a header allocates nothing.
pub fn header_str<'a>(props: &'a Properties, name: &str) -> Option<Cow<'a, str>> {
    headers(props)?.get(name).and_then(Value::as_str)
}

/// A text field of the most recent `x-death` entry (the first of [`deaths`]), borrowed:
/// `None` when there is no readable entry, "" when the entry lacks the field.
pub fn first_death_str<'a>(props: &'a Properties, field: &str) -> Option<Cow<'a, str>> {
    death_tables(props)
        .next()
        .map(|t| t.get(field).and_then(Value::as_str).unwrap_or_default())
}

/// The readable `x-death` entries (tables), most recent first: what every reading of the deaths
/// walks. Malformed entries are skipped.
fn death_tables(props: &Properties) -> impl Iterator<Item = Table<'_>> {
    let entries = match headers(props).and_then(|h| h.get("x-death")) {
        Some(Value::Array(entries)) => Some(entries.iter()),
        _ => None,
    };
    entries.into_iter().flatten().filter_map(|e| match e {
        Value::Table(t) => Some(t),
        _ => None,
    })
}

/// The integer value of any AMQP integer type (amq-protocol's type).
pub fn value_int(v: &AMQPValue) -> Option<i128> {
    Some(match v {
        AMQPValue::ShortShortInt(n) => (*n).into(),
        AMQPValue::ShortShortUInt(n) => (*n).into(),
        AMQPValue::ShortInt(n) => (*n).into(),
        AMQPValue::ShortUInt(n) => (*n).into(),
        AMQPValue::LongInt(n) => (*n).into(),
        AMQPValue::LongUInt(n) => (*n).into(),
        AMQPValue::LongLongInt(n) => (*n).into(),
        AMQPValue::Timestamp(n) => (*n).into(),
        _ => return None,
    })
}

/// The `x-death` entries, most recent first (as RabbitMQ orders them). Malformed entries are
/// skipped rather than failing the message: a death we cannot read is a death we do not count.
pub fn deaths(props: &Properties) -> Vec<Death<'_>> {
    death_tables(props).map(death).collect()
}

fn death(t: Table<'_>) -> Death<'_> {
    let text = |k: &str| t.get(k).and_then(Value::as_str).unwrap_or_default();
    let routing_keys = match t.get("routing-keys") {
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    Death {
        queue: text("queue"),
        reason: text("reason"),
        count: t
            .get("count")
            .and_then(Value::as_int)
            .map_or(1, |n| n.clamp(0, u64::MAX.into()) as u64),
        exchange: text("exchange"),
        routing_keys,
    }
}

/// How many times replays have published this message already.
pub fn replay_count(props: &Properties) -> u64 {
    headers(props)
        .and_then(|h| h.get(REPLAY_COUNT))
        .and_then(|v| v.as_int().or_else(|| v.as_str()?.parse().ok()))
        .map_or(0, |n| n.clamp(0, u64::MAX.into()) as u64)
}

/// Dead-letterings so far: every `x-death` count plus the replays that sent it back.
pub fn death_count(props: &Properties) -> u64 {
    death_count_of(&deaths(props), props)
}

/// [`death_count`] for deaths already read.
pub fn death_count_of(deaths: &[Death], props: &Properties) -> u64 {
    deaths
        .iter()
        .map(|d| d.count)
        .fold(replay_count(props), u64::saturating_add)
}

/// A stable name for the message in audit rows: its `message-id`, else a hash of its body.
pub fn identity(props: &Properties, body: &[u8]) -> String {
    match props.basic().message_id() {
        Some(id) if !id.as_str().is_empty() => id.as_str().to_owned(),
        _ => short_hex("sha256:", &Sha256::digest(body)),
    }
}

/// A fingerprint of the message itself (message id and body), to recognise the very same message
/// when a crash made the broker deliver it again.
pub fn fingerprint(props: &Properties, body: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(
        props
            .basic()
            .message_id()
            .as_ref()
            .map_or("", |m| m.as_str())
            .as_bytes(),
    );
    h.update([0]);
    h.update(body);
    short_hex("m:", &h.finalize())
}

/// `prefix` and the first 16 bytes of `digest` in lowercase hex (32 characters), in one
/// allocation: the names of messages and keys, made for every message.
pub(crate) fn short_hex(prefix: &str, digest: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(prefix.len() + 32);
    out.push_str(prefix);
    for b in digest.iter().take(16) {
        out.push(HEX[usize::from(b >> 4)] as char);
        out.push(HEX[usize::from(b & 0xf)] as char);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::{BasicProperties, FieldArray, FieldTable, LongString};

    #[test]
    fn short_hex_is_the_first_32_hex_digits_after_the_prefix() {
        let d = Sha256::digest(b"body");
        assert_eq!(short_hex("m:", &d), format!("m:{}", &hex::encode(d)[..32]));
    }

    fn with_death(count: AMQPValue) -> Properties {
        let mut d = FieldTable::default();
        d.insert("queue".into(), AMQPValue::LongString("work".into()));
        d.insert("reason".into(), AMQPValue::LongString("rejected".into()));
        d.insert("count".into(), count);
        d.insert("exchange".into(), AMQPValue::LongString("jobs".into()));
        let mut keys = FieldArray::default();
        keys.push(AMQPValue::LongString(LongString::from("job.run")));
        d.insert("routing-keys".into(), AMQPValue::FieldArray(keys));
        let mut arr = FieldArray::default();
        arr.push(AMQPValue::FieldTable(d));
        let mut h = FieldTable::default();
        h.insert("x-death".into(), AMQPValue::FieldArray(arr));
        h.insert(REPLAY_COUNT.into(), AMQPValue::LongInt(2));
        BasicProperties::default().with_headers(h).into()
    }

    #[test]
    fn reads_the_most_recent_death_and_sums_counts_with_replays() {
        let p = with_death(AMQPValue::LongLongInt(3));
        let d = deaths(&p);
        assert_eq!(d[0].queue, "work");
        assert_eq!(d[0].routing_keys, vec!["job.run"]);
        assert_eq!(death_count(&p), 5);
    }

    #[test]
    fn the_first_death_read_in_place_is_that_of_deaths() {
        let p = with_death(AMQPValue::LongLongInt(3));
        let first = deaths(&p).into_iter().next().expect("a death");
        assert_eq!(
            first_death_str(&p, "queue").as_deref(),
            Some(first.queue.as_ref())
        );
        assert_eq!(
            first_death_str(&p, "reason").as_deref(),
            Some(first.reason.as_ref())
        );
        let none = Properties::default();
        assert_eq!(first_death_str(&none, "queue"), None);
    }

    #[test]
    fn a_negative_or_odd_count_does_not_panic() {
        let p = with_death(AMQPValue::LongInt(-7));
        assert_eq!(death_count(&p), 2);
        let p = with_death(AMQPValue::Void);
        assert_eq!(death_count(&p), 3);
    }

    #[test]
    fn identity_prefers_message_id() {
        let p = BasicProperties::default()
            .with_message_id("m-1".into())
            .into();
        assert_eq!(identity(&p, b"x"), "m-1");
        let id = identity(&Properties::default(), b"x");
        assert!(id.starts_with("sha256:") && id.len() == 39, "{id}");
    }
}
