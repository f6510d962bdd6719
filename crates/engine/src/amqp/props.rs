//! A message's properties as the engine keeps them: every property but the headers parsed (a
//! few short strings), the headers kept as the field table's bytes and read in place.
//!
//! Why not amq-protocol's `BasicProperties` with its `FieldTable`: every delivery's headers
//! became a B-tree of owned strings (each `x-death` entry a table of its own), about 35
//! allocations per message that the drain only reads a handful of fields of; and every replayed
//! message's table was cloned entry by entry and encoded again. Here a delivery's headers are one
//! buffer, a read walks it, and a republished table is the kept entries' bytes copied as they
//! came plus the entries the replay adds. A moved copy carries the very bytes it came with.
//!
//! The table is validated once, when the header frame is parsed (types, sizes, UTF-8 names, as
//! amq-protocol's parser checks them), so reading it later cannot fail; a table that does not
//! parse is a protocol error, as it was with amq-protocol. Field types are RabbitMQ's (`s` is a
//! short int, `l` and `L` both a long long int), as amq-protocol reads them.

use std::borrow::Cow;

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::{AMQPValue, FieldTable};

use super::AmqpError;

/// Deepest nesting of arrays and tables accepted in headers (a frame is at most `frame_max`
/// bytes, but a table nested in itself that deep would exhaust the stack of any reader).
const MAX_DEPTH: usize = 64;

/// A message's properties: `basic` never holds headers; `headers` is the encoded field table
/// (its entries, without the length prefix), `None` when the message has no headers property.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Properties {
    basic: BasicProperties,
    headers: Option<Vec<u8>>,
}

impl Properties {
    /// Every property but the headers.
    pub fn basic(&self) -> &BasicProperties {
        &self.basic
    }

    /// The headers, read in place.
    pub fn headers(&self) -> Option<Table<'_>> {
        self.headers.as_deref().map(Table)
    }

    /// The headers' encoded entries, as they came.
    pub fn header_bytes(&self) -> Option<&[u8]> {
        self.headers.as_deref()
    }

    /// These properties with other headers: `entries` already encoded (see [`TableWriter`]).
    pub fn with_header_bytes(&self, entries: Option<Vec<u8>>) -> Self {
        Self {
            basic: self.basic.clone(),
            headers: entries,
        }
    }

    /// `basic` (its headers ignored) with the headers `entries` already encoded.
    pub fn from_parts(basic: BasicProperties, entries: Option<Vec<u8>>) -> Self {
        let basic = without_headers(basic);
        Self {
            basic,
            headers: entries,
        }
    }

    /// The whole of it as amq-protocol's type, headers parsed into a `FieldTable` (for tests and
    /// for what is read once per replay, not per message).
    pub fn to_basic(&self) -> BasicProperties {
        match self.headers().map(Table::to_field_table) {
            Some(t) => self.basic.clone().with_headers(t),
            None => self.basic.clone(),
        }
    }
}

impl From<BasicProperties> for Properties {
    /// Encodes the headers (amq-protocol's generator) into the bytes a delivery would carry.
    fn from(p: BasicProperties) -> Self {
        let headers = p.headers().as_ref().map(encode_table);
        Self {
            basic: without_headers(p),
            headers,
        }
    }
}

impl From<&BasicProperties> for Properties {
    fn from(p: &BasicProperties) -> Self {
        p.clone().into()
    }
}

/// `p` less its headers.
fn without_headers(p: BasicProperties) -> BasicProperties {
    if p.headers().is_none() {
        return p;
    }
    basic_but(&p, true)
}

