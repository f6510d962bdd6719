//! Structured inputs for the fuzz targets, built with `arbitrary` and turned into what the engine
//! sees: lapin `BasicProperties` (every AMQP field-table value type, nested tables and arrays,
//! well-formed and malformed `x-death`), bodies (raw bytes, JSON, deep JSON, text) and replay
//! specs (selector, poison gate, idempotency key, target, signature header).
//!
//! Names and strings are drawn partly from a small vocabulary shared by headers, bodies and
//! specs, so that a pointer meets its field and a selector meets its header often enough for the
//! fuzzer to reach the paths behind them.

use std::collections::BTreeMap;

use arbitrary::Arbitrary;
use dlq_replay_engine::spec::{
    CanarySpec, ConnectionSpec, DlqReplaySpec, IdempotencyMode, IdempotencySpec, KeyField, KeySpec,
    PayloadMatch, PoisonSpec, QuarantineSpec, SelectorSpec, SourceSpec, TargetSpec,
};
use lapin::types::{
    AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable, LongString, ShortString,
};
use lapin::BasicProperties;
use serde_json::Value;

/// Deepest nesting of generated AMQP values and JSON values; deeper input is cut to a leaf.
/// (Deeper JSON than serde_json accepts comes from [`Body::Deep`].)
pub const MAX_DEPTH: usize = 40;

/// The words that headers, x-death entries, bodies and specs have in common.
const WORDS: &[&str] = &[
    "",
    "id",
    "asset_id",
    "stage",
    "version",
    "a",
    "0",
    "1",
    "-",
    "~",
    "/",
    "~0",
    "~1",
    "a/b",
    "a~b",
    ":",
    "rejected",
    "expired",
    "maxlen",
    "delivery_limit",
    "work",
    "jobs",
    "job",
    "r1",
    "x-exception-type",
    "TimeoutError",
    "true",
    "null",
    "{}",
    "[1]",
    "é",
    "\u{0}",
    "\u{fffd}",
];

/// A string: a vocabulary word, any string, or a word repeated (past the 255-byte AMQP limit).
#[derive(Arbitrary, Debug, Clone)]
pub enum Text {
    Word(u8),
    Any(String),
    Long(u16, u8),
}

impl Text {
    pub fn get(&self) -> String {
        match self {
            Text::Word(i) => WORDS[*i as usize % WORDS.len()].to_owned(),
            Text::Any(s) => s.clone(),
            Text::Long(n, i) => {
                let w = WORDS[*i as usize % WORDS.len()];
                let w = if w.is_empty() { "x" } else { w };
                w.repeat(*n as usize % 700)
            }
        }
    }
}

/// Bytes of a long string or byte array: text, or anything (not UTF-8).
#[derive(Arbitrary, Debug, Clone)]
pub enum Bytes {
    Text(Text),
    Raw(Vec<u8>),
}

impl Bytes {
    pub fn get(&self) -> Vec<u8> {
        match self {
            Bytes::Text(t) => t.get().into_bytes(),
            Bytes::Raw(b) => b.clone(),
        }
    }
}

/// A field-table key: the names the engine looks up, or any other.
#[derive(Arbitrary, Debug, Clone)]
pub enum Name {
    XDeath,
    ReplayId,
    ReplayCount,
    IdempotencyKey,
    QuarantineReason,
    OriginalUserId,
    ExceptionType,
    XFirstDeathReason,
    XLastDeathQueue,
    XDeliveryCount,
    Queue,
    Reason,
    Count,
    Exchange,
    RoutingKeys,
    Time,
    Text(Text),
}

