//! A connection: the handshake, then a reader task that routes each frame to its channel and a
//! writer task that sends what the channels queued, a write per batch.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use amq_protocol::protocol::{basic, channel, connection, AMQPClass};
use amq_protocol::tcp::{AMQPUriTcpExt, TLSConfig};
use amq_protocol::types::ShortString;
use amq_protocol::uri::AMQPUri;
use tokio::sync::{mpsc, oneshot};

use super::channel::Channel;
use super::handshake::handshake;
use super::io::{read_loop, write_loop};
use super::wire::{self, ReadBuf};
use super::{AmqpError, Confirmation, Delivery, Returned};

/// An open connection. Cloning it is cheap; the connection closes when [`Connection::close`] is
/// called or the last clone (and the last of its channels) is dropped.
#[derive(Clone)]
pub struct Connection {
    pub(crate) inner: Arc<Inner>,
}

/// How long a close waits for the broker's close-ok.
pub(crate) const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// What the connection's users share; dropping the last one stops the tasks.
pub(crate) struct Inner {
    pub(crate) shared: Arc<Shared>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Nobody can use the connection any more: close it (best effort, not awaited).
        let _ = self.shared.close_frame(200, "dropped");
    }
}

/// The state the reader task and the callers share.
pub(crate) struct Shared {
    pub(super) state: Mutex<State>,
    /// Bytes were queued in [`State::out`] for the writer.
    pub(super) wake: tokio::sync::Notify,
    /// Cancelled when the reader ends: the writer sends what is queued and closes the socket.
    pub(super) stop: tokio_util::sync::CancellationToken,
    pub(crate) frame_max: usize,
    pub(super) channel_max: u16,
}

#[derive(Default)]
pub(crate) struct State {
    pub(super) channels: HashMap<u16, Chan>,
    /// Why the connection is closed, once it is.
    pub(super) closed: Option<AmqpError>,
    /// The broker said `connection.blocked` (a resource alarm) and not `unblocked` since.
    pub(super) blocked: Option<String>,
    /// The channel id handed out last.
    pub(super) last_channel: u16,
    /// Frames queued for the writer, in the order they were queued (the lock orders them): a
    /// step's publishes leave in one write, and nothing is allocated per frame.
    pub(super) out: Vec<u8>,
}

/// A channel's side of the shared state.
#[derive(Default)]
pub(crate) struct Chan {
    /// Synchronous requests sent, in order: each reply answers the first.
    pub(super) rpc: VecDeque<oneshot::Sender<Result<Reply, AmqpError>>>,
    /// The consumer and where its deliveries go.
    pub(super) consumer: Option<(
        ShortString,
        mpsc::UnboundedSender<Result<Delivery, AmqpError>>,
    )>,
    /// In confirm mode: the next publish's number and the publishes awaiting their confirm.
    pub(crate) confirms: Option<Confirms>,
    /// A delivery, `basic.get` answer or return whose content frames are still coming.
    pub(super) incoming: Option<Incoming>,
    /// Why the channel closed, once it did.
    pub(super) closed: Option<AmqpError>,
}

/// Where a synchronous request's reply comes.
pub(crate) type ReplyRx = oneshot::Receiver<Result<Reply, AmqpError>>;
/// Where a consumer's deliveries come.
pub(crate) type DeliveryRx = mpsc::UnboundedReceiver<Result<Delivery, AmqpError>>;

/// The reply to a synchronous request.
pub(crate) enum Reply {
    Method(AMQPClass),
    /// `basic.get-ok` with its message, or `basic.get-empty`.
    Get(Option<Box<Delivery>>),
}

#[derive(Default)]
pub(crate) struct Confirms {
    next: u64,
    pending: VecDeque<Pending>,
}

/// A publish awaiting its confirm. The return of a mandatory publish does not name it, so it is
/// matched by what it carries (exchange, routing key, body size) to the earliest publish it fits.
struct Pending {
    seq: u64,
    route: u64,
    body_len: usize,
    returned: Option<Returned>,
    tx: oneshot::Sender<Result<Confirmation, AmqpError>>,
}