/// Every property of `p` but its headers, and but its `user-id` unless `user_id`: what a
/// publish as another user keeps (RabbitMQ refuses a `user-id` that is not the connection's).
pub fn basic_but(p: &BasicProperties, user_id: bool) -> BasicProperties {
    let mut out = BasicProperties::default();
    macro_rules! copy {
        ($($get:ident => $set:ident),*) => {$(
            if let Some(v) = p.$get().clone() { out = out.$set(v); }
        )*};
    }
    copy!(content_type => with_content_type, content_encoding => with_content_encoding,
        delivery_mode => with_delivery_mode, priority => with_priority,
        correlation_id => with_correlation_id, reply_to => with_reply_to,
        expiration => with_expiration, message_id => with_message_id,
        timestamp => with_timestamp, kind => with_type, app_id => with_app_id,
        cluster_id => with_cluster_id);
    if user_id {
        copy!(user_id => with_user_id);
    }
    out
}

/// A field table's entries encoded (no length prefix), by amq-protocol's generator.
fn encode_table(t: &FieldTable) -> Vec<u8> {
    let mut w = TableWriter::default();
    for (k, v) in t.inner() {
        w.value(k.as_str(), v);
    }
    w.into_bytes()
}

/// An encoded field table, read in place.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Table<'a>(&'a [u8]);

impl<'a> Table<'a> {
    /// Its entries in wire order: name, value and the entry's bytes (name included).
    pub fn entries(self) -> Entries<'a> {
        Entries(self.0)
    }

    /// The value of `name` (the last one, if the table names it twice: as a `FieldTable` would
    /// keep it).
    pub fn get(self, name: &str) -> Option<Value<'a>> {
        // Every read of a header walks its table: names are compared as bytes and values
        // skipped by their sizes, and only the one found is read.
        let want = name.as_bytes();
        let mut rest = self.0;
        let mut found = None;
        while let Some((&n, after)) = rest.split_first() {
            let key = after.get(..usize::from(n))?;
            let at = &after[usize::from(n)..];
            let len = Value::size(at)?;
            if key == want {
                found = Some(at);
            }
            rest = at.get(len..)?;
        }
        Value::read(found?, 0).map(|(v, _)| v)
    }

    /// Whether it holds `name`.
    pub fn contains(self, name: &str) -> bool {
        self.entries().any(|e| e.name == name)
    }

    /// The table as amq-protocol's type.
    pub fn to_field_table(self) -> FieldTable {
        let mut t = FieldTable::default();
        for e in self.entries() {
            t.insert(e.name.into(), e.value.to_amqp());
        }
        t
    }
}

/// One entry of a table.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Entry<'a> {
    /// Its name.
    pub name: &'a str,
    /// Its value.
    pub value: Value<'a>,
    /// Its bytes on the wire (name, type and value), to copy it as it came.
    pub raw: &'a [u8],
}

/// The entries of a [`Table`].
pub struct Entries<'a>(&'a [u8]);

impl<'a> Iterator for Entries<'a> {
    type Item = Entry<'a>;

    fn next(&mut self) -> Option<Entry<'a>> {
        let input = self.0;
        let (&n, rest) = input.split_first()?;
        let name = std::str::from_utf8(rest.get(..usize::from(n))?).ok()?;
        let after_name = &rest[usize::from(n)..];
        let (value, len) = Value::read(after_name, 0)?;
        let used = 1 + usize::from(n) + len;
        self.0 = &input[used..];
        Some(Entry {
            name,
            value,
            raw: &input[..used],
        })
    }
}

/// An encoded field array, read in place.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Array<'a>(&'a [u8]);

impl<'a> Array<'a> {
    /// Its values in order.
    pub fn iter(self) -> impl Iterator<Item = Value<'a>> {
        let mut rest = self.0;
        std::iter::from_fn(move || {
            let (v, len) = Value::read(rest, 0)?;
            rest = &rest[len..];
            Some(v)
        })
    }
}

