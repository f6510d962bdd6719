//! A traversal of a queue with `basic.get` that leaves every message where it is (moved to the
//! tail, see [`crate::keep`]) unless the caller takes it: `plan`, the canary's choice of
//! canaries, and the canary's search for returns when no dead-letter exchange is known.
//!
//! It takes exactly the messages the queue held when it began, so the copies it moves to the
//! tail are never met again, and after a full traversal the queue holds its messages in their
//! old order. No message is ever handed back, so no delivery count grows, however often it runs.

use std::collections::{BTreeSet, VecDeque};

use crate::amqp::{Channel, Connection, Delivery};
use crate::store::Redis;

use crate::keep::{self, Ledger, Moved, Mover};
use crate::source;
use crate::watch::{self, Route};
use crate::Error;

/// Kept messages moved together: one ledger write, one confirm wait.
const MOVE_BATCH: usize = 256;

/// `basic.get`s in flight at once ([`Scan::fetch_ahead`]).
const GET_AHEAD: u64 = 32;

/// One traversal of one queue.
pub struct Scan {
    ch: Channel,
    queue: String,
    mover: Mover,
    ledger: Ledger,
    redis: Redis,
    amqp_url: String,
    depth: u64,
    taken: u64,
    keep: Vec<Delivery>,
    leftovers: Vec<(u64, String)>,
    /// Messages the waits for applied acks took: the traversal's next ones, in order.
    ahead: VecDeque<Delivery>,
    routes: BTreeSet<Route>,
    /// Whether a traversal that met every message settles the ledger (see [`Scan::finish`]).
    settles: bool,
}

impl Scan {
    /// Begin a traversal of `queue` (which must exist): `conn` reads, `publish` carries the
    /// copies.
    pub async fn open(
        conn: &Connection,
        publish: &Connection,
        redis: Redis,
        amqp_url: &str,
        queue: &str,
    ) -> Result<Self, Error> {
        let depth = source::queue_state(conn, queue)
            .await?
            .ok_or_else(|| Error::SourceMissing(queue.into()))?
            .0;
        let ledger = Ledger::open(redis.clone(), amqp_url, queue).await?;
        Ok(Self {
            ch: conn.create_channel().await?,
            queue: queue.into(),
            mover: Mover::open(publish, &crate::amqp_user(amqp_url), queue).await?,
            ledger,
            redis,
            amqp_url: amqp_url.into(),
            depth: depth.into(),
            taken: 0,
            keep: Vec::new(),
            leftovers: Vec::new(),
            ahead: VecDeque::new(),
            routes: BTreeSet::new(),
            settles: true,
        })
    }

    /// A traversal beside another consumer of the queue (the drain's, during a canary's search):
    /// it does not meet every message, so it leaves the ledger's counts to the drain.
    pub fn beside_a_drain(mut self) -> Self {
        self.settles = false;
        self
    }

    /// How many messages the queue held when the traversal began.
    pub fn depth(&self) -> u64 {
        self.depth
    }

    /// The next message of the traversal, `None` at its end. Leftover copies of an interrupted
    /// move are dropped on the way (see [`Ledger::is_leftover`]).
    pub async fn next(&mut self) -> Result<Option<Delivery>, Error> {
        while self.taken < self.depth {
            if self.taken + 1 == self.depth && self.ahead.is_empty() {
                // Before the last message: move what waits, and let the wait for applied acks
                // take the last message itself (inside the bound), not one past the bound.
                self.flush().await?;
            }
            if self.ahead.is_empty() {
                self.fetch_ahead().await?;
            }
            let Some(d) = self.ahead.pop_front() else {
                return Ok(None);
            };
            self.taken += 1;
            watch::note_route(&mut self.routes, &d);
            if let Some((digest, true)) = self.ledger.meet(&d.properties, &d.data) {
                tracing::info!(queue = %self.queue, "dropping a leftover copy of an interrupted move");
                self.leftovers.push((d.delivery_tag, digest));
                continue;
            }
            return Ok(Some(d));
        }
        Ok(None)
    }