impl Name {
    pub fn get(&self) -> String {
        match self {
            Name::XDeath => "x-death".into(),
            Name::ReplayId => "x-replay-id".into(),
            Name::ReplayCount => "x-replay-count".into(),
            Name::IdempotencyKey => "x-idempotency-key".into(),
            Name::QuarantineReason => "x-quarantine-reason".into(),
            Name::OriginalUserId => "x-original-user-id".into(),
            Name::ExceptionType => "x-exception-type".into(),
            Name::XFirstDeathReason => "x-first-death-reason".into(),
            Name::XLastDeathQueue => "x-last-death-queue".into(),
            Name::XDeliveryCount => "x-delivery-count".into(),
            Name::Queue => "queue".into(),
            Name::Reason => "reason".into(),
            Name::Count => "count".into(),
            Name::Exchange => "exchange".into(),
            Name::RoutingKeys => "routing-keys".into(),
            Name::Time => "time".into(),
            Name::Text(t) => t.get(),
        }
    }
}

/// A short string: at most 255 bytes, cut at a character boundary (lapin's `ShortString::from`
/// panics beyond that, and no broker can send more).
pub fn short(s: String) -> ShortString {
    let mut end = s.len().min(255);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    ShortString::from(&s[..end])
}

/// Any AMQP field value.
#[derive(Arbitrary, Debug, Clone)]
pub enum Amqp {
    Boolean(bool),
    ShortShortInt(i8),
    ShortShortUInt(u8),
    ShortInt(i16),
    ShortUInt(u16),
    LongInt(i32),
    LongUInt(u32),
    LongLongInt(i64),
    Float(f32),
    Double(f64),
    Decimal(u8, u32),
    ShortString(Text),
    LongString(Bytes),
    Array(Vec<Amqp>),
    Timestamp(u64),
    Table(Table),
    ByteArray(Bytes),
    Void,
    /// An integer at an edge of its type (0, -1, MIN, MAX), of any integer type.
    Edge(u8),
}

const EDGES: usize = 8;

fn edge(i: u8) -> AMQPValue {
    let pick = i as usize % EDGES;
    match (i as usize / EDGES) % 8 {
        0 => AMQPValue::ShortShortInt([0, -1, 1, i8::MIN, i8::MAX, 2, 3, -2][pick]),
        1 => AMQPValue::ShortShortUInt([0, 1, 2, 3, u8::MAX, 254, 128, 127][pick]),
        2 => AMQPValue::ShortInt([0, -1, 1, i16::MIN, i16::MAX, 2, 3, -2][pick]),
        3 => AMQPValue::ShortUInt([0, 1, 2, 3, u16::MAX, 255, 256, 1000][pick]),
        4 => AMQPValue::LongInt([0, -1, 1, i32::MIN, i32::MAX, 2, 3, -2][pick]),
        5 => AMQPValue::LongUInt([0, 1, 2, 3, u32::MAX, u32::MAX - 1, 5, 1000][pick]),
        6 => AMQPValue::LongLongInt([0, -1, 1, i64::MIN, i64::MAX, i64::MAX - 1, 3, -2][pick]),
        _ => AMQPValue::Timestamp(
            [0, 1, 2, 3, u64::MAX, u64::MAX - 1, i64::MAX as u64, 1 << 63][pick],
        ),
    }
}

impl Amqp {
    pub fn get(&self, depth: usize) -> AMQPValue {
        match self {
            Amqp::Boolean(b) => AMQPValue::Boolean(*b),
            Amqp::ShortShortInt(n) => AMQPValue::ShortShortInt(*n),
            Amqp::ShortShortUInt(n) => AMQPValue::ShortShortUInt(*n),
            Amqp::ShortInt(n) => AMQPValue::ShortInt(*n),
            Amqp::ShortUInt(n) => AMQPValue::ShortUInt(*n),
            Amqp::LongInt(n) => AMQPValue::LongInt(*n),
            Amqp::LongUInt(n) => AMQPValue::LongUInt(*n),
            Amqp::LongLongInt(n) => AMQPValue::LongLongInt(*n),
            Amqp::Float(f) => AMQPValue::Float(*f),
            Amqp::Double(f) => AMQPValue::Double(*f),
            Amqp::Decimal(scale, value) => AMQPValue::DecimalValue(DecimalValue {
                scale: *scale,
                value: *value,
            }),
            Amqp::ShortString(t) => AMQPValue::ShortString(short(t.get())),
            Amqp::LongString(b) => AMQPValue::LongString(LongString::from(b.get())),
            Amqp::Array(items) if depth < MAX_DEPTH => AMQPValue::FieldArray(FieldArray::from(
                items.iter().map(|v| v.get(depth + 1)).collect::<Vec<_>>(),
            )),
            Amqp::Table(t) if depth < MAX_DEPTH => AMQPValue::FieldTable(t.get(depth + 1)),
            Amqp::Array(_) | Amqp::Table(_) => AMQPValue::Void,
            Amqp::Timestamp(t) => AMQPValue::Timestamp(*t),
            Amqp::ByteArray(b) => AMQPValue::ByteArray(ByteArray::from(b.get())),
            Amqp::Void => AMQPValue::Void,
            Amqp::Edge(i) => edge(*i),
        }
    }
}

