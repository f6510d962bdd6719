//! A channel: synchronous requests (declare, bind, qos, consume, get, cancel, close), publishes
//! with their confirms, acks and nacks.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use amq_protocol::protocol::{basic, channel, confirm, exchange, queue, AMQPClass};
use amq_protocol::types::{FieldTable, ShortString};
use tokio::sync::mpsc;

use super::conn::{route_hash, Inner, Reply, CLOSE_WAIT};
use super::wire;
use super::{AmqpError, Confirm, Delivery, Publishable};

/// A channel of a [`super::Connection`]. Dropping it closes it (not awaited).
pub struct Channel {
    conn: Arc<Inner>,
    id: u16,
}

/// What `queue.declare` asks for.
#[derive(Clone, Debug, Default)]
pub struct QueueDeclare {
    /// Only check that it exists (404 NOT_FOUND closes the channel when it does not).
    pub passive: bool,
    /// Survives a broker restart.
    pub durable: bool,
    /// Only this connection may use it; gone with it.
    pub exclusive: bool,
    /// Deleted when its last consumer goes.
    pub auto_delete: bool,
}

/// A consumer's deliveries, in the order the broker sent them. The stream ends when the consumer
/// is cancelled (by us or by the broker) and fails when its channel or connection does.
pub struct Consumer {
    rx: mpsc::UnboundedReceiver<Result<Delivery, AmqpError>>,
    failed: bool,
}

impl futures::Stream for Consumer {
    type Item = Result<Delivery, AmqpError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.failed {
            return Poll::Ready(None);
        }
        let next = self.rx.poll_recv(cx);
        if let Poll::Ready(Some(Err(_))) = &next {
            self.failed = true;
        }
        next
    }
}

impl Channel {
    pub(crate) fn new(conn: Arc<Inner>, id: u16) -> Self {
        Self { conn, id }
    }

    /// Whether the channel (and its connection) is open.
    pub fn is_open(&self) -> bool {
        self.conn.shared.channel_open(self.id)
    }

    /// Send a synchronous request and wait for its reply.
    pub(crate) async fn call(&self, class: AMQPClass) -> Result<Reply, AmqpError> {
        let rx = self.conn.shared.request(self.id, class)?;
        rx.await.unwrap_or_else(|_| Err(AmqpError::closed()))
    }

    async fn call_method(&self, class: AMQPClass) -> Result<AMQPClass, AmqpError> {
        match self.call(class).await? {
            Reply::Method(m) => Ok(m),
            Reply::Get(_) => Err(AmqpError::Protocol(
                "a basic.get answer to another request".into(),
            )),
        }
    }

