//! Watching for this replay's messages coming back, at a cost that does not grow with the DLQ.
//!
//! A replayed message that dies again is dead-lettered by its work queue into the dead-letter
//! exchange, which routes it to the DLQ. An exclusive queue of our own, bound to that exchange
//! with the same routing keys, receives a copy of every new dead letter and nothing else: the
//! watch reads (and acks) those copies, and never touches the DLQ itself.
//!
//! The exchange and routing keys are those the broker reports on each delivery from the DLQ
//! (a dead letter's delivery names the exchange it was dead-lettered through). Every traversal
//! of a queue remembers them per queue in Redis, because a message moved to the tail (see
//! [`crate::keep`]) arrives through the default exchange afterwards and tells nothing.
//! A queue fed through the default exchange (`x-dead-letter-exchange: ""`) has no route to bind
//! to: then the canary falls back to an infrequent traversal that moves, never hands back.

use std::collections::BTreeSet;

use crate::amqp::{Channel, Connection, Delivery, FieldTable, QueueDeclare};
use crate::store::Redis;
use serde::{Deserialize, Serialize};

use crate::message::{self, REPLAY_ID};
use crate::Error;

/// How dead letters reach a queue: the exchange and routing key of their delivery.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Route {
    /// The dead-letter exchange.
    pub exchange: String,
    /// The routing key it routed them with.
    pub routing_key: String,
}

/// Add the route `d` arrived by to `routes`, unless it came through the default exchange
/// (published straight to the queue: a moved copy, or a DLX of `""`). Called for every message
/// of a pass: a route already known (the set holds a handful) costs no allocation.
pub fn note_route(routes: &mut BTreeSet<Route>, d: &Delivery) {
    let (exchange, key) = (d.exchange.as_str(), d.routing_key.as_str());
    if exchange.is_empty()
        || routes
            .iter()
            .any(|r| r.exchange == exchange && r.routing_key == key)
    {
        return;
    }
    routes.insert(Route {
        exchange: exchange.into(),
        routing_key: key.into(),
    });
}

/// How long the routes of a queue are remembered after its last traversal.
const ROUTES_TTL_SECONDS: u64 = 30 * 24 * 3600;

fn routes_key(amqp_url: &str, queue: &str) -> String {
    crate::keep::ledger_key(amqp_url, queue).replacen("dlq:moves:", "dlq:routes:", 1)
}

/// Remember the routes seen on `queue`.
pub async fn learn(
    con: &mut Redis,
    amqp_url: &str,
    queue: &str,
    routes: &BTreeSet<Route>,
) -> Result<(), Error> {
    if routes.is_empty() {
        return Ok(());
    }
    let members: Vec<String> = routes
        .iter()
        .filter_map(|r| serde_json::to_string(r).ok())
        .collect();
    let key = routes_key(amqp_url, queue);
    // Refreshed by every traversal; a queue nobody replays for a month is forgotten.
    redis::pipe()
        .cmd("SADD")
        .arg(&key)
        .arg(members)
        .ignore()
        .cmd("EXPIRE")
        .arg(&key)
        .arg(ROUTES_TTL_SECONDS)
        .ignore()
        .query_async::<()>(con)
        .await?;
    Ok(())
}

/// The routes known for `queue`.
pub async fn known(con: &mut Redis, amqp_url: &str, queue: &str) -> Result<BTreeSet<Route>, Error> {
    let members: Vec<String> = redis::cmd("SMEMBERS")
        .arg(routes_key(amqp_url, queue))
        .query_async(con)
        .await?;
    Ok(members
        .iter()
        .filter_map(|m| serde_json::from_str(m).ok())
        .collect())
}

/// A message this replay published that came back with a fresh death.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Returned {
    /// Its identity (message id or body hash).
    pub identity: String,
    /// Its fingerprint (message id and body).
    pub fingerprint: String,
    /// The new death, e.g. `died again: rejected in media.work, x-exception-type=KeyError`.
    pub reason: String,
}