/// A value biased toward text (what a human or RabbitMQ puts in a header).
#[derive(Arbitrary, Debug, Clone)]
pub enum Val {
    Str(Text),
    Any(Amqp),
}

impl Val {
    pub fn get(&self, depth: usize) -> AMQPValue {
        match self {
            Val::Str(t) => AMQPValue::LongString(LongString::from(t.get())),
            Val::Any(v) => v.get(depth),
        }
    }
}

/// A field table (later entries with the same name win, as on the wire).
#[derive(Arbitrary, Debug, Clone)]
pub struct Table(pub Vec<(Name, Val)>);

impl Table {
    pub fn get(&self, depth: usize) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in &self.0 {
            t.insert(short(k.get()), v.get(depth));
        }
        t
    }
}

/// The `x-death` header: an array of entries, or some other value.
#[derive(Arbitrary, Debug, Clone)]
pub enum XDeath {
    Entries(Vec<DeathEntry>),
    Other(Amqp),
}

/// One `x-death` entry: RabbitMQ's fields, each possibly missing or of the wrong type, or not a
/// table at all.
#[derive(Arbitrary, Debug, Clone)]
pub enum DeathEntry {
    Fields {
        queue: Option<Val>,
        reason: Option<Val>,
        count: Option<Count>,
        exchange: Option<Val>,
        routing_keys: Option<RoutingKeys>,
        extra: Table,
    },
    Other(Amqp),
}

/// A death count: any integer type, an edge value, or anything else.
#[derive(Arbitrary, Debug, Clone)]
pub enum Count {
    Long(i64),
    Edge(u8),
    Any(Val),
}

impl Count {
    fn get(&self) -> AMQPValue {
        match self {
            Count::Long(n) => AMQPValue::LongLongInt(*n),
            Count::Edge(i) => edge(*i),
            Count::Any(v) => v.get(2),
        }
    }
}

/// `routing-keys`: an array (of anything), or some other value.
#[derive(Arbitrary, Debug, Clone)]
pub enum RoutingKeys {
    Array(Vec<Val>),
    Other(Amqp),
}

impl XDeath {
    pub fn get(&self) -> AMQPValue {
        match self {
            XDeath::Other(v) => v.get(1),
            XDeath::Entries(entries) => AMQPValue::FieldArray(FieldArray::from(
                entries.iter().map(DeathEntry::get).collect::<Vec<_>>(),
            )),
        }
    }
}

impl DeathEntry {
    fn get(&self) -> AMQPValue {
        let (queue, reason, count, exchange, routing_keys, extra) = match self {
            DeathEntry::Other(v) => return v.get(2),
            DeathEntry::Fields {
                queue,
                reason,
                count,
                exchange,
                routing_keys,
                extra,
            } => (queue, reason, count, exchange, routing_keys, extra),
        };
        let mut t = extra.get(3);
        let mut put = |k: &str, v: Option<AMQPValue>| {
            if let Some(v) = v {
                t.insert(k.into(), v);
            }
        };
        put("queue", queue.as_ref().map(|v| v.get(3)));
        put("reason", reason.as_ref().map(|v| v.get(3)));
        put("count", count.as_ref().map(Count::get));
        put("exchange", exchange.as_ref().map(|v| v.get(3)));
        put(
            "routing-keys",
            routing_keys.as_ref().map(|r| match r {
                RoutingKeys::Array(keys) => AMQPValue::FieldArray(FieldArray::from(
                    keys.iter().map(|k| k.get(4)).collect::<Vec<_>>(),
                )),
                RoutingKeys::Other(v) => v.get(3),
            }),
        );
        AMQPValue::FieldTable(t)
    }
}

