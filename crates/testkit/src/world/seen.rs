//! Messages as they sat in a queue ([`Seen`]), and the assertions made of them.

use std::collections::BTreeMap;

use dlq_replay_api::ReplayStatus;
use dlq_replay_engine::message;
use lapin::message::Delivery;
use lapin::types::FieldTable;
use lapin::BasicProperties;

use crate::fixture;

/// A message as it sat somewhere, for comparisons.
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    pub id: String,
    pub headers: FieldTable,
    pub props: BasicProperties,
    pub body: Vec<u8>,
}

/// The header a quorum queue adds to a message it delivers again (RabbitMQ 3.10 and 4.x).
pub const DELIVERY_COUNT: &str = "x-delivery-count";

/// A delivery as [`Seen`], without `x-delivery-count`: a quorum queue adds that header to every
/// message it hands out again, and raises it each time one is handed back (a [`World::peek`]
/// does so too: basic.get then release). It says how often a message was looked at, not what
/// the message is, so comparisons of what sat in a queue ignore it (in `headers` and `props`
/// alike). Whether the broker dropped a message past its delivery limit shows as the message
/// missing, which comparisons still see. A headers table that held nothing else becomes `None`,
/// as the message carried none before the broker added it.
pub fn seen(d: &Delivery) -> Seen {
    let mut props = d.properties.clone();
    if let Some(h) = d.properties.headers() {
        if h.contains_key(DELIVERY_COUNT) {
            let rest: BTreeMap<_, _> = h
                .inner()
                .iter()
                .filter(|(k, _)| k.as_str() != DELIVERY_COUNT)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            props = if rest.is_empty() {
                clear_headers(props)
            } else {
                props.with_headers(FieldTable::from(rest))
            };
        }
    }
    Seen {
        id: props
            .message_id()
            .as_ref()
            .map(|m| m.to_string())
            .unwrap_or_default(),
        headers: props.headers().clone().unwrap_or_default(),
        props,
        body: d.data.clone(),
    }
}

/// `props` with no headers table at all.
fn clear_headers(props: BasicProperties) -> BasicProperties {
    let mut out = BasicProperties::default();
    macro_rules! copy {
        ($($get:ident => $with:ident),+) => {
            $(if let Some(v) = props.$get() { out = out.$with(v.clone()); })+
        };
    }
    copy!(
        content_type => with_content_type,
        content_encoding => with_content_encoding,
        delivery_mode => with_delivery_mode,
        priority => with_priority,
        correlation_id => with_correlation_id,
        reply_to => with_reply_to,
        expiration => with_expiration,
        message_id => with_message_id,
        timestamp => with_timestamp,
        kind => with_type,
        user_id => with_user_id,
        app_id => with_app_id,
        cluster_id => with_cluster_id
    );
    out
}

pub fn header(s: &Seen, name: &str) -> Option<String> {
    s.headers.inner().get(name).and_then(message::value_text)
}

pub fn ids(v: &[Seen]) -> Vec<String> {
    v.iter().map(|s| s.id.clone()).collect()
}

pub fn by_id(v: &[Seen]) -> BTreeMap<String, Seen> {
    v.iter().map(|s| (s.id.clone(), s.clone())).collect()
}

/// A job with a JSON body `{"id": id, ...extra}`.
pub fn job(id: &str, extra: serde_json::Value) -> (BasicProperties, Vec<u8>) {
    let mut body = serde_json::json!({"id": id});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    fixture::job(id, body, "TimeoutError")
}

/// Every message of the target carries an idempotency key, and no key is there twice.
pub fn assert_each_key_once(target: &[Seen]) {
    let keys: std::collections::BTreeSet<String> = target
        .iter()
        .filter_map(|m| header(m, "x-idempotency-key"))
        .collect();
    assert_eq!(
        keys.len(),
        target.len(),
        "a key was published twice (or a message has no key)"
    );
}

pub fn assert_sum(status: &ReplayStatus) {
    let c = status.counts;
    assert_eq!(
        c.scanned,
        c.replayed + c.duplicates + c.quarantined + c.skipped + c.failed,
        "{c:?}"
    );
}
