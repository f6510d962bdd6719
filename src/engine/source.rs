//! The dead-letter queue side: depth at start, a prefetching consumer, acks, and leaving the
//! messages that stay (skipped, failed, held back) exactly where they are.
//!
//! Messages that stay are never acked, nacked or republished while the replay runs: they stay
//! unacked on the consuming channel, and closing the channel hands them back to the queue in
//! their original positions with headers, properties and body untouched. Because they count
//! against the prefetch window, the channel-wide prefetch grows with them.

use std::time::Duration;

use futures::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, Consumer};

use crate::Error;

/// The largest prefetch AMQP can express.
const MAX_PREFETCH: u32 = u16::MAX as u32;

/// Ready messages and consumers of a queue, or `None` when the queue does not exist.
pub async fn queue_state(conn: &Connection, queue: &str) -> Result<Option<(u32, u32)>, Error> {
    // A passive declare of a missing queue closes its channel, so it gets a channel of its own.
    let ch = conn.create_channel().await?;
    let res = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::default().passive(),
            FieldTable::default(),
        )
        .await;
    match res {
        Ok(q) => {
            let _ = ch.close(200, "ok".into()).await;
            Ok(Some((q.message_count(), q.consumer_count())))
        }
        Err(e) if is_not_found(&e) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// True when the broker answered 404 NOT_FOUND.
pub fn is_not_found(e: &lapin::Error) -> bool {
    e.to_string().contains("NOT_FOUND")
}

/// A consumer on the dead-letter queue.
pub struct Source {
    channel: Channel,
    consumer: Consumer,
    window: u32,
    held: u32,
    prefetch: u32,
}

impl Source {
    /// Start consuming `queue` with `window` messages in flight (plus the held ones).
    pub async fn open(conn: &Connection, queue: &str, window: u16) -> Result<Self, Error> {
        let channel = conn.create_channel().await?;
        // Channel-wide (global) prefetch, because RabbitMQ applies a changed global limit to the
        // running consumer, which lets it grow as messages are held.
        channel
            .basic_qos(window, BasicQosOptions { global: true })
            .await?;
        let consumer = channel
            .basic_consume(
                queue.into(),
                "dlq-replay".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok(Self {
            channel,
            consumer,
            window: window.into(),
            held: 0,
            prefetch: window.into(),
        })
    }

    /// Wait up to `idle` for one delivery, then take whatever else is ready, up to `max`.
    /// Returns an empty batch when nothing came within `idle`.
    pub async fn next_batch(&mut self, max: usize, idle: Duration) -> Result<Vec<Delivery>, Error> {
        let mut batch = Vec::with_capacity(max.min(1024));
        let first = match tokio::time::timeout(idle, self.consumer.next()).await {
            Err(_) => return Ok(batch),
            Ok(None) => {
                return Err(Error::Broker(
                    "the dead-letter queue consumer was cancelled".into(),
                ))
            }
            Ok(Some(d)) => d?,
        };
        batch.push(first);
        while batch.len() < max {
            match self.consumer.next().now_or_never() {
                Some(Some(d)) => batch.push(d?),
                Some(None) => break,
                None => break,
            }
        }
        Ok(batch)
    }

    /// Keep `n` more messages unacked until the end; widen the prefetch so they do not starve
    /// the consumer. Returns false when the prefetch cannot grow any further.
    pub async fn hold(&mut self, n: u32) -> Result<bool, Error> {
        self.held = self.held.saturating_add(n);
        let wanted = self.window.saturating_add(self.held);
        if wanted > MAX_PREFETCH {
            return Ok(false);
        }
        if wanted > self.prefetch {
            // Grow in steps so a long run of skipped messages is not one qos per batch.
            let next = wanted.saturating_add(self.window).min(MAX_PREFETCH);
            self.channel
                .basic_qos(next as u16, BasicQosOptions { global: true })
                .await?;
            self.prefetch = next;
        }
        Ok(true)
    }

    /// How many messages are held so far.
    pub fn held(&self) -> u32 {
        self.held
    }

    /// Acknowledge settled messages.
    ///
    /// With nothing held, every delivery up to the batch's last tag is settled (batches are
    /// decided in delivery order), so one `multiple` ack covers the batch: one frame, not one
    /// per message.
    pub async fn ack(&self, tags: &[u64], batch_holds_nothing: bool) -> Result<(), Error> {
        if self.held == 0 && batch_holds_nothing {
            if let Some(last) = tags.iter().max() {
                self.channel
                    .basic_ack(*last, BasicAckOptions { multiple: true })
                    .await?;
            }
            return Ok(());
        }
        for tag in tags {
            self.channel
                .basic_ack(*tag, BasicAckOptions::default())
                .await?;
        }
        Ok(())
    }

    /// Close the channel: every message still unacked (held, or prefetched beyond the bound)
    /// goes back to the queue in its original position.
    pub async fn close(self) -> Result<(), Error> {
        self.channel
            .close(200, "replay pass finished".into())
            .await?;
        Ok(())
    }
}
