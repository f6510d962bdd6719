//! The selector and the poison gate: pure functions of (properties, headers, body).
//!
//! Kept free of I/O so every rule is unit-tested and fuzzable, and `plan` and `run` decide alike.

use crate::amqp::Properties;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::borrow::Cow;

use crate::key;
use crate::message::{self, Death, REPLAY_ID};
use crate::spec::{DlqReplaySpec, KeySpec, PayloadMatch, PoisonSpec, SelectorSpec};

/// Why a message stays in the dead-letter queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SkipReason {
    /// It does not match the selector.
    NotSelected(String),
    /// It was published by this replay and died again.
    Returned,
}

/// What the pure rules say about a message, before the idempotency store is asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Leave it in the dead-letter queue.
    Skip(SkipReason),
    /// Quarantine it, with the reason.
    Poison(String),
    /// Replay it (if the idempotency store agrees) to this destination.
    Replay {
        /// The idempotency key, when the spec defines one.
        key: Option<String>,
        /// Exchange and routing key.
        destination: Destination,
    },
}

/// Where a message is published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    /// The exchange (`""` is the default exchange).
    pub exchange: String,
    /// The routing key.
    pub routing_key: String,
}

impl Destination {
    /// `exchange/routing_key`, as audit rows name it.
    pub fn label(&self) -> String {
        let mut s = String::with_capacity(self.exchange.len() + 1 + self.routing_key.len());
        s.push_str(&self.exchange);
        s.push('/');
        s.push_str(&self.routing_key);
        s
    }
}

/// The rules of one replay, borrowed from its spec.
#[derive(Debug, Clone, Copy)]
pub struct Rules<'a> {
    /// The selector.
    pub selector: &'a SelectorSpec,
    /// The poison gate.
    pub poison: &'a PoisonSpec,
    /// The idempotency key, if any.
    pub key: Option<&'a KeySpec>,
    /// Target overrides.
    pub target: &'a crate::spec::TargetSpec,
    /// The header naming a failure signature.
    pub signature_header: &'a str,
    /// This replay's id, to recognise its own messages coming back.
    pub replay_id: &'a str,
}

impl<'a> Rules<'a> {
    /// The rules of a spec.
    pub fn of(spec: &'a DlqReplaySpec, replay_id: &'a str) -> Self {
        Self {
            selector: &spec.selector,
            poison: &spec.poison,
            key: spec.idempotency.as_ref().map(|i| &i.key),
            target: &spec.target,
            signature_header: &spec.canary.signature_header,
            replay_id,
        }
    }

    /// Whether a rule other than the key reads the body: only then is the whole body parsed
    /// into a document; the key alone takes the values its pointers name ([`key::derive_body`]).
    fn needs_document(&self) -> bool {
        !self.selector.payload.is_empty()
            || !self.poison.required_fields.is_empty()
            || !self.poison.json_fields.is_empty()
    }
}

/// Decide a message by the pure rules: select, then the poison gate, then derive its key.
pub fn classify(rules: &Rules<'_>, props: &Properties, body: &[u8]) -> Verdict {
    if message::header_text(props, REPLAY_ID).as_deref() == Some(rules.replay_id) {
        return Verdict::Skip(SkipReason::Returned);
    }
    // Parse once; `None` when the body is not JSON (which only matters to rules that need it).
    let json: Option<Value> = if rules.needs_document() {
        serde_json::from_slice(body).ok()
    } else {
        None
    };
    // Read x-death once: the selector, the poison gate and the destination all need it.
    let deaths = message::deaths(props);
    if let Some(why) = unselected(rules.selector, props, deaths.first(), json.as_ref()) {
        return Verdict::Skip(SkipReason::NotSelected(why));
    }
    if let Some(reason) = poison(rules, props, &deaths, body, json.as_ref()) {
        return Verdict::Poison(reason);
    }
    let derived = match (rules.key, &json) {
        (None, _) => None,
        (Some(spec), None) if !rules.needs_document() => Some(key::derive_body(spec, body)),
        (Some(_), None) => Some(None),
        (Some(spec), Some(v)) => Some(Some(key::derive(spec, v))),
    };
    let key = match derived {
        None => None,
        Some(None) => return Verdict::Poison(not_json(body)),
        Some(Some(Ok(k))) => Some(k),
        Some(Some(Err(e))) => return Verdict::Poison(e.to_string()),
    };
    match destination(rules.target, deaths.first()) {
        Some(destination) => Verdict::Replay { key, destination },
        None => Verdict::Poison(
            "NoDestination: no x-death entry names the original exchange; set spec.target".into(),
        ),
    }
}