/// The headers of a message: the ones the engine reads, then any others.
#[derive(Arbitrary, Debug, Clone)]
pub struct Headers {
    pub x_death: Option<XDeath>,
    pub replay_id: Option<Val>,
    pub replay_count: Option<Count>,
    pub signature: Option<Val>,
    pub rest: Table,
}

impl Headers {
    /// `signature_header`: the spec's signature header name, so the signature path is reached.
    pub fn get(&self, signature_header: &str) -> FieldTable {
        let mut t = self.rest.get(1);
        if let Some(x) = &self.x_death {
            t.insert("x-death".into(), x.get());
        }
        if let Some(v) = &self.replay_id {
            t.insert("x-replay-id".into(), v.get(1));
        }
        if let Some(c) = &self.replay_count {
            t.insert("x-replay-count".into(), c.get());
        }
        if let Some(v) = &self.signature {
            t.insert(short(signature_header.to_owned()), v.get(1));
        }
        t
    }
}

/// The properties of a message that the engine reads.
#[derive(Arbitrary, Debug, Clone)]
pub struct Props {
    pub headers: Option<Headers>,
    pub message_id: Option<Text>,
    pub user_id: Option<Text>,
    pub content_type: Option<Text>,
    pub correlation_id: Option<Text>,
}

impl Props {
    pub fn get(&self, signature_header: &str) -> BasicProperties {
        let mut p = BasicProperties::default();
        if let Some(h) = &self.headers {
            p = p.with_headers(h.get(signature_header));
        }
        if let Some(t) = &self.message_id {
            p = p.with_message_id(short(t.get()));
        }
        if let Some(t) = &self.user_id {
            p = p.with_user_id(short(t.get()));
        }
        if let Some(t) = &self.content_type {
            p = p.with_content_type(short(t.get()));
        }
        if let Some(t) = &self.correlation_id {
            p = p.with_correlation_id(short(t.get()));
        }
        p
    }
}

/// A message's properties: structured, or the raw bytes of an AMQP content header's property
/// list, parsed the way lapin parses what the broker sends.
#[derive(Arbitrary, Debug, Clone)]
pub enum Message {
    Structured(Props),
    /// Property flags (the headers flag always set, content type and encoding never, so the
    /// field table comes first), the encoded headers table (its length prefix is added), then the
    /// other properties' bytes.
    Wire {
        flags: u16,
        headers: Vec<u8>,
        rest: Vec<u8>,
    },
    /// Any bytes as a property list.
    Raw(Vec<u8>),
}

impl Message {
    /// `None` when the wire bytes do not parse (lapin would drop the connection).
    pub fn get(&self, signature_header: &str) -> Option<BasicProperties> {
        let bytes = match self {
            Message::Structured(p) => return Some(p.get(signature_header)),
            Message::Wire {
                flags,
                headers,
                rest,
            } => {
                let flags = (flags & !0xc000) | 0x2000;
                let mut b = flags.to_be_bytes().to_vec();
                b.extend_from_slice(&u32::try_from(headers.len()).ok()?.to_be_bytes());
                b.extend_from_slice(headers);
                b.extend_from_slice(rest);
                b
            }
            Message::Raw(b) => b.clone(),
        };
        lapin::protocol::basic::parse_properties(bytes.as_slice())
            .ok()
            .map(|(_, p)| p)
    }
}

/// A JSON value.
#[derive(Arbitrary, Debug, Clone)]
pub enum Json {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(Text),
    Array(Vec<Json>),
    Object(Vec<(Text, Json)>),
    /// A string holding JSON (what `poison.jsonFields` looks for).
    Embedded(Box<Json>),
}

/// Most strings-holding-JSON nested in each other: each level doubles the escapes of the one
/// inside, so 20 levels make a body of gigabytes (which only times the harness out).
const MAX_EMBEDDED: usize = 3;