/// A field value, borrowed from its table.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value<'a> {
    Bool(bool),
    I8(i8),
    U8(u8),
    I16(i16),
    U16(u16),
    I32(i32),
    U32(u32),
    I64(i64),
    F32(f32),
    F64(f64),
    Decimal(u8, u32),
    /// `S`: bytes, usually UTF-8 text.
    LongString(&'a [u8]),
    Array(Array<'a>),
    Timestamp(u64),
    Table(Table<'a>),
    /// `x`.
    Bytes(&'a [u8]),
    Void,
}

/// `n` bytes at the start of `input`.
fn take(input: &[u8], n: usize) -> Option<&[u8]> {
    input.get(..n)
}

fn be<const N: usize>(input: &[u8]) -> Option<[u8; N]> {
    take(input, N)?.try_into().ok()
}

/// A `u32` length and the bytes it counts: the bytes and the whole length used.
fn sized(input: &[u8]) -> Option<(&[u8], usize)> {
    let n = u32::from_be_bytes(be(input)?) as usize;
    Some((take(&input[4..], n)?, 4 + n))
}

impl<'a> Value<'a> {
    /// The bytes the value at the start of `input` takes (type octet included), without
    /// reading it.
    fn size(input: &[u8]) -> Option<usize> {
        let (&ty, rest) = input.split_first()?;
        let len = match ty {
            b't' | b'b' | b'B' => 1,
            b's' | b'U' | b'u' => 2,
            b'I' | b'i' | b'f' => 4,
            b'D' => 5,
            b'l' | b'L' | b'd' | b'T' => 8,
            b'S' | b'x' | b'A' | b'F' => 4 + u32::from_be_bytes(be(rest)?) as usize,
            b'V' => 0,
            _ => return None,
        };
        Some(1 + len)
    }

    /// The value at the start of `input` (type octet first) and the bytes it takes; `None`
    /// when it is not a valid value (checked in depth at parse time, see [`validate`]).
    fn read(input: &'a [u8], depth: usize) -> Option<(Value<'a>, usize)> {
        let (&ty, rest) = input.split_first()?;
        let (v, len) = match ty {
            b't' => (Value::Bool(*rest.first()? != 0), 1),
            b'b' => (Value::I8(i8::from_be_bytes(be(rest)?)), 1),
            b'B' => (Value::U8(*rest.first()?), 1),
            b's' | b'U' => (Value::I16(i16::from_be_bytes(be(rest)?)), 2),
            b'u' => (Value::U16(u16::from_be_bytes(be(rest)?)), 2),
            b'I' => (Value::I32(i32::from_be_bytes(be(rest)?)), 4),
            b'i' => (Value::U32(u32::from_be_bytes(be(rest)?)), 4),
            b'l' | b'L' => (Value::I64(i64::from_be_bytes(be(rest)?)), 8),
            b'f' => (Value::F32(f32::from_be_bytes(be(rest)?)), 4),
            b'd' => (Value::F64(f64::from_be_bytes(be(rest)?)), 8),
            b'D' => (
                Value::Decimal(*rest.first()?, u32::from_be_bytes(be(rest.get(1..)?)?)),
                5,
            ),
            b'T' => (Value::Timestamp(u64::from_be_bytes(be(rest)?)), 8),
            b'S' => sized(rest).map(|(b, n)| (Value::LongString(b), n))?,
            b'x' => sized(rest).map(|(b, n)| (Value::Bytes(b), n))?,
            b'A' | b'F' => {
                if depth >= MAX_DEPTH {
                    return None;
                }
                let (b, n) = sized(rest)?;
                match ty {
                    b'A' => (Value::Array(Array(b)), n),
                    _ => (Value::Table(Table(b)), n),
                }
            }
            b'V' => (Value::Void, 0),
            _ => return None,
        };
        Some((v, 1 + len))
    }

    /// Text, for the values a human would match on: UTF-8 strings borrowed (invalid bytes
    /// replaced), numbers and booleans formatted; arrays, tables and void have none.
    pub fn as_str(self) -> Option<Cow<'a, str>> {
        Some(match self {
            Value::LongString(b) | Value::Bytes(b) => String::from_utf8_lossy(b),
            Value::Bool(b) => Cow::Owned(b.to_string()),
            Value::Timestamp(t) => Cow::Owned(t.to_string()),
            other => Cow::Owned(other.as_int()?.to_string()),
        })
    }

    /// The integer value of any integer type (a timestamp too).
    pub fn as_int(self) -> Option<i128> {
        Some(match self {
            Value::I8(n) => n.into(),
            Value::U8(n) => n.into(),
            Value::I16(n) => n.into(),
            Value::U16(n) => n.into(),
            Value::I32(n) => n.into(),
            Value::U32(n) => n.into(),
            Value::I64(n) => n.into(),
            Value::Timestamp(n) => n.into(),
            _ => return None,
        })
    }

    /// The value as amq-protocol's type.
    pub fn to_amqp(self) -> AMQPValue {
        match self {
            Value::Bool(b) => AMQPValue::Boolean(b),
            Value::I8(n) => AMQPValue::ShortShortInt(n),
            Value::U8(n) => AMQPValue::ShortShortUInt(n),
            Value::I16(n) => AMQPValue::ShortInt(n),
            Value::U16(n) => AMQPValue::ShortUInt(n),
            Value::I32(n) => AMQPValue::LongInt(n),
            Value::U32(n) => AMQPValue::LongUInt(n),
            Value::I64(n) => AMQPValue::LongLongInt(n),
            Value::F32(n) => AMQPValue::Float(n),
            Value::F64(n) => AMQPValue::Double(n),
            Value::Decimal(scale, value) => {
                AMQPValue::DecimalValue(amq_protocol::types::DecimalValue { scale, value })
            }
            Value::LongString(b) => AMQPValue::LongString(b.to_vec().into()),
            Value::Array(a) => {
                AMQPValue::FieldArray(a.iter().map(Value::to_amqp).collect::<Vec<_>>().into())
            }
            Value::Timestamp(t) => AMQPValue::Timestamp(t),
            Value::Table(t) => AMQPValue::FieldTable(t.to_field_table()),
            Value::Bytes(b) => AMQPValue::ByteArray(b.to_vec().into()),
            Value::Void => AMQPValue::Void,
        }
    }
}

/// Check a table's entries in depth: every name UTF-8, every value well formed.
fn validate_table(entries: &[u8], depth: usize) -> Option<()> {
    let mut rest = entries;
    while let Some((&n, after)) = rest.split_first() {
        std::str::from_utf8(take(after, usize::from(n))?).ok()?;
        let used = validate_value(&after[usize::from(n)..], depth)?;
        rest = &after[usize::from(n) + used..];
    }
    Some(())
}

fn validate_value(input: &[u8], depth: usize) -> Option<usize> {
    let (v, len) = Value::read(input, depth)?;
    match v {
        Value::Table(Table(b)) => validate_table(b, depth + 1)?,
        Value::Array(Array(mut b)) => {
            while !b.is_empty() {
                let used = validate_value(b, depth + 1)?;
                b = &b[used..];
            }
        }
        _ => {}
    }
    Some(len)
}

/// Writes a table's entries: copied ones as they came, new ones encoded.
#[derive(Debug, Default)]
pub struct TableWriter(Vec<u8>);

impl TableWriter {
    /// A writer with room for `capacity` bytes.
    pub fn with_capacity(capacity: usize) -> Self {
        Self(Vec::with_capacity(capacity))
    }

    /// The entries written.
    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }

    /// An entry as it came (its `raw` bytes).
    pub fn copy(&mut self, e: &Entry<'_>) {
        self.0.extend_from_slice(e.raw);
    }

    fn name(&mut self, name: &str) {
        // Header names are short strings: longer ones are cut (never the case for ours).
        let n = name.len().min(255);
        self.0.push(n as u8);
        self.0.extend_from_slice(&name.as_bytes()[..n]);
    }

    /// A long string entry.
    pub fn long_string(&mut self, name: &str, value: &[u8]) {
        self.name(name);
        self.0.push(b'S');
        self.0
            .extend_from_slice(&(value.len() as u32).to_be_bytes());
        self.0.extend_from_slice(value);
    }

    /// A long long int entry.
    pub fn long_long(&mut self, name: &str, value: i64) {
        self.name(name);
        self.0.push(b'l');
        self.0.extend_from_slice(&value.to_be_bytes());
    }

    /// Any amq-protocol value (amq-protocol's generator for its bytes).
    pub fn value(&mut self, name: &str, v: &AMQPValue) {
        self.name(name);
        let buf = std::mem::take(&mut self.0);
        // Generating into a growable Vec does not fail (cookie-factory only fails on a full
        // fixed-size buffer).
        let gen = amq_protocol::types::generation::gen_value(v);
        self.0 = cookie_factory::gen_simple(gen, buf).unwrap_or_default();
    }
}

/// Property flags, most significant first, in wire order.
mod flag {
    pub const CONTENT_TYPE: u16 = 1 << 15;
    pub const CONTENT_ENCODING: u16 = 1 << 14;
    pub const HEADERS: u16 = 1 << 13;
    pub const DELIVERY_MODE: u16 = 1 << 12;
    pub const PRIORITY: u16 = 1 << 11;
    pub const CORRELATION_ID: u16 = 1 << 10;
    pub const REPLY_TO: u16 = 1 << 9;
    pub const EXPIRATION: u16 = 1 << 8;
    pub const MESSAGE_ID: u16 = 1 << 7;
    pub const TIMESTAMP: u16 = 1 << 6;
    pub const TYPE: u16 = 1 << 5;
    pub const USER_ID: u16 = 1 << 4;
    pub const APP_ID: u16 = 1 << 3;
    pub const CLUSTER_ID: u16 = 1 << 2;
}

/// What a publish takes as its properties: the engine's own (owned or borrowed), or
/// amq-protocol's (encoded on the way; the tests' and fixtures' form).
pub trait Publishable {
    /// Append the content header's payload for a body of `size` bytes.
    fn write_header(&self, out: &mut Vec<u8>, size: u64);
}

impl Publishable for Properties {
    fn write_header(&self, out: &mut Vec<u8>, size: u64) {
        write_header(out, size, self);
    }
}

impl Publishable for BasicProperties {
    fn write_header(&self, out: &mut Vec<u8>, size: u64) {
        write_header(out, size, &Properties::from(self));
    }
}

impl<T: Publishable + ?Sized> Publishable for &T {
    fn write_header(&self, out: &mut Vec<u8>, size: u64) {
        (**self).write_header(out, size);
    }
}

/// A cursor over a header frame's payload.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Result<&'a [u8], AmqpError> {
        let b = take(self.0, n).ok_or_else(|| bad("a content header is cut short"))?;
        self.0 = &self.0[n..];
        Ok(b)
    }
    fn u8(&mut self) -> Result<u8, AmqpError> {
        Ok(self.bytes(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, AmqpError> {
        let b = self.bytes(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, AmqpError> {
        let b = self.bytes(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, AmqpError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.bytes(8)?);
        Ok(u64::from_be_bytes(a))
    }
    fn short(&mut self) -> Result<amq_protocol::types::ShortString, AmqpError> {
        let n = self.u8()?;
        let b = self.bytes(usize::from(n))?;
        let s = std::str::from_utf8(b).map_err(|_| bad("a short string property is not UTF-8"))?;
        Ok(s.into())
    }
}

fn bad(what: &str) -> AmqpError {
    AmqpError::Protocol(format!("cannot parse a frame: {what}"))
}

/// A content header frame's payload: the body size and the properties.
pub(crate) fn parse_header(payload: &[u8]) -> Result<(u64, Properties), AmqpError> {
    let mut r = Reader(payload);
    let _class = r.u16()?;
    let _weight = r.u16()?;
    let size = r.u64()?;
    let flags = r.u16()?;
    let mut p = BasicProperties::default();
    let mut headers = None;
    if flags & flag::CONTENT_TYPE != 0 {
        p = p.with_content_type(r.short()?);
    }
    if flags & flag::CONTENT_ENCODING != 0 {
        p = p.with_content_encoding(r.short()?);
    }
    if flags & flag::HEADERS != 0 {
        let n = r.u32()?;
        let entries = r.bytes(n as usize)?;
        validate_table(entries, 0).ok_or_else(|| bad("the headers table is malformed"))?;
        headers = Some(entries.to_vec());
    }
    if flags & flag::DELIVERY_MODE != 0 {
        p = p.with_delivery_mode(r.u8()?);
    }
    if flags & flag::PRIORITY != 0 {
        p = p.with_priority(r.u8()?);
    }
    if flags & flag::CORRELATION_ID != 0 {
        p = p.with_correlation_id(r.short()?);
    }
    if flags & flag::REPLY_TO != 0 {
        p = p.with_reply_to(r.short()?);
    }
    if flags & flag::EXPIRATION != 0 {
        p = p.with_expiration(r.short()?);
    }
    if flags & flag::MESSAGE_ID != 0 {
        p = p.with_message_id(r.short()?);
    }
    if flags & flag::TIMESTAMP != 0 {
        p = p.with_timestamp(r.u64()?);
    }
    if flags & flag::TYPE != 0 {
        p = p.with_type(r.short()?);
    }
    if flags & flag::USER_ID != 0 {
        p = p.with_user_id(r.short()?);
    }
    if flags & flag::APP_ID != 0 {
        p = p.with_app_id(r.short()?);
    }
    if flags & flag::CLUSTER_ID != 0 {
        p = p.with_cluster_id(r.short()?);
    }
    Ok((size, Properties { basic: p, headers }))
}

/// Append a content header frame's payload (class 60, weight 0, the body size, the
/// properties).
pub(crate) fn write_header(out: &mut Vec<u8>, size: u64, props: &Properties) {
    let p = &props.basic;
    fn short(o: &Option<amq_protocol::types::ShortString>) -> Option<&str> {
        o.as_ref().map(|s| s.as_str())
    }
    let shorts = [
        (flag::CONTENT_TYPE, short(p.content_type())),
        (flag::CONTENT_ENCODING, short(p.content_encoding())),
    ];
    let later = [
        (flag::CORRELATION_ID, short(p.correlation_id())),
        (flag::REPLY_TO, short(p.reply_to())),
        (flag::EXPIRATION, short(p.expiration())),
        (flag::MESSAGE_ID, short(p.message_id())),
    ];
    let last = [
        (flag::TYPE, short(p.kind())),
        (flag::USER_ID, short(p.user_id())),
        (flag::APP_ID, short(p.app_id())),
        (flag::CLUSTER_ID, short(p.cluster_id())),
    ];
    let mut flags = 0u16;
    for (f, v) in shorts.iter().chain(&later).chain(&last) {
        if v.is_some() {
            flags |= f;
        }
    }
    let set = |f: u16, on: bool| if on { f } else { 0 };
    flags |= set(flag::HEADERS, props.headers.is_some())
        | set(flag::DELIVERY_MODE, p.delivery_mode().is_some())
        | set(flag::PRIORITY, p.priority().is_some())
        | set(flag::TIMESTAMP, p.timestamp().is_some());
    out.extend_from_slice(&60u16.to_be_bytes());
    out.extend_from_slice(&0u16.to_be_bytes());
    out.extend_from_slice(&size.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    let put_short = |out: &mut Vec<u8>, s: &str| {
        // Short strings are at most 255 bytes; amq-protocol's types cannot hold more.
        let n = s.len().min(255);
        out.push(n as u8);
        out.extend_from_slice(&s.as_bytes()[..n]);
    };
    for (_, v) in &shorts {
        if let Some(s) = v {
            put_short(out, s);
        }
    }
    if let Some(h) = &props.headers {
        out.extend_from_slice(&(h.len() as u32).to_be_bytes());
        out.extend_from_slice(h);
    }
    if let Some(m) = p.delivery_mode() {
        out.push(*m);
    }
    if let Some(m) = p.priority() {
        out.push(*m);
    }
    for (_, v) in &later {
        if let Some(s) = v {
            put_short(out, s);
        }
    }
    if let Some(t) = p.timestamp() {
        out.extend_from_slice(&t.to_be_bytes());
    }
    for (_, v) in &last {
        if let Some(s) = v {
            put_short(out, s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::frame::{gen_frame, parse_frame, AMQPContentHeader, AMQPFrame};
    use amq_protocol::types::{FieldArray, LongString};

    fn full() -> BasicProperties {
        let mut death = FieldTable::default();
        death.insert("count".into(), AMQPValue::LongLongInt(3));
        death.insert("queue".into(), AMQPValue::LongString("work".into()));
        death.insert(
            "routing-keys".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString("rk".into())])),
        );
        let mut h = FieldTable::default();
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
        );
        h.insert("b".into(), AMQPValue::Boolean(true));
        h.insert("i8".into(), AMQPValue::ShortShortInt(-3));
        h.insert("u8".into(), AMQPValue::ShortShortUInt(3));
        h.insert("i16".into(), AMQPValue::ShortInt(-300));
        h.insert("u16".into(), AMQPValue::ShortUInt(300));
        h.insert("i32".into(), AMQPValue::LongInt(-70000));
        h.insert("u32".into(), AMQPValue::LongUInt(70000));
        h.insert("f".into(), AMQPValue::Float(1.5));
        h.insert("d".into(), AMQPValue::Double(2.5));
        h.insert(
            "dec".into(),
            AMQPValue::DecimalValue(amq_protocol::types::DecimalValue {
                scale: 2,
                value: 314,
            }),
        );
        h.insert("t".into(), AMQPValue::Timestamp(1_700_000_000));
        h.insert("x".into(), AMQPValue::ByteArray(vec![0, 255].into()));
        h.insert("v".into(), AMQPValue::Void);
        h.insert(
            "s".into(),
            AMQPValue::LongString(LongString::from(vec![0xff, b'a'])),
        );
        BasicProperties::default()
            .with_content_type("application/json".into())
            .with_content_encoding("gzip".into())
            .with_headers(h)
            .with_delivery_mode(2)
            .with_priority(4)
            .with_correlation_id("c".into())
            .with_reply_to("r".into())
            .with_expiration("60000".into())
            .with_message_id("m-1".into())
            .with_timestamp(42)
            .with_type("t".into())
            .with_user_id("guest".into())
            .with_app_id("app".into())
            .with_cluster_id("cl".into())
    }

    /// What amq-protocol generates for a header frame of `p`, and its payload.
    fn amq_header(p: &BasicProperties) -> Vec<u8> {
        let f = AMQPFrame::Header(
            1,
            AMQPContentHeader {
                class_id: 60,
                body_size: 7,
                properties: p.clone(),
            },
        );
        let bytes = cookie_factory::gen_simple(gen_frame(&f), Vec::new()).unwrap();
        bytes[7..bytes.len() - 1].to_vec()
    }

    #[test]
    fn parses_what_amq_protocol_writes_and_writes_what_it_parses() {
        for p in [
            full(),
            BasicProperties::default(),
            BasicProperties::default().with_message_id("m".into()),
        ] {
            let payload = amq_header(&p);
            let (size, ours) = parse_header(&payload).unwrap();
            assert_eq!(size, 7);
            assert_eq!(ours.to_basic(), p);
            let mut out = Vec::new();
            write_header(&mut out, 7, &ours);
            // Our frame parsed by amq-protocol gives the same properties back.
            let mut frame = vec![2, 0, 1];
            frame.extend_from_slice(&(out.len() as u32).to_be_bytes());
            frame.extend_from_slice(&out);
            frame.push(0xCE);
            match parse_frame(frame.as_slice()).unwrap().1 {
                AMQPFrame::Header(1, h) => {
                    assert_eq!(h.body_size, 7);
                    assert_eq!(h.properties, p);
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn reads_values_in_place() {
        let p = Properties::from(full());
        let h = p.headers().unwrap();
        assert_eq!(h.get("i16").and_then(Value::as_int), Some(-300));
        assert_eq!(h.get("u32").and_then(Value::as_int), Some(70000));
        assert_eq!(h.get("b").and_then(Value::as_str).as_deref(), Some("true"));
        assert_eq!(
            h.get("s").and_then(Value::as_str).as_deref(),
            Some("\u{fffd}a")
        );
        let Some(Value::Array(deaths)) = h.get("x-death") else {
            panic!("no x-death");
        };
        let Some(Value::Table(d)) = deaths.iter().next() else {
            panic!("no entry");
        };
        assert_eq!(d.get("count").and_then(Value::as_int), Some(3));
        assert_eq!(
            d.get("queue").and_then(Value::as_str).as_deref(),
            Some("work")
        );
        assert!(h.get("missing").is_none());
        assert!(h.contains("v"));
    }

    #[test]
    fn a_written_table_keeps_copied_entries_byte_for_byte() {
        let p = Properties::from(full());
        let mut w = TableWriter::default();
        for e in p
            .headers()
            .unwrap()
            .entries()
            .filter(|e| e.name != "x-death")
        {
            w.copy(&e);
        }
        w.long_string("x-replay-id", b"r1");
        w.long_long("x-replay-count", 2);
        let q = p.with_header_bytes(Some(w.into_bytes()));
        let t = q.to_basic().headers().clone().unwrap();
        assert!(!t.contains_key("x-death"));
        assert_eq!(
            t.inner().get("x-replay-count"),
            Some(&AMQPValue::LongLongInt(2))
        );
        assert_eq!(
            t.inner().get("x-replay-id"),
            Some(&AMQPValue::LongString("r1".into()))
        );
        assert_eq!(
            t.inner().get("dec"),
            full().headers().as_ref().unwrap().inner().get("dec")
        );
    }

    #[test]
    fn get_finds_what_the_entries_hold() {
        let p = Properties::from(full());
        let h = p.headers().unwrap();
        for e in h.entries() {
            assert_eq!(h.get(e.name), Some(e.value), "{}", e.name);
            assert_eq!(
                Value::size(&e.raw[1 + e.name.len()..]),
                Some(e.raw.len() - 1 - e.name.len())
            );
        }
    }

    #[test]
    fn the_last_of_a_name_given_twice_counts() {
        let mut w = TableWriter::default();
        w.long_long("n", 1);
        w.long_long("n", 2);
        let out = w.into_bytes();
        let t = Table(&out);
        assert_eq!(t.get("n").and_then(Value::as_int), Some(2));
    }

    #[test]
    fn malformed_tables_are_refused_not_read() {
        // A long string longer than its table.
        let mut bad_len = vec![1, b'a', b'S'];
        bad_len.extend_from_slice(&100u32.to_be_bytes());
        assert!(validate_table(&bad_len, 0).is_none());
        // An unknown type.
        assert!(validate_table(&[1, b'a', b'?'], 0).is_none());
        // A name that is not UTF-8.
        assert!(validate_table(&[1, 0xff, b'V'], 0).is_none());
        // Tables nested past the limit.
        let mut deep = vec![b'V'];
        for _ in 0..(MAX_DEPTH + 2) {
            let mut t = vec![1, b'a'];
            t.extend_from_slice(&deep);
            let mut v = vec![b'F'];
            v.extend_from_slice(&(t.len() as u32).to_be_bytes());
            v.extend_from_slice(&t);
            deep = v;
        }
        let mut top = vec![1, b'a'];
        top.extend_from_slice(&deep);
        assert!(validate_table(&top, 0).is_none());
        // A truncated header frame is an error, not a panic.
        let payload = amq_header(&full());
        for cut in [0, 5, 13, 20, payload.len() - 1] {
            assert!(parse_header(&payload[..cut]).is_err(), "cut at {cut}");
        }
    }
}
