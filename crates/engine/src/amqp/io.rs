//! The connection's two tasks: the writer sends what the channels queued, everything queued at
//! once; the reader parses frames and routes each to its channel (replies, deliveries,
//! confirms, returns, closes).

use std::sync::Arc;
use std::time::Duration;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, channel, connection, AMQPClass};
use futures::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::conn::{Chan, Incoming, Kind, Reply, Shared, State};
use super::handshake::unexpected;
use super::wire::{self, Frame, ReadBuf};
use super::{AmqpError, Delivery, Properties};

/// Send what the channels queue, everything queued at once; a heartbeat when nothing else was
/// sent for half the interval.
pub(super) async fn write_loop<W: AsyncWrite + Unpin>(
    mut w: W,
    beat: Duration,
    shared: Arc<Shared>,
) {
    let idle = if beat.is_zero() {
        Duration::from_secs(3600)
    } else {
        beat / 2
    };
    // Swapped with the queue: both keep their capacity, so nothing is allocated per write.
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let stop = tokio::select! {
            biased;
            _ = shared.wake.notified() => false,
            _ = shared.stop.cancelled() => true,
            _ = tokio::time::sleep(idle) => {
                shared.lock().out.extend_from_slice(&wire::heartbeat());
                false
            }
        };
        std::mem::swap(&mut shared.lock().out, &mut buf);
        if !buf.is_empty() {
            let res = async {
                w.write_all(&buf).await?;
                w.flush().await
            }
            .await;
            buf.clear();
            if let Err(e) = res {
                shared.lock().fail_all(AmqpError::from(e));
                shared.stop.cancel();
                break;
            }
        }
        if stop {
            break;
        }
    }
    let _ = w.close().await;
}

/// Read frames and route them until the connection ends.
pub(super) async fn read_loop<R: AsyncRead + Unpin>(
    mut r: R,
    mut rb: ReadBuf,
    beat: Duration,
    shared: Arc<Shared>,
) {
    let end = loop {
        if let Some(e) = route_all(&shared, &mut rb) {
            break e;
        }
        let read = rb.fill(&mut r);
        let res = if beat.is_zero() {
            read.await
        } else {
            match tokio::time::timeout(beat * 2, read).await {
                Ok(res) => res,
                Err(_) => Err(AmqpError::MissingHeartbeat(beat.as_secs() * 2)),
            }
        };
        if let Err(e) = res {
            break e;
        }
    };
    shared.lock().fail_all(end);
    shared.stop.cancel();
}

/// Route every whole frame a read brought, under one lock; `Some` ends the connection.
fn route_all(shared: &Shared, rb: &mut ReadBuf) -> Option<AmqpError> {
    let mut st = shared.lock();
    loop {
        match rb.next_frame() {
            Ok(Some(Frame::Header(ch, size, properties))) => {
                if let Some(chan) = st.channels.get_mut(&ch) {
                    header(chan, size, properties);
                }
            }
            Ok(Some(Frame::Amqp(frame))) => {
                if let Some(e) = route(shared, &mut st, frame) {
                    return Some(e);
                }
            }
            Ok(None) => return None,
            Err(e) => return Some(e),
        }
    }
}

/// A content header: the message being received on `chan` has its size and properties.
fn header(chan: &mut Chan, size: u64, properties: Properties) {
    if let Some(inc) = chan.incoming.as_mut() {
        inc.size = Some(size);
        inc.properties = properties;
    }
    complete(chan);
}

/// Route one frame; `Some` ends the connection (with why).
fn route(shared: &Shared, st: &mut State, frame: AMQPFrame) -> Option<AmqpError> {
    match frame {
        AMQPFrame::Heartbeat => None,
        AMQPFrame::Method(0, AMQPClass::Connection(m)) => connection_method(shared, st, m),
        AMQPFrame::Method(ch, AMQPClass::Channel(channel::AMQPMethod::Close(c))) => {
            let e = AmqpError::ChannelClosed {
                code: c.reply_code,
                text: c.reply_text.to_string(),
            };
            if let Some(chan) = st.channels.get_mut(&ch) {
                tracing::debug!(channel = ch, error = %e, "the broker closed a channel");
                // The channel stays known, closed, so its users learn why.
                let taken = std::mem::take(chan);
                chan.closed = Some(e.clone());
                taken.fail(&e);
            }
            let ok = AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {}));
            shared.append_method(st, ch, ok).err()
        }
        AMQPFrame::Method(ch, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))) => {
            if let Some(mut chan) = st.channels.remove(&ch) {
                chan.reply(Reply::Method(AMQPClass::Channel(
                    channel::AMQPMethod::CloseOk(channel::CloseOk {}),
                )));
                chan.fail(&AmqpError::Closed(format!("channel {ch} was closed")));
            }
            None
        }
        AMQPFrame::Method(ch, m) => {
            let chan = st.channels.get_mut(&ch)?;
            channel_method(chan, m);
            None
        }
        AMQPFrame::Body(ch, data) => {
            let chan = st.channels.get_mut(&ch)?;
            if let Some(inc) = chan.incoming.as_mut() {
                // The first frame's buffer becomes the body: a body of one frame (the usual
                // case) is not copied, and one of several grows once to its whole size.
                if inc.body.is_empty() {
                    inc.body = data;
                    let size = inc.size.unwrap_or(0) as usize;
                    inc.body.reserve_exact(size.saturating_sub(inc.body.len()));
                } else {
                    inc.body.extend_from_slice(&data);
                }
            }
            complete(chan);
            None
        }
        other => Some(AmqpError::Protocol(format!("unexpected frame {other:?}"))),
    }
}