impl Json {
    pub fn get(&self, depth: usize) -> Value {
        self.value(depth, 0)
    }

    fn value(&self, depth: usize, embedded: usize) -> Value {
        match self {
            Json::Null => Value::Null,
            Json::Bool(b) => Value::Bool(*b),
            Json::Int(n) => Value::from(*n),
            Json::UInt(n) => Value::from(*n),
            Json::Float(f) => serde_json::Number::from_f64(*f).map_or(Value::Null, Value::Number),
            Json::Str(t) => Value::String(t.get()),
            Json::Array(a) if depth < MAX_DEPTH => {
                Value::Array(a.iter().map(|v| v.value(depth + 1, embedded)).collect())
            }
            Json::Object(o) if depth < MAX_DEPTH => Value::Object(
                o.iter()
                    .map(|(k, v)| (k.get(), v.value(depth + 1, embedded)))
                    .collect(),
            ),
            Json::Embedded(j) if depth < MAX_DEPTH && embedded < MAX_EMBEDDED => {
                Value::String(j.value(depth + 1, embedded + 1).to_string())
            }
            Json::Array(_) | Json::Object(_) | Json::Embedded(_) => Value::Null,
        }
    }
}

/// A message body.
#[derive(Arbitrary, Debug, Clone)]
pub enum Body {
    /// The bytes as they are: not UTF-8, not JSON, truncated JSON, anything.
    Raw(Vec<u8>),
    /// A JSON document.
    Json(Json),
    /// A JSON document with trailing bytes (not JSON as a whole).
    JsonThen(Json, Vec<u8>),
    /// `depth` nested arrays or objects around a leaf, closed or not: past serde_json's
    /// recursion limit (128) when deep enough.
    Deep {
        depth: u16,
        object: bool,
        closed: bool,
        leaf: Json,
    },
    /// Text that is (most likely) not JSON.
    Text(Text),
}

impl Body {
    pub fn get(&self) -> Vec<u8> {
        match self {
            Body::Raw(b) => b.clone(),
            Body::Json(j) => serde_json::to_vec(&j.get(0)).expect("a Value serializes"),
            Body::JsonThen(j, rest) => {
                let mut b = serde_json::to_vec(&j.get(0)).expect("a Value serializes");
                b.extend_from_slice(rest);
                b
            }
            Body::Deep {
                depth,
                object,
                closed,
                leaf,
            } => {
                let depth = *depth as usize % 2000;
                let (open, close) = if *object {
                    (r#"{"a":"#, "}")
                } else {
                    ("[", "]")
                };
                let mut s = open.repeat(depth);
                s.push_str(&leaf.get(0).to_string());
                if *closed {
                    s.push_str(&close.repeat(depth));
                }
                s.into_bytes()
            }
            Body::Text(t) => t.get().into_bytes(),
        }
    }
}

/// A JSON pointer: segments (escaped as RFC 6901 says, or not), any string (a missing leading
/// `/`, a bad escape), or the whole document.
#[derive(Arbitrary, Debug, Clone)]
pub enum Pointer {
    Segments(Vec<Text>),
    Unescaped(Vec<Text>),
    Raw(Text),
    Root,
}

impl Pointer {
    pub fn get(&self) -> String {
        match self {
            Pointer::Segments(s) => s
                .iter()
                .map(|t| format!("/{}", t.get().replace('~', "~0").replace('/', "~1")))
                .collect(),
            Pointer::Unescaped(s) => s.iter().map(|t| format!("/{}", t.get())).collect(),
            Pointer::Raw(t) => t.get(),
            Pointer::Root => String::new(),
        }
    }
}

/// A number, mostly small.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Num {
    Small(u8),
    Any(u64),
}

impl Num {
    pub fn get(self) -> u64 {
        match self {
            Num::Small(n) => n.into(),
            Num::Any(n) => n,
        }
    }
}

#[derive(Arbitrary, Debug, Clone)]
pub struct Payload {
    pub pointer: Pointer,
    pub equals: Option<Text>,
    pub in_: Option<Vec<Text>>,
}