/// Why a message is not selected, or `None` when it is.
fn unselected(
    sel: &SelectorSpec,
    props: &Properties,
    last: Option<&Death>,
    json: Option<&Value>,
) -> Option<String> {
    if !sel.death_reasons.is_empty() {
        let reason = last.map(|d| d.reason.as_ref()).unwrap_or("");
        if !sel.death_reasons.iter().any(|r| r == reason) {
            return Some(format!(
                "death reason {reason:?} not in selector.deathReasons"
            ));
        }
    }
    if !sel.original_queues.is_empty() {
        let queue = last.map(|d| d.queue.as_ref()).unwrap_or("");
        if !sel.original_queues.iter().any(|q| q == queue) {
            return Some(format!("queue {queue:?} not in selector.originalQueues"));
        }
    }
    for (name, want) in &sel.headers {
        if message::header_text(props, name).as_deref() != Some(want.as_str()) {
            return Some(format!("header {name} is not {want:?}"));
        }
    }
    for m in &sel.payload {
        if !payload_matches(m, json) {
            return Some(format!("payload {} does not match", m.pointer));
        }
    }
    None
}

fn payload_matches(m: &PayloadMatch, json: Option<&Value>) -> bool {
    let Some(text) = json
        .and_then(|j| j.pointer(&m.pointer))
        .and_then(key::field_text)
    else {
        return false;
    };
    m.equals.as_ref().is_none_or(|e| *e == text)
        && m.in_.as_ref().is_none_or(|set| set.contains(&text))
}

/// The poison reason, or `None` for a healthy message.
fn poison(
    rules: &Rules<'_>,
    props: &Properties,
    deaths: &[Death],
    body: &[u8],
    json: Option<&Value>,
) -> Option<String> {
    let p = rules.poison;
    if let Some(max) = p.max_death_count {
        let n = message::death_count_of(deaths, props);
        if n > max {
            return Some(format!(
                "MaxDeathCount: died {n} times, more than maxDeathCount {max}"
            ));
        }
    }
    if p.required_fields.is_empty() && p.json_fields.is_empty() {
        return None;
    }
    let Some(json) = json else {
        return Some(not_json(body));
    };
    if let Some(missing) = p
        .required_fields
        .iter()
        .find(|f| json.pointer(f).is_none_or(Value::is_null))
    {
        return Some(format!("MissingField: required field {missing} is missing"));
    }
    p.json_fields
        .iter()
        .find(|f| !holds_json(json.pointer(f)))
        .map(|f| format!("InvalidJson: field {f} is not JSON"))
}

fn holds_json(v: Option<&Value>) -> bool {
    match v {
        Some(Value::Object(_) | Value::Array(_)) => true,
        Some(Value::String(s)) => serde_json::from_str::<Value>(s).is_ok(),
        _ => false,
    }
}

fn not_json(body: &[u8]) -> String {
    match std::str::from_utf8(body) {
        _ if body.is_empty() => "NotJson: body is empty".into(),
        Err(_) => format!(
            "NotJson: body is {} bytes of binary (not UTF-8)",
            body.len()
        ),
        // serde_json's message names the place and the problem (e.g. nesting past its 128
        // levels), never the body's content.
        Ok(text) => format!(
            "NotJson: body is {} bytes of text that is not JSON ({})",
            body.len(),
            serde_json::from_str::<Value>(text)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_else(|| "unreadable".into())
        ),
    }
}

/// The destination of a replayed message: the overrides, else its most recent death's origin.
pub fn destination(target: &crate::spec::TargetSpec, last: Option<&Death>) -> Option<Destination> {
    let exchange = target
        .exchange
        .clone()
        .or_else(|| last.map(|d| d.exchange.to_string()))?;
    let routing_key = target.routing_key.clone().or_else(|| {
        last.and_then(|d| d.routing_keys.first())
            .map(|k| k.to_string())
    })?;
    // AMQP short strings: a longer name cannot be published to, whatever a header claims.
    (exchange.len() <= 255 && routing_key.len() <= 255).then_some(Destination {
        exchange,
        routing_key,
    })
}

/// The failure signature of a message: the signature header, else the reason and queue of its
/// most recent death.
pub fn signature(signature_header: &str, props: &Properties) -> String {
    if let Some(v) = message::header_str(props, signature_header) {
        return format!("{signature_header}={}", shortened(&v));
    }
    // Read in place: a signature is made for every message, and only these two fields count.
    match (
        message::first_death_str(props, "reason"),
        message::first_death_str(props, "queue"),
    ) {
        (Some(reason), Some(queue)) => {
            let mut s = String::with_capacity(reason.len() + 1 + queue.len());
            s.push_str(&reason);
            s.push('@');
            s.push_str(&queue);
            s
        }
        _ => "no-death".into(),
    }
}

