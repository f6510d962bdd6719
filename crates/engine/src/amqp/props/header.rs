//! The content header frame: parsed into [`Properties`] (the headers kept as bytes, validated
//! by [`super::table`]) and written from them.

use amq_protocol::protocol::BasicProperties;

use super::table::validate_table;
use super::Properties;
use crate::amqp::AmqpError;

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

/// Append a short string: its length octet, then its bytes. Short strings are at most 255
/// bytes (amq-protocol's types cannot hold more, nor can the engine's names: see
/// `classify::destination`); a longer one is cut.
pub(crate) fn short_string(out: &mut Vec<u8>, s: &str) {
    let n = s.len().min(255);
    out.push(n as u8);
    out.extend_from_slice(&s.as_bytes()[..n]);
}

/// A cursor over a header frame's payload.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Result<&'a [u8], AmqpError> {
        let b = self
            .0
            .get(..n)
            .ok_or_else(|| bad("a content header is cut short"))?;
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
    for (_, v) in &shorts {
        if let Some(s) = v {
            short_string(out, s);
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
            short_string(out, s);
        }
    }
    if let Some(t) = p.timestamp() {
        out.extend_from_slice(&t.to_be_bytes());
    }
    for (_, v) in &last {
        if let Some(s) = v {
            short_string(out, s);
        }
    }
}
