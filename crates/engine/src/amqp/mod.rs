//! The engine's AMQP 0-9-1 client: one connection is two tokio tasks (a reader and a writer)
//! on amq-protocol's codec, the same parser, URI and TLS code lapin uses.
//!
//! Why not lapin: lapin runs one OS thread per connection, and every publish, delivery and
//! confirm is handed across to it and back; measured, 29–33 µs of CPU per replayed message
//! (bench/RESULTS.md, issue 21) before the replay does any work of its own. Here a publish is
//! frames appended to a buffer the writer task sends with the others of its step, a delivery is
//! a value the reader task puts in the consumer's queue, and with the CLI's current-thread
//! runtime none of it leaves the thread.
//!
//! What the engine needs and this client guarantees:
//! - every publish on a confirming channel gets its own [`Confirm`], resolved by the broker's
//!   `basic.ack`/`basic.nack` (single or `multiple`), carrying the `basic.return` of a mandatory
//!   publish that no queue took;
//! - a channel or connection that closes fails every pending call and confirm with the broker's
//!   reply code and text ([`AmqpError`]), so "not found" and "connection lost" stay apart;
//! - calls are cancel-safe: a dropped call's reply is still taken off the wire in order;
//! - heartbeats both ways, `connection.blocked` noted, consumer cancel notifications honoured.

mod channel;
mod conn;
mod error;
mod handshake;
mod io;
pub mod props;
mod wire;

pub use amq_protocol::protocol::BasicProperties;
pub use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
pub use channel::{Channel, Consumer, QueueDeclare};
pub use conn::Connection;
pub use error::AmqpError;
pub use props::{Array, Entry, Properties, Publishable, Table, TableWriter, Value};

/// A message taken from a queue (by a consumer or by `basic.get`).
#[derive(Clone, Debug, PartialEq)]
pub struct Delivery {
    /// The channel's tag for it: what acks and nacks name.
    pub delivery_tag: u64,
    /// The exchange it was last published to.
    pub exchange: ShortString,
    /// Its routing key.
    pub routing_key: ShortString,
    /// Whether it was delivered before.
    pub redelivered: bool,
    /// Its properties (headers included, kept as they came: see [`Properties`]).
    pub properties: Properties,
    /// Its body.
    pub data: Vec<u8>,
}

/// A mandatory publish the broker could not route, as it came back.
#[derive(Clone, Debug, PartialEq)]
pub struct Returned {
    /// The broker's reply code (312 NO_ROUTE).
    pub reply_code: u16,
    /// The broker's reply text.
    pub reply_text: ShortString,
}

/// The broker's answer to one publish on a confirming channel.
#[derive(Clone, Debug, PartialEq)]
pub enum Confirmation {
    /// The broker took responsibility; with `Some`, it returned the message first (no queue
    /// took it).
    Ack(Option<Returned>),
    /// The broker refused it (e.g. a queue's overflow `reject-publish`).
    Nack(Option<Returned>),
}

/// The confirm of one publish: resolves when the broker acks or nacks it, or fails when its
/// channel or connection closes first (its outcome is then unknown).
#[derive(Debug)]
pub struct Confirm(tokio::sync::oneshot::Receiver<Result<Confirmation, AmqpError>>);

impl std::future::Future for Confirm {
    type Output = Result<Confirmation, AmqpError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0)
            .poll(cx)
            .map(|r| r.unwrap_or_else(|_| Err(AmqpError::closed())))
    }
}