/// The longest header value a signature keeps, in characters: signatures are status lines,
/// event notes and audit fields, and a header may hold a whole stack trace.
const SIGNATURE_CHARS: usize = 120;

/// `v` cut to [`SIGNATURE_CHARS`], with a hash of the whole so that values differing only
/// past the cut stay distinct signatures.
fn shortened(v: &str) -> Cow<'_, str> {
    if v.chars().count() <= SIGNATURE_CHARS {
        return Cow::Borrowed(v);
    }
    let head: String = v.chars().take(SIGNATURE_CHARS).collect();
    let digest = hex::encode(Sha256::digest(v.as_bytes()));
    Cow::Owned(format!("{head}…#{}", &digest[..8]))
}

/// The queue a default-target message will land in: the queue of its most recent death.
pub fn original_queue(props: &Properties) -> Option<String> {
    message::deaths(props)
        .into_iter()
        .next()
        .map(|d| d.queue.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::{AMQPValue, BasicProperties, FieldArray, FieldTable};
    use crate::spec::{KeyField, TargetSpec};

    fn dead(reason: &str, count: i64, extra: &[(&str, &str)]) -> Properties {
        let mut d = FieldTable::default();
        d.insert("queue".into(), AMQPValue::LongString("work".into()));
        d.insert("reason".into(), AMQPValue::LongString(reason.into()));
        d.insert("count".into(), AMQPValue::LongLongInt(count));
        d.insert("exchange".into(), AMQPValue::LongString("jobs".into()));
        let mut rk = FieldArray::default();
        rk.push(AMQPValue::LongString("job".into()));
        d.insert("routing-keys".into(), AMQPValue::FieldArray(rk));
        let mut arr = FieldArray::default();
        arr.push(AMQPValue::FieldTable(d));
        let mut h = FieldTable::default();
        h.insert("x-death".into(), AMQPValue::FieldArray(arr));
        for (k, v) in extra {
            h.insert((*k).into(), AMQPValue::LongString((*v).into()));
        }
        BasicProperties::default().with_headers(h).into()
    }

    struct Fixture {
        selector: SelectorSpec,
        poison: PoisonSpec,
        key: Option<KeySpec>,
        target: TargetSpec,
    }

    impl Fixture {
        fn new() -> Self {
            Self {
                selector: SelectorSpec::default(),
                poison: PoisonSpec::default(),
                key: None,
                target: TargetSpec::default(),
            }
        }
        fn rules(&self) -> Rules<'_> {
            Rules {
                selector: &self.selector,
                poison: &self.poison,
                key: self.key.as_ref(),
                target: &self.target,
                signature_header: "x-exception-type",
                replay_id: "r1",
            }
        }
    }

    #[test]
    fn default_destination_is_the_original_exchange_and_key() {
        let f = Fixture::new();
        let v = classify(&f.rules(), &dead("rejected", 1, &[]), b"{}");
        let Verdict::Replay { destination, key } = v else {
            panic!("{v:?}")
        };
        assert_eq!(
            (
                destination.exchange.as_str(),
                destination.routing_key.as_str()
            ),
            ("jobs", "job")
        );
        assert_eq!(key, None);
    }

    #[test]
    fn selector_skips_other_reasons_and_headers() {
        let mut f = Fixture::new();
        f.selector.death_reasons = vec!["expired".into()];
        assert!(matches!(
            classify(&f.rules(), &dead("rejected", 1, &[]), b"{}"),
            Verdict::Skip(_)
        ));
        f.selector.death_reasons.clear();
        f.selector
            .headers
            .insert("x-exception-type".into(), "TimeoutError".into());
        let hit = dead("rejected", 1, &[("x-exception-type", "TimeoutError")]);
        let miss = dead("rejected", 1, &[("x-exception-type", "KeyError")]);
        assert!(matches!(
            classify(&f.rules(), &hit, b"{}"),
            Verdict::Replay { .. }
        ));
        assert!(matches!(
            classify(&f.rules(), &miss, b"{}"),
            Verdict::Skip(_)
        ));
    }

    #[test]
    fn payload_selector_matches_strings_and_numbers() {
        let mut f = Fixture::new();
        f.selector.payload = vec![PayloadMatch {
            pointer: "/n".into(),
            equals: None,
            in_: Some(vec!["1".into(), "2".into()]),
        }];
        let p = dead("rejected", 1, &[]);
        assert!(matches!(
            classify(&f.rules(), &p, br#"{"n":2}"#),
            Verdict::Replay { .. }
        ));
        assert!(matches!(
            classify(&f.rules(), &p, br#"{"n":3}"#),
            Verdict::Skip(_)
        ));
        assert!(matches!(
            classify(&f.rules(), &p, b"\xff\x00"),
            Verdict::Skip(_)
        ));
    }

    #[test]
    fn own_returns_are_skipped() {
        let f = Fixture::new();
        let p = dead("rejected", 1, &[(REPLAY_ID, "r1")]);
        assert_eq!(
            classify(&f.rules(), &p, b"{}"),
            Verdict::Skip(SkipReason::Returned)
        );
    }

    #[test]
    fn poison_by_death_count_fields_and_json() {
        let mut f = Fixture::new();
        f.poison.max_death_count = Some(3);
        let v = classify(&f.rules(), &dead("rejected", 4, &[]), b"{}");
        assert!(
            matches!(&v, Verdict::Poison(r) if r.starts_with("MaxDeathCount")),
            "{v:?}"
        );
        f.poison.required_fields = vec!["/asset_id".into()];
        f.poison.json_fields = vec!["/chapters".into()];
        let p = dead("rejected", 1, &[]);
        let v = classify(&f.rules(), &p, br#"{"chapters":"[1]"}"#);
        assert!(
            matches!(&v, Verdict::Poison(r) if r.contains("/asset_id")),
            "{v:?}"
        );
        let v = classify(&f.rules(), &p, br#"{"asset_id":1,"chapters":"[1"}"#);
        assert!(
            matches!(&v, Verdict::Poison(r) if r.contains("/chapters")),
            "{v:?}"
        );
        let v = classify(&f.rules(), &p, br#"{"asset_id":1,"chapters":"[1]"}"#);
        assert!(matches!(v, Verdict::Replay { .. }), "{v:?}");
        let v = classify(&f.rules(), &p, b"\xc3\x28");
        assert!(
            matches!(&v, Verdict::Poison(r) if r.contains("binary")),
            "{v:?}"
        );
    }

    #[test]
    fn missing_key_field_is_poison_and_no_death_without_target_too() {
        let mut f = Fixture::new();
        f.key = Some(KeySpec {
            fields: vec![KeyField {
                pointer: "/id".into(),
                default: None,
            }],
            prefix: "k:".into(),
        });
        let v = classify(&f.rules(), &dead("rejected", 1, &[]), b"{}");
        assert!(
            matches!(&v, Verdict::Poison(r) if r.contains("/id")),
            "{v:?}"
        );
        f.key = None;
        let v = classify(&f.rules(), &Properties::default(), b"{}");
        assert!(
            matches!(&v, Verdict::Poison(r) if r.starts_with("NoDestination")),
            "{v:?}"
        );
        f.target.exchange = Some("".into());
        f.target.routing_key = Some("q".into());
        assert!(matches!(
            classify(&f.rules(), &Properties::default(), b"{}"),
            Verdict::Replay { .. }
        ));
    }

    #[test]
    fn not_json_says_where_and_why_without_the_body() {
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        let why = not_json(deep.as_bytes());
        assert!(
            why.starts_with("NotJson: body is 400 bytes of text that is not JSON ("),
            "{why}"
        );
        assert!(why.contains("recursion limit exceeded"), "{why}");
        let why = not_json(b"{\"secret\": nope}");
        assert!(why.contains("line 1 column"), "{why}");
        assert!(!why.contains("nope") && !why.contains("secret"), "{why}");
    }

    #[test]
    fn a_long_signature_value_is_cut_but_stays_distinct() {
        let long = |tail: &str| format!("{}{tail}", "é".repeat(300));
        let a = signature("x-e", &dead("rejected", 1, &[("x-e", &long("a"))]));
        let b = signature("x-e", &dead("rejected", 1, &[("x-e", &long("b"))]));
        assert_ne!(a, b, "values differing past the cut must stay apart");
        assert!(a.chars().count() < 140, "{} chars", a.chars().count());
        assert!(
            a.starts_with(&format!("x-e={}…#", "é".repeat(SIGNATURE_CHARS))),
            "{a}"
        );
    }

    #[test]
    fn signature_uses_header_then_death() {
        assert_eq!(
            signature(
                "x-exception-type",
                &dead("rejected", 1, &[("x-exception-type", "E")])
            ),
            "x-exception-type=E"
        );
        assert_eq!(
            signature("x-exception-type", &dead("expired", 1, &[])),
            "expired@work"
        );
    }
}