    /// `queue.declare`: the queue's ready messages and consumers.
    pub async fn queue_declare(
        &self,
        queue: &str,
        opts: QueueDeclare,
        arguments: FieldTable,
    ) -> Result<(String, u32, u32), AmqpError> {
        let m = self
            .call_method(AMQPClass::Queue(queue::AMQPMethod::Declare(
                queue::Declare {
                    queue: queue.into(),
                    passive: opts.passive,
                    durable: opts.durable,
                    exclusive: opts.exclusive,
                    auto_delete: opts.auto_delete,
                    nowait: false,
                    arguments,
                },
            )))
            .await?;
        match m {
            AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok)) => {
                Ok((ok.queue.to_string(), ok.message_count, ok.consumer_count))
            }
            other => Err(wrong("queue.declare-ok", &other)),
        }
    }

    /// `queue.bind`.
    pub async fn queue_bind(
        &self,
        queue: &str,
        exchange: &str,
        routing_key: &str,
    ) -> Result<(), AmqpError> {
        self.call_method(AMQPClass::Queue(queue::AMQPMethod::Bind(queue::Bind {
            queue: queue.into(),
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            nowait: false,
            arguments: FieldTable::default(),
        })))
        .await?;
        Ok(())
    }

    /// `exchange.declare` with `passive`: whether it exists is the answer (404 closes the
    /// channel when it does not).
    pub async fn exchange_declare_passive(&self, name: &str) -> Result<(), AmqpError> {
        self.call_method(AMQPClass::Exchange(exchange::AMQPMethod::Declare(
            exchange::Declare {
                exchange: name.into(),
                kind: "direct".into(),
                passive: true,
                durable: false,
                auto_delete: false,
                internal: false,
                nowait: false,
                arguments: FieldTable::default(),
            },
        )))
        .await?;
        Ok(())
    }

    /// `confirm.select`: from now on every publish gets a confirm.
    pub async fn confirm_select(&self) -> Result<(), AmqpError> {
        // Confirm mode before the request goes out: the broker numbers publishes from the
        // select, and no publish can come between (the caller awaits this first).
        self.conn.shared.confirming(self.id);
        self.call_method(AMQPClass::Confirm(confirm::AMQPMethod::Select(
            confirm::Select { nowait: false },
        )))
        .await?;
        Ok(())
    }

    /// `basic.qos` per consumer (`global: false`, the only kind quorum queues accept).
    pub async fn basic_qos(&self, prefetch: u16) -> Result<(), AmqpError> {
        self.call_method(AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos {
            prefetch_count: prefetch,
            global: false,
        })))
        .await?;
        Ok(())
    }

    /// `basic.consume` with acks.
    pub async fn basic_consume(&self, queue: &str, tag: &str) -> Result<Consumer, AmqpError> {
        let consume = AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
            queue: queue.into(),
            consumer_tag: tag.into(),
            no_local: false,
            no_ack: false,
            exclusive: false,
            nowait: false,
            arguments: FieldTable::default(),
        }));
        let (rx, deliveries) =
            self.conn
                .shared
                .consume(self.id, ShortString::from(tag), consume)?;
        rx.await.unwrap_or_else(|_| Err(AmqpError::closed()))?;
        Ok(Consumer {
            rx: deliveries,
            failed: false,
        })
    }

    /// `basic.cancel`: the consumer's stream ends after what the broker delivered before.
    pub async fn basic_cancel(&self, tag: &str) -> Result<(), AmqpError> {
        self.call_method(AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
            consumer_tag: tag.into(),
            nowait: false,
        })))
        .await?;
        Ok(())
    }

    /// `basic.get`: the queue's head, or `None` when it is empty; with `no_ack` it is settled
    /// as it is taken.
    pub async fn basic_get(
        &self,
        queue: &str,
        no_ack: bool,
    ) -> Result<Option<Delivery>, AmqpError> {
        match self
            .call(AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
                queue: queue.into(),
                no_ack,
            })))
            .await?
        {
            Reply::Get(d) => Ok(d.map(|d| *d)),
            Reply::Method(other) => Err(wrong("basic.get-ok", &other)),
        }
    }

    /// `basic.ack` (no reply: queued for the writer with whatever else is going out).
    pub fn basic_ack(&self, tag: u64, multiple: bool) -> Result<(), AmqpError> {
        let ack = AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
            delivery_tag: tag,
            multiple,
        }));
        self.conn.shared.send_on(self.id, ack)
    }

    /// `basic.nack` of one delivery.
    pub fn basic_nack(&self, tag: u64, requeue: bool) -> Result<(), AmqpError> {
        let nack = AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
            delivery_tag: tag,
            multiple: false,
            requeue,
        }));
        self.conn.shared.send_on(self.id, nack)
    }

    /// Publish; on a confirming channel the returned [`Confirm`] resolves to the broker's answer.
    /// The frames are queued for the writer at once, in call order (no await between calls).
    pub fn basic_publish(
        &self,
        exchange: &str,
        routing_key: &str,
        mandatory: bool,
        properties: impl Publishable,
        body: &[u8],
    ) -> Result<Option<Confirm>, AmqpError> {
        let route = if mandatory {
            route_hash(exchange, routing_key)
        } else {
            0
        };
        let (id, frame_max) = (self.id, self.conn.shared.frame_max);
        let encode = |out: &mut Vec<u8>| {
            wire::publish(out, id, exchange, routing_key, mandatory);
            wire::content(out, id, &properties, body, frame_max)
        };
        let rx = self
            .conn
            .shared
            .publish(self.id, encode, route, body.len())?;
        Ok(rx.map(Confirm))
    }

    /// Close the channel; unacked deliveries go back to their queues.
    pub async fn close(&self, code: u16, text: &str) -> Result<(), AmqpError> {
        if !self.is_open() {
            return Ok(());
        }
        let close = self.call_method(AMQPClass::Channel(channel::AMQPMethod::Close(
            channel::Close {
                reply_code: code,
                reply_text: text.into(),
                class_id: 0,
                method_id: 0,
            },
        )));
        match tokio::time::timeout(CLOSE_WAIT, close).await {
            Ok(res) => res.map(|_| ()),
            Err(_) => Err(AmqpError::Closed(format!(
                "no close-ok for channel {} within {}s",
                self.id,
                CLOSE_WAIT.as_secs()
            ))),
        }
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        let shared = &self.conn.shared;
        if shared.channel_open(self.id) {
            // Not awaited: the broker's close-ok forgets the channel when it comes.
            let close = AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code: 200,
                reply_text: "dropped".into(),
                class_id: 0,
                method_id: 0,
            }));
            let _ = shared.request(self.id, close);
        } else {
            shared.forget(self.id);
        }
    }
}

fn wrong(wanted: &str, got: &AMQPClass) -> AmqpError {
    AmqpError::Protocol(format!("expected {wanted}, got {got:?}"))
}
