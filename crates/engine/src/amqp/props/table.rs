//! The headers' field table, read in place and written entry by entry.

use std::borrow::Cow;

use amq_protocol::types::{AMQPValue, FieldTable};

use super::header::short_string;
use super::Properties;

/// Deepest nesting of arrays and tables accepted in headers (a frame is at most `frame_max`
/// bytes, but a table nested in itself that deep would exhaust the stack of any reader).
pub(super) const MAX_DEPTH: usize = 64;

/// An encoded field table, read in place.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Table<'a>(pub(super) &'a [u8]);

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
    pub(super) fn size(input: &[u8]) -> Option<usize> {
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
pub(super) fn validate_table(entries: &[u8], depth: usize) -> Option<()> {
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

    /// A writer holding `props`' header entries as they came, but those `leave` names, with
    /// room for `more` bytes of entries after them.
    pub fn copy_of(props: &Properties, more: usize, leave: impl Fn(&str) -> bool) -> Self {
        let mut w = Self::with_capacity(props.header_bytes().map_or(0, <[u8]>::len) + more);
        for e in props.headers().into_iter().flat_map(Table::entries) {
            if !leave(e.name) {
                w.copy(&e);
            }
        }
        w
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
        short_string(&mut self.0, name);
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