/// Whether `d` is one of `replay_id`'s messages carrying a death, and which.
pub fn returned(d: &Delivery, replay_id: &str, sig_header: &str) -> Option<Returned> {
    let p = &d.properties;
    if message::header_text(p, REPLAY_ID).as_deref() != Some(replay_id) {
        return None;
    }
    let death = message::deaths(p).into_iter().next()?;
    let mut reason = format!("died again: {} in {}", death.reason, death.queue);
    if let Some(v) = message::header_text(p, sig_header) {
        reason.push_str(&format!(", {sig_header}={v}"));
    }
    Some(Returned {
        identity: message::identity(p, &d.data),
        fingerprint: message::fingerprint(p, &d.data),
        reason,
    })
}

/// An exclusive queue bound to the routes dead letters take into the DLQ.
pub struct Returns {
    channel: Channel,
    queue: String,
    /// The routes it is bound to.
    bound: BTreeSet<Route>,
    /// Routes that could not be bound (their exchange is gone): not tried again.
    refused: BTreeSet<Route>,
}

/// A server-named, exclusive queue: gone with the connection, whatever ends the replay.
async fn declare(conn: &Connection) -> Result<(Channel, String), Error> {
    let channel = conn.create_channel().await?;
    let opts = QueueDeclare {
        exclusive: true,
        auto_delete: true,
        ..Default::default()
    };
    let (name, _, _) = channel
        .queue_declare("", opts, FieldTable::default())
        .await?;
    Ok((channel, name))
}

impl Returns {
    /// Open a watch queue and bind it to `routes` (more can be bound as they are met).
    pub async fn open(conn: &Connection, routes: &BTreeSet<Route>) -> Result<Self, Error> {
        let (channel, queue) = declare(conn).await?;
        let mut returns = Self {
            channel,
            queue,
            bound: BTreeSet::new(),
            refused: BTreeSet::new(),
        };
        returns.bind(conn, routes).await?;
        Ok(returns)
    }

    /// Bind the routes of `routes` not bound yet. A route whose exchange is gone is skipped
    /// with a warning and not tried again (the failed bind closed the channel: the watch goes
    /// on in a new queue, bound to the routes that were).
    pub async fn bind(&mut self, conn: &Connection, routes: &BTreeSet<Route>) -> Result<(), Error> {
        let mut todo: Vec<Route> = routes
            .iter()
            .filter(|r| !self.bound.contains(*r) && !self.refused.contains(*r))
            .cloned()
            .collect();
        while let Some(r) = todo.pop() {
            let bound = self
                .channel
                .queue_bind(&self.queue, &r.exchange, &r.routing_key)
                .await;
            match bound {
                Ok(()) => {
                    self.bound.insert(r);
                }
                Err(e) if e.is_not_found() => {
                    tracing::warn!(exchange = %r.exchange, error = %e, "cannot watch a dead-letter route");
                    self.refused.insert(r);
                    let (channel, queue) = declare(conn).await?;
                    (self.channel, self.queue) = (channel, queue);
                    todo.extend(std::mem::take(&mut self.bound));
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Whether any route is bound (a return can reach the watch).
    pub fn watching(&self) -> bool {
        !self.bound.is_empty()
    }

    /// Every new dead letter since the last poll that is one of `replay_id`'s, coming back.
    pub async fn poll(&self, replay_id: &str, sig_header: &str) -> Result<Vec<Returned>, Error> {
        let mut out = Vec::new();
        while let Some(m) = self.channel.basic_get(&self.queue, true).await? {
            if let Some(r) = returned(&m, replay_id, sig_header) {
                out.push(r);
            }
        }
        Ok(out)
    }

    /// Drop the watch queue.
    pub async fn close(self) {
        let _ = self.channel.close(200, "watch done").await;
    }
}
