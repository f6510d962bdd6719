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
//! By file: this one holds the type and its conversions, `table` reads and writes the headers'
//! field table in place, `header` parses and writes the content header frame.

mod header;
mod table;
#[cfg(test)]
mod tests;

use amq_protocol::protocol::BasicProperties;
use amq_protocol::types::FieldTable;

pub use header::Publishable;
pub(crate) use header::{parse_header, short_string};
pub use table::{Array, Entries, Entry, Table, TableWriter, Value};

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