pub(crate) enum Kind {
    Deliver(basic::Deliver),
    Get(basic::GetOk),
    Return(basic::Return),
}

pub(crate) struct Incoming {
    pub(super) kind: Kind,
    pub(super) size: Option<u64>,
    pub(super) properties: super::Properties,
    pub(super) body: Vec<u8>,
}

impl Connection {
    /// Connect to one broker URL (`amqp://` or `amqps://`; vhost, `heartbeat`, `frame_max`,
    /// `channel_max` and `auth_mechanism` as lapin reads them) and log in; `name` is what the
    /// management UI shows for it.
    pub async fn connect(url: &str, name: &str) -> Result<Self, AmqpError> {
        let uri: AMQPUri = url.parse().map_err(AmqpError::Protocol)?;
        let runtime = async_rs::Runtime::tokio_current();
        let stream = uri
            .connect_with_config_async(TLSConfig::default(), &runtime)
            .await?;
        let (mut r, mut w) = futures::io::AsyncReadExt::split(stream);
        let mut rb = ReadBuf::new();
        let tune = handshake(&uri, name, &mut r, &mut w, &mut rb).await?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            wake: tokio::sync::Notify::new(),
            stop: tokio_util::sync::CancellationToken::new(),
            frame_max: tune.frame_max as usize,
            channel_max: tune.channel_max,
        });
        let beat = Duration::from_secs(u64::from(tune.heartbeat));
        tokio::spawn(write_loop(w, beat, shared.clone()));
        tokio::spawn(read_loop(r, rb, beat, shared.clone()));
        Ok(Self {
            inner: Arc::new(Inner { shared }),
        })
    }

    /// Open a channel.
    pub async fn create_channel(&self) -> Result<Channel, AmqpError> {
        let id = self.inner.shared.open_channel()?;
        let ch = Channel::new(self.inner.clone(), id);
        ch.call(AMQPClass::Channel(channel::AMQPMethod::Open(
            channel::Open {},
        )))
        .await?;
        Ok(ch)
    }

    /// Whether the connection is open.
    pub fn is_open(&self) -> bool {
        self.inner.shared.lock().closed.is_none()
    }

    /// Why the broker blocks publishes on this connection (a memory or disk alarm), if it does.
    pub fn blocked(&self) -> Option<String> {
        self.inner.shared.lock().blocked.clone()
    }

    /// Close the connection and wait for the broker to confirm it (or for it to be gone).
    pub async fn close(&self, code: u16, text: &str) -> Result<(), AmqpError> {
        let (tx, rx) = oneshot::channel();
        {
            let mut st = self.inner.shared.lock();
            if st.closed.is_some() {
                return Ok(());
            }
            st.channels.entry(0).or_default().rpc.push_back(tx);
        }
        self.inner.shared.close_frame(code, text)?;
        // A broker that vanished without a reset would otherwise keep us until the heartbeat
        // gives up; the socket is closed either way.
        let _ = tokio::time::timeout(CLOSE_WAIT, rx).await;
        Ok(())
    }
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data behind: still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn close_frame(&self, code: u16, text: &str) -> Result<(), AmqpError> {
        let close = AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
            reply_code: code,
            reply_text: text.into(),
            class_id: 0,
            method_id: 0,
        }));
        self.append_method(&mut self.lock(), 0, close)
    }

    /// Append frames to the writer's queue, encoded in place (the caller holds the lock, which
    /// orders them); on an encoding error none of them stays.
    pub(super) fn append(
        &self,
        st: &mut State,
        encode: impl FnOnce(&mut Vec<u8>) -> Result<(), AmqpError>,
    ) -> Result<(), AmqpError> {
        let mark = st.out.len();
        if let Err(e) = encode(&mut st.out) {
            st.out.truncate(mark);
            return Err(e);
        }
        self.wake.notify_one();
        Ok(())
    }

    /// [`Shared::append`] of one method frame.
    pub(super) fn append_method(
        &self,
        st: &mut State,
        channel: u16,
        class: AMQPClass,
    ) -> Result<(), AmqpError> {
        self.append(st, |out| wire::method(out, channel, class))
    }

    fn open_channel(&self) -> Result<u16, AmqpError> {
        let mut st = self.lock();
        if let Some(e) = &st.closed {
            return Err(e.clone());
        }
        let max = if self.channel_max == 0 {
            u16::MAX
        } else {
            self.channel_max
        };
        // Ids are handed out in turn, not lowest-free first: a handle to a channel that closed
        // (and is forgotten when dropped) must not name a new channel on the same id meanwhile.
        let start = st.last_channel;
        let id = (1..=max)
            .map(|i| ((u32::from(start) + u32::from(i) - 1) % u32::from(max) + 1) as u16)
            .find(|id| !st.channels.contains_key(id))
            .ok_or_else(|| AmqpError::Protocol(format!("all {max} channels are in use")))?;
        st.last_channel = id;
        st.channels.insert(id, Chan::default());
        Ok(id)
    }

    /// Send a synchronous request on `channel` and register for its reply, in the order the
    /// requests go out (so replies, which come in request order, find their caller).
    pub(crate) fn request(&self, channel: u16, class: AMQPClass) -> Result<ReplyRx, AmqpError> {
        let (tx, rx) = oneshot::channel();
        let mut st = self.lock();
        self.send_locked(&mut st, channel, class)?;
        st.usable(channel)?.rpc.push_back(tx);
        Ok(rx)
    }

    /// Send a method on an open `channel` (no reply expected).
    pub(crate) fn send_on(&self, channel: u16, class: AMQPClass) -> Result<(), AmqpError> {
        self.send_locked(&mut self.lock(), channel, class)
    }

    fn send_locked(&self, st: &mut State, channel: u16, class: AMQPClass) -> Result<(), AmqpError> {
        st.usable(channel)?;
        self.append_method(st, channel, class)
    }

    /// Register a consumer's queue before its `basic.consume` goes out: deliveries may follow
    /// the `consume-ok` at once.
    pub(crate) fn consume(
        &self,
        channel: u16,
        tag: ShortString,
        class: AMQPClass,
    ) -> Result<(ReplyRx, DeliveryRx), AmqpError> {
        let (dtx, drx) = mpsc::unbounded_channel();
        let (tx, rx) = oneshot::channel();
        let mut st = self.lock();
        self.send_locked(&mut st, channel, class)?;
        let chan = st.usable(channel)?;
        chan.consumer = Some((tag, dtx));
        chan.rpc.push_back(tx);
        Ok((rx, drx))
    }

    /// Number and queue a publish on a channel (in confirm mode: with its confirm); `encode`
    /// appends its frames to the writer's queue.
    pub(crate) fn publish(
        &self,
        channel: u16,
        encode: impl FnOnce(&mut Vec<u8>) -> Result<(), AmqpError>,
        route: u64,
        body_len: usize,
    ) -> Result<Option<oneshot::Receiver<Result<Confirmation, AmqpError>>>, AmqpError> {
        let mut st = self.lock();
        st.usable(channel)?;
        self.append(&mut st, encode)?;
        let chan = st.usable(channel)?;
        let rx = chan.confirms.as_mut().map(|c| {
            let (tx, rx) = oneshot::channel();
            c.next += 1;
            c.pending.push_back(Pending {
                seq: c.next,
                route,
                body_len,
                returned: None,
                tx,
            });
            rx
        });
        Ok(rx)
    }

    /// Put a channel in confirm mode (numbering starts at 1 with the next publish).
    pub(crate) fn confirming(&self, channel: u16) {
        if let Some(chan) = self.lock().channels.get_mut(&channel) {
            chan.confirms.get_or_insert_with(Confirms::default);
        }
    }

    pub(crate) fn channel_open(&self, channel: u16) -> bool {
        let st = self.lock();
        st.closed.is_none()
            && st
                .channels
                .get(&channel)
                .is_some_and(|c| c.closed.is_none())
    }

    /// Forget a channel (closed by us, or dropped).
    pub(crate) fn forget(&self, channel: u16) {
        let chan = self.lock().channels.remove(&channel);
        if let Some(chan) = chan {
            chan.fail(&AmqpError::Closed(format!("channel {channel} was closed")));
        }
    }
}