#[derive(Arbitrary, Debug, Clone)]
pub struct Selector {
    pub limit: Option<Num>,
    pub death_reasons: Vec<Text>,
    pub original_queues: Vec<Text>,
    pub headers: Vec<(Name, Text)>,
    pub payload: Vec<Payload>,
}

impl Selector {
    pub fn get(&self) -> SelectorSpec {
        SelectorSpec {
            limit: self.limit.map(Num::get),
            death_reasons: self.death_reasons.iter().map(Text::get).collect(),
            original_queues: self.original_queues.iter().map(Text::get).collect(),
            headers: self
                .headers
                .iter()
                .map(|(k, v)| (k.get(), v.get()))
                .collect::<BTreeMap<_, _>>(),
            payload: self
                .payload
                .iter()
                .map(|p| PayloadMatch {
                    pointer: p.pointer.get(),
                    equals: p.equals.as_ref().map(Text::get),
                    in_: p.in_.as_ref().map(|v| v.iter().map(Text::get).collect()),
                })
                .collect(),
        }
    }
}

#[derive(Arbitrary, Debug, Clone)]
pub struct Poison {
    pub max_death_count: Option<Num>,
    pub required_fields: Vec<Pointer>,
    pub json_fields: Vec<Pointer>,
    pub max_quarantine_ratio: Option<f64>,
}

impl Poison {
    pub fn get(&self) -> PoisonSpec {
        PoisonSpec {
            max_death_count: self.max_death_count.map(Num::get),
            required_fields: self.required_fields.iter().map(Pointer::get).collect(),
            json_fields: self.json_fields.iter().map(Pointer::get).collect(),
            max_quarantine_ratio: self.max_quarantine_ratio,
        }
    }
}

/// An idempotency key spec.
#[derive(Arbitrary, Debug, Clone)]
pub struct Key {
    pub fields: Vec<(Pointer, Option<Text>)>,
    pub prefix: Text,
}

impl Key {
    pub fn get(&self) -> KeySpec {
        KeySpec {
            fields: self
                .fields
                .iter()
                .map(|(p, d)| KeyField {
                    pointer: p.get(),
                    default: d.as_ref().map(Text::get),
                })
                .collect(),
            prefix: self.prefix.get(),
        }
    }
}

/// The parts of a `DlqReplaySpec` that decide a message.
#[derive(Arbitrary, Debug, Clone)]
pub struct Spec {
    pub selector: Selector,
    pub poison: Poison,
    pub key: Option<Key>,
    pub claim: bool,
    pub exchange: Option<Text>,
    pub routing_key: Option<Text>,
    pub signature_header: Text,
    pub replay_id: Text,
}

impl Spec {
    pub fn get(&self) -> DlqReplaySpec {
        DlqReplaySpec {
            broker: ConnectionSpec::default(),
            source: SourceSpec {
                queue: "dlq".into(),
            },
            target: TargetSpec {
                exchange: self.exchange.as_ref().map(Text::get),
                routing_key: self.routing_key.as_ref().map(Text::get),
            },
            quarantine: QuarantineSpec {
                queue: "quarantine".into(),
            },
            selector: self.selector.get(),
            poison: self.poison.get(),
            idempotency: self.key.as_ref().map(|k| IdempotencySpec {
                redis: None,
                mode: if self.claim {
                    IdempotencyMode::Claim
                } else {
                    IdempotencyMode::Check
                },
                key: k.get(),
                done_value: "done".into(),
                ttl_seconds: 60,
            }),
            audit: None,
            rate: None,
            canary: CanarySpec {
                signature_header: self.signature_header.get(),
                ..CanarySpec::default()
            },
            dry_run: false,
            suspend: false,
            expect: None,
            require_approval: false,
        }
    }
}

/// Whether `key` is `prefix` followed by 32 lowercase hex digits.
pub fn is_key(prefix: &str, key: &str) -> bool {
    key.strip_prefix(prefix).is_some_and(|h| {
        h.len() == 32
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}
