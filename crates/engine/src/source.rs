//! The dead-letter queue side: depth at start, a prefetching consumer bounded to the pass, acks.
//!
//! A pass takes exactly the messages the queue held when it began (its bound): what arrives
//! during the pass, and the copies of kept messages the pass moves to the tail (see
//! [`crate::keep`]), are not its business. The consumer's prefetch is per consumer
//! (quorum queues refuse a channel-wide one) and never lets the broker deliver past the bound:
//! a message delivered past it would be handed back at the end of the pass, and on a quorum
//! queue every hand-back counts toward the delivery limit. So before an ack would let the
//! broker deliver past the bound, the consumer is cancelled and the rest of the bound is taken
//! with `basic.get`, one message at a time, exactly; the very last one alone, after every other
//! ack, so that a quorum queue has applied those acks before the pass closes its channel (see
//! [`get_one`]).

use std::collections::BTreeSet;
use std::time::Duration;

use crate::amqp::{Channel, Connection, Consumer, Delivery, FieldTable, QueueDeclare};
use futures::{FutureExt, StreamExt};

use crate::Error;

/// Ready messages and consumers of a queue, or `None` when the queue does not exist.
pub async fn queue_state(conn: &Connection, queue: &str) -> Result<Option<(u32, u32)>, Error> {
    // A passive declare of a missing queue closes its channel, so it gets a channel of its own.
    let ch = conn.create_channel().await?;
    let passive = QueueDeclare {
        passive: true,
        ..Default::default()
    };
    let res = ch
        .queue_declare(queue, passive, FieldTable::default())
        .await;
    match res {
        Ok((_, messages, consumers)) => {
            let _ = ch.close(200, "ok").await;
            Ok(Some((messages, consumers)))
        }
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Take `queue`'s next message with `basic.get` on `ch` (`None`: the queue is empty). The answer
/// also means the queue has applied every ack sent on `ch` before it.
///
/// A quorum queue applies acks asynchronously (they are Raft commands the channel pipelines);
/// a channel that closes before they are applied gets the acked messages back, each with one more
/// delivery: measured, 13 of 15 closes right after acking 40 messages on RabbitMQ 3.10 and 4.0.
/// A `basic.qos`, a passive declare or `basic.recover` in between does not help; a `basic.get` on
/// the same channel does, because the queue applies it after the acks the channel sent before
/// it. It may take a message: the caller makes it the next message of its traversal, or, past
/// the traversal's bound, hands it back with [`hand_back`] (one delivery on one message beyond
/// the pass, which the next traversal moves and so resets).
pub async fn get_one(ch: &Channel, queue: &str) -> Result<Option<Delivery>, Error> {
    Ok(ch.basic_get(queue, false).await?)
}

/// Give a message back to its queue, in its place (a requeue), e.g. the one [`get_one`] took past
/// a traversal's bound.
pub async fn hand_back(ch: &Channel, d: Delivery) -> Result<(), Error> {
    ch.basic_nack(d.delivery_tag, true)?;
    Ok(())
}

const CONSUMER_TAG: &str = "dlq-replay";

/// A consumer on the dead-letter queue, bounded to one pass.
pub struct Source {
    channel: Channel,
    queue: String,
    /// `None` once the consumer was cancelled near the bound (or never started).
    consumer: Option<Consumer>,
    prefetch: u64,
    /// How many messages this pass may take.
    bound: u64,
    /// Taken from the broker so far.
    delivered: u64,
    /// Acked so far.
    acked: u64,
    /// The consumer was cancelled (its last deliveries may still be buffered).
    cancelled: bool,
    /// Deliveries not acked with their step: left for good (an outcome unknown, a copy
    /// refused) or until their copy is confirmed at the tail (see [`Source::ack_held`]). No
    /// multiple ack may cover them.
    held: BTreeSet<u64>,
}

impl Source {
    /// Start consuming at most `bound` messages of `queue`, `window` of them in flight.
    pub async fn open(
        conn: &Connection,
        queue: &str,
        window: u16,
        bound: u64,
    ) -> Result<Self, Error> {
        let channel = conn.create_channel().await?;
        // The consumer never delivers the pass's last message: that one is taken with
        // basic.get, after every other ack, which makes the queue apply those acks first (see
        // [`get_one`]); so the close that follows cannot give acked messages back.
        let prefetch = u64::from(window).min(bound.saturating_sub(1));
        let mut src = Self {
            channel,
            queue: queue.into(),
            consumer: None,
            prefetch,
            bound,
            delivered: 0,
            acked: 0,
            cancelled: false,
            held: BTreeSet::new(),
        };
        if prefetch > 0 {
            // Per consumer (global: false): the only kind quorum queues accept.
            src.channel.basic_qos(prefetch as u16).await?;
            src.consumer = Some(src.channel.basic_consume(queue, CONSUMER_TAG).await?);
        }
        Ok(src)
    }

    /// Wait up to `idle` for one delivery, then take whatever else is ready, up to `max` and
    /// never past the bound. Returns an empty batch when nothing came within `idle`.
    pub async fn next_batch(&mut self, max: usize, idle: Duration) -> Result<Vec<Delivery>, Error> {
        let max = (max as u64).min(self.bound - self.delivered) as usize;
        let mut batch = Vec::with_capacity(max.min(1024));
        if max == 0 {
            return Ok(batch);
        }
        if self.consumer.is_some() {
            self.consume(&mut batch, max, idle).await?;
        }
        if self.consumer.is_none() {
            // Taken with basic.get, the pass's last message comes alone, after every other
            // message's ack (see `open`).
            let left = self.bound - self.delivered - batch.len() as u64;
            let room = (max - batch.len()) as u64;
            let take = match left {
                0 => 0,
                1 if batch.is_empty() => 1,
                1 => 0,
                _ => room.min(left - 1),
            };
            if take > 0 {
                let upto = batch.len() + take as usize;
                self.get(&mut batch, upto, idle).await?;
            }
        }
        self.delivered += batch.len() as u64;
        Ok(batch)
    }

    async fn consume(
        &mut self,
        batch: &mut Vec<Delivery>,
        max: usize,
        idle: Duration,
    ) -> Result<(), Error> {
        let Some(consumer) = self.consumer.as_mut() else {
            return Ok(());
        };
        match tokio::time::timeout(idle, consumer.next()).await {
            Err(_) => return Ok(()),
            Ok(Some(d)) => batch.push(d?),
            Ok(None) => {
                // Cancelled by us (near the bound): the rest comes by basic.get.
                self.consumer = None;
                return Ok(());
            }
        }
        while batch.len() < max {
            match consumer.next().now_or_never() {
                Some(Some(d)) => batch.push(d?),
                Some(None) => {
                    self.consumer = None;
                    break;
                }
                None => break,
            }
        }
        Ok(())
    }

    /// Up to `max` in the batch with `basic.get`s sent together (the broker answers them in
    /// order, each taking the head): one after the other, the pass's tail (a prefetch's worth,
    /// more with the canary's look-ahead) cost a round trip each.
    async fn get(
        &mut self,
        batch: &mut Vec<Delivery>,
        max: usize,
        idle: Duration,
    ) -> Result<(), Error> {
        let want = max.saturating_sub(batch.len());
        if want == 0 {
            return Ok(());
        }
        let gets = (0..want).map(|_| get_one(&self.channel, &self.queue));
        let mut got: Vec<Delivery> = futures::future::try_join_all(gets)
            .await?
            .into_iter()
            .flatten()
            .collect();
        if got.is_empty() && batch.is_empty() {
            // Nothing ready: wait as a consumer would have.
            tokio::time::sleep(idle).await;
        }
        got.sort_by_key(|d| d.delivery_tag);
        batch.extend(got);
        Ok(())
    }

    /// Acknowledge a step's settled messages (`tags`); `held` are the step's deliveries not
    /// acked now. Deliveries are decided in order, so the tags below every held one are acked
    /// with one `multiple` ack (one frame, not one per message); the rest one by one. A held
    /// delivery among `tags` (one set aside, now decided) is held no longer.
    pub async fn ack(&mut self, tags: &[u64], held: &[u64]) -> Result<(), Error> {
        self.before_ack(tags.len() as u64).await?;
        if !self.held.is_empty() {
            for t in tags {
                self.held.remove(t);
            }
        }
        self.held.extend(held);
        let floor = self.held.first().copied().unwrap_or(u64::MAX);
        let (below, above): (Vec<u64>, Vec<u64>) = tags.iter().partition(|&&t| t < floor);
        if let Some(last) = below.iter().max() {
            self.channel.basic_ack(*last, true)?;
        }
        self.ack_each(&above)?;
        self.acked += tags.len() as u64;
        Ok(())
    }

    /// Hold deliveries unacked for now (set aside): no `multiple` ack may cover them.
    pub fn hold(&mut self, tags: &[u64]) {
        self.held.extend(tags);
    }

    /// Acknowledge held deliveries (see [`Source::ack`]) once their outcome is durable.
    pub async fn ack_held(&mut self, tags: &[u64]) -> Result<(), Error> {
        self.before_ack(tags.len() as u64).await?;
        for t in tags {
            self.held.remove(t);
        }
        self.ack_each(tags)?;
        self.acked += tags.len() as u64;
        Ok(())
    }

    /// One frame each, queued together and written together.
    fn ack_each(&self, tags: &[u64]) -> Result<(), Error> {
        for tag in tags {
            self.channel.basic_ack(*tag, false)?;
        }
        Ok(())
    }

    /// The broker delivers at most `acked + prefetch` messages to the consumer: before acks
    /// that would let that pass the bound, stop the consumer. What it sent before the cancel is
    /// still ours (and within the bound).
    async fn before_ack(&mut self, n: u64) -> Result<(), Error> {
        if self.consumer.is_some() && self.acked + n + self.prefetch > self.bound.saturating_sub(1)
        {
            self.cancel().await?;
        }
        Ok(())
    }

    async fn cancel(&mut self) -> Result<(), Error> {
        if !self.cancelled {
            self.cancelled = true;
            self.channel.basic_cancel(CONSUMER_TAG).await?;
        }
        Ok(())
    }

    /// Whether the next delivery is the pass's last one, which comes alone once every delivery
    /// before it is acked (see [`Source::open`]).
    pub fn at_last(&self) -> bool {
        self.bound.saturating_sub(self.delivered) == 1
    }

    /// Whether the pass took its last message, which is taken (alone) only after the queue
    /// applied every earlier ack.
    pub fn took_all(&self) -> bool {
        self.delivered >= self.bound
    }

    /// Close the channel: every message still unacked (an unknown outcome) goes back to the
    /// queue.
    pub async fn close(self) -> Result<(), Error> {
        self.channel.close(200, "replay pass finished").await?;
        Ok(())
    }
}