impl State {
    fn usable(&mut self, channel: u16) -> Result<&mut Chan, AmqpError> {
        if let Some(e) = &self.closed {
            return Err(e.clone());
        }
        let chan = self
            .channels
            .get_mut(&channel)
            .ok_or_else(|| AmqpError::Closed(format!("channel {channel} is closed")))?;
        match &chan.closed {
            Some(e) => Err(e.clone()),
            None => Ok(chan),
        }
    }

    /// The connection is gone: everything waiting learns why.
    pub(super) fn fail_all(&mut self, e: AmqpError) {
        for (_, chan) in self.channels.drain() {
            chan.fail(&e);
        }
        self.closed.get_or_insert(e);
    }
}

impl Chan {
    pub(super) fn fail(self, e: &AmqpError) {
        for tx in self.rpc {
            let _ = tx.send(Err(e.clone()));
        }
        if let Some((_, tx)) = self.consumer {
            let _ = tx.send(Err(e.clone()));
        }
        for p in self.confirms.into_iter().flat_map(|c| c.pending) {
            let _ = p.tx.send(Err(e.clone()));
        }
    }

    pub(super) fn reply(&mut self, r: Reply) {
        if let Some(tx) = self.rpc.pop_front() {
            // A caller that gave up (dropped its call) is not waiting: nothing to tell.
            let _ = tx.send(Ok(r));
        }
    }