    /// Take the traversal's next messages with several `basic.get`s in flight at once: one
    /// after the other, each waited a round trip, and a 100,000-message traversal took 36 s
    /// where the drain of the same queue took 16 (bench/RESULTS.md, canary section). Never past
    /// the bound, and never the traversal's last message, which comes alone (see `next`).
    async fn fetch_ahead(&mut self) -> Result<(), Error> {
        let left = self.depth - self.taken - self.ahead.len() as u64;
        let k = match left {
            0 | 1 => left,
            _ => (left - 1).min(GET_AHEAD),
        };
        let gets = (0..k).map(|_| source::get_one(&self.ch, &self.queue));
        let mut got: Vec<Delivery> = futures::future::try_join_all(gets)
            .await?
            .into_iter()
            .flatten()
            .collect();
        // The broker answers the gets in the order they were sent: queue order, which the
        // delivery tags number. Sorted anyway, so the traversal's order never rests on the
        // client's bookkeeping.
        got.sort_by_key(|d| d.delivery_tag);
        self.ahead.extend(got);
        Ok(())
    }

    /// Leave `d` in the queue (moved to its tail).
    pub async fn keep(&mut self, d: Delivery) -> Result<(), Error> {
        self.keep.push(d);
        if self.keep.len() >= MOVE_BATCH {
            self.flush().await?;
        }
        Ok(())
    }

    /// Ack a message the caller took, once its outcome is durable.
    pub async fn ack(&self, tag: u64) -> Result<(), Error> {
        self.ch.basic_ack(tag, false)?;
        Ok(())
    }

    /// The dead-letter routes seen so far.
    pub fn routes(&self) -> &BTreeSet<Route> {
        &self.routes
    }

    /// Move what is waiting to be kept now (the traversal otherwise moves in batches).
    pub async fn flush(&mut self) -> Result<(), Error> {
        let keep = std::mem::take(&mut self.keep);
        let leftovers = std::mem::take(&mut self.leftovers);
        if keep.is_empty() && leftovers.is_empty() {
            return Ok(());
        }
        let digests: Vec<String> = keep
            .iter()
            .map(|d| keep::digest(&d.properties, &d.data))
            .collect();
        self.ledger.intend(&digests).await?;
        let msgs: Vec<_> = keep
            .iter()
            .map(|d| (&d.properties, d.data.as_slice()))
            .collect();
        let moved = self.mover.copy(&msgs).await?;
        let mut done = Vec::new();
        let mut acks = Vec::new();
        for ((d, digest), m) in keep.iter().zip(digests).zip(moved) {
            match m {
                Moved::Copied => {
                    acks.push(d.delivery_tag);
                    done.push(digest);
                }
                // No copy: the original goes back when the channel closes.
                Moved::Refused => done.push(digest),
                // A copy may exist: the ledger keeps counting it.
                Moved::Unknown => {}
            }
        }
        for (tag, digest) in leftovers {
            acks.push(tag);
            done.push(digest);
        }
        // Queued together, written together. One by one: a held
        // candidate (a canary) sits among them, so no `multiple` ack may cover them.
        for tag in acks {
            self.ch.basic_ack(tag, false)?;
        }
        // The counts come back only once the queue has applied the acks. At the traversal's end
        // a wait would take a message past the bound (handed back, it would count a delivery
        // and, on RabbitMQ 3.10, move to the back): the last flush acks only the last message,
        // which does not race the close (that takes more than 30 acks pending, measured), and
        // its count stays for the next traversal to settle.
        if self.taken + (self.ahead.len() as u64) < self.depth {
            self.wait_applied().await?;
            self.ledger.take_back(&done).await?;
        }
        Ok(())
    }

    /// Wait until the queue has applied this channel's acks ([`source::get_one`]). The message
    /// the wait takes is the traversal's next one, or, past its bound, handed back.
    async fn wait_applied(&mut self) -> Result<(), Error> {
        let Some(d) = source::get_one(&self.ch, &self.queue).await? else {
            return Ok(());
        };
        if self.taken + (self.ahead.len() as u64) < self.depth {
            self.ahead.push_back(d);
        } else {
            source::hand_back(&self.ch, d).await?;
        }
        Ok(())
    }

    /// End the traversal: move what is still to be kept, settle the ledger when every message
    /// the queue held was met, remember the dead-letter routes seen, close the channel.
    pub async fn finish(mut self) -> Result<(), Error> {
        self.flush().await?;
        if self.settles && self.taken >= self.depth {
            self.ledger.resolved().await?;
        }
        watch::learn(&mut self.redis, &self.amqp_url, &self.queue, &self.routes).await?;
        // A traversal ended early holds its next messages: they go back in place.
        for d in std::mem::take(&mut self.ahead) {
            source::hand_back(&self.ch, d).await?;
        }
        let _ = self.ch.close(200, "traversal done").await;
        Ok(())
    }
}