fn connection_method(
    shared: &Shared,
    st: &mut State,
    m: connection::AMQPMethod,
) -> Option<AmqpError> {
    match m {
        connection::AMQPMethod::Close(c) => {
            let ok = AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {}));
            // Best effort: the connection ends either way.
            let _ = shared.append_method(st, 0, ok);
            Some(AmqpError::ConnectionClosed {
                code: c.reply_code,
                text: c.reply_text.to_string(),
            })
        }
        connection::AMQPMethod::CloseOk(_) => {
            if let Some(chan) = st.channels.get_mut(&0) {
                chan.reply(Reply::Method(AMQPClass::Connection(
                    connection::AMQPMethod::CloseOk(connection::CloseOk {}),
                )));
            }
            Some(AmqpError::Closed("the connection was closed".into()))
        }
        connection::AMQPMethod::Blocked(b) => {
            tracing::warn!(reason = %b.reason, "the broker blocks publishing on this connection");
            st.blocked = Some(b.reason.to_string());
            None
        }
        connection::AMQPMethod::Unblocked(_) => {
            st.blocked = None;
            None
        }
        other => Some(unexpected(
            "a connection method",
            &AMQPClass::Connection(other),
        )),
    }
}

fn channel_method(chan: &mut Chan, m: AMQPClass) {
    match m {
        AMQPClass::Basic(basic::AMQPMethod::Deliver(d)) => {
            chan.incoming = Some(incoming(Kind::Deliver(d)))
        }
        AMQPClass::Basic(basic::AMQPMethod::GetOk(g)) => {
            chan.incoming = Some(incoming(Kind::Get(g)))
        }
        AMQPClass::Basic(basic::AMQPMethod::Return(r)) => {
            chan.incoming = Some(incoming(Kind::Return(r)))
        }
        AMQPClass::Basic(basic::AMQPMethod::GetEmpty(_)) => chan.reply(Reply::Get(None)),
        AMQPClass::Basic(basic::AMQPMethod::Ack(a)) => {
            chan.confirmed(a.delivery_tag, a.multiple, true)
        }
        AMQPClass::Basic(basic::AMQPMethod::Nack(n)) => {
            chan.confirmed(n.delivery_tag, n.multiple, false)
        }
        // The broker cancelled the consumer (its queue was deleted, a quorum queue's leader
        // moved away...): its stream ends after what was delivered.
        AMQPClass::Basic(basic::AMQPMethod::Cancel(c)) => {
            if chan
                .consumer
                .as_ref()
                .is_some_and(|(t, _)| *t == c.consumer_tag)
            {
                tracing::warn!(consumer = %c.consumer_tag, "the broker cancelled the consumer");
                chan.consumer = None;
            }
        }
        AMQPClass::Basic(basic::AMQPMethod::CancelOk(c)) => {
            if chan
                .consumer
                .as_ref()
                .is_some_and(|(t, _)| *t == c.consumer_tag)
            {
                chan.consumer = None;
            }
            chan.reply(Reply::Method(AMQPClass::Basic(
                basic::AMQPMethod::CancelOk(c),
            )));
        }
        other => chan.reply(Reply::Method(other)),
    }
}

fn incoming(kind: Kind) -> Incoming {
    Incoming {
        kind,
        size: None,
        properties: Properties::default(),
        body: Vec::new(),
    }
}

/// A message whose content is all here goes where it belongs.
fn complete(chan: &mut Chan) {
    let done = chan
        .incoming
        .as_ref()
        .is_some_and(|i| i.size.is_some_and(|s| i.body.len() as u64 >= s));
    if !done {
        return;
    }
    let Some(inc) = chan.incoming.take() else {
        return;
    };
    match inc.kind {
        Kind::Deliver(d) => {
            let msg = Delivery {
                delivery_tag: d.delivery_tag,
                exchange: d.exchange,
                routing_key: d.routing_key,
                redelivered: d.redelivered,
                properties: inc.properties,
                data: inc.body,
            };
            if let Some((_, tx)) = &chan.consumer {
                let _ = tx.send(Ok(msg));
            }
        }
        Kind::Get(g) => chan.reply(Reply::Get(Some(Box::new(Delivery {
            delivery_tag: g.delivery_tag,
            exchange: g.exchange,
            routing_key: g.routing_key,
            redelivered: g.redelivered,
            properties: inc.properties,
            data: inc.body,
        })))),
        Kind::Return(r) => {
            let len = inc.body.len();
            chan.returned(r, len)
        }
    }
}