    /// `basic.ack`/`basic.nack` from the broker: resolve the publishes it covers.
    pub(super) fn confirmed(&mut self, tag: u64, multiple: bool, ack: bool) {
        let Some(c) = self.confirms.as_mut() else {
            return;
        };
        let resolve = |p: Pending| {
            let _ = p.tx.send(Ok(if ack {
                Confirmation::Ack(p.returned)
            } else {
                Confirmation::Nack(p.returned)
            }));
        };
        if multiple {
            // tag 0 with multiple: every outstanding publish.
            while c.pending.front().is_some_and(|p| tag == 0 || p.seq <= tag) {
                if let Some(p) = c.pending.pop_front() {
                    resolve(p);
                }
            }
        } else if let Some(i) = c.pending.iter().position(|p| p.seq == tag) {
            if let Some(p) = c.pending.remove(i) {
                resolve(p);
            }
        }
    }

    /// A return: the earliest unconfirmed publish it fits (returns come in publish order,
    /// before the confirm of the publish they return).
    pub(super) fn returned(&mut self, r: basic::Return, body_len: usize) {
        let route = route_hash(r.exchange.as_str(), r.routing_key.as_str());
        let Some(c) = self.confirms.as_mut() else {
            tracing::warn!(exchange = %r.exchange, routing_key = %r.routing_key, "a message came back from the broker on a channel without confirms");
            return;
        };
        let found = c
            .pending
            .iter_mut()
            .find(|p| p.returned.is_none() && p.route == route && p.body_len == body_len);
        match found {
            Some(p) => {
                p.returned = Some(Returned {
                    reply_code: r.reply_code,
                    reply_text: r.reply_text,
                })
            }
            None => {
                tracing::warn!(exchange = %r.exchange, routing_key = %r.routing_key, "a returned message matches no publish awaiting its confirm")
            }
        }
    }
}

/// What a return is matched on besides the body's size.
pub(crate) fn route_hash(exchange: &str, routing_key: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    exchange.hash(&mut h);
    routing_key.hash(&mut h);
    h.finish()
}
