//! Confirmed, mandatory publishing, and the header rewrite of replayed and quarantined messages.

use std::collections::HashMap;

use crate::amqp::{
    props, AmqpError, BasicProperties, Channel, Confirm, Confirmation, Connection, Properties,
    TableWriter,
};

use crate::classify::Destination;
use crate::message::{
    IDEMPOTENCY_KEY, ORIGINAL_USER_ID, QUARANTINE_REASON, REPLAY_COUNT, REPLAY_ID,
};
use crate::Error;

/// Headers a replay removes: the broker's record of earlier deaths.
pub fn is_death_header(name: &str) -> bool {
    name == "x-death"
        || name == "x-delivery-count"
        || name.starts_with("x-first-death-")
        || name.starts_with("x-last-death-")
}

/// Properties of a replayed message: death headers stripped, replay tags added, everything else
/// kept. The kept headers are copied as they came (bytes, order, and a name given twice stays
/// twice); a tag the message carried already (an earlier replay's) is replaced.
pub fn replay_properties(
    props: &Properties,
    replay_id: &str,
    key: Option<&str>,
    user: &str,
) -> Properties {
    let previous = crate::message::replay_count(props);
    let count = previous.saturating_add(1).min(i64::MAX as u64) as i64;
    let foreign = foreign_user(props.basic(), user);
    let mut w = TableWriter::copy_of(props, 96, |name| {
        is_death_header(name)
            || name == REPLAY_ID
            || name == REPLAY_COUNT
            || (key.is_some() && name == IDEMPOTENCY_KEY)
            || (foreign.is_some() && name == ORIGINAL_USER_ID)
    });
    w.long_string(REPLAY_ID, replay_id.as_bytes());
    w.long_long(REPLAY_COUNT, count);
    if let Some(k) = key {
        w.long_string(IDEMPOTENCY_KEY, k.as_bytes());
    }
    finish(props.basic(), foreign, w)
}

/// Properties of a quarantined message: every header kept, the reason and replay id added.
pub fn quarantine_properties(
    props: &Properties,
    replay_id: &str,
    reason: &str,
    user: &str,
) -> Properties {
    let foreign = foreign_user(props.basic(), user);
    let mut w = TableWriter::copy_of(props, 96, |name| {
        name == QUARANTINE_REASON
            || name == REPLAY_ID
            || (foreign.is_some() && name == ORIGINAL_USER_ID)
    });
    w.long_string(QUARANTINE_REASON, reason.as_bytes());
    w.long_string(REPLAY_ID, replay_id.as_bytes());
    finish(props.basic(), foreign, w)
}

/// The properties as the connection's `user` may publish them: a foreign `user-id` moves to the
/// `x-original-user-id` header (see [`foreign_user`]); anything else is unchanged, the headers
/// byte for byte.
pub fn as_user(props: Properties, user: &str) -> Properties {
    let Some(foreign) = foreign_user(props.basic(), user) else {
        return props;
    };
    let w = TableWriter::copy_of(&props, 32, |name| name == ORIGINAL_USER_ID);
    finish(props.basic(), Some(foreign), w)
}

/// RabbitMQ refuses (and closes the channel on) a `user-id` that differs from the connection's
/// user: such a value (returned here) moves to a header instead, so the replay goes on and
/// nothing is lost.
fn foreign_user<'p>(basic: &'p BasicProperties, user: &str) -> Option<&'p str> {
    basic
        .user_id()
        .as_ref()
        .map(|u| u.as_str())
        .filter(|u| *u != user)
}

/// The outgoing properties: `basic` (less a foreign `user-id`, kept in its header) with the
/// table written.
fn finish(basic: &BasicProperties, foreign: Option<&str>, mut w: TableWriter) -> Properties {
    let basic = match foreign {
        Some(u) => {
            w.long_string(ORIGINAL_USER_ID, u.as_bytes());
            props::basic_but(basic, false)
        }
        None => basic.clone(),
    };
    Properties::from_parts(basic, Some(w.into_bytes()))
}

/// The outcome of a confirmed publish: `Ok` when the broker took responsibility, else why not.
pub fn outcome(res: Result<Confirmation, AmqpError>) -> Result<(), String> {
    match res {
        Ok(Confirmation::Ack(None)) => Ok(()),
        Ok(Confirmation::Ack(Some(ret))) | Ok(Confirmation::Nack(Some(ret))) => Err(format!(
            "Unroutable: returned by the broker ({} {})",
            ret.reply_code, ret.reply_text
        )),
        Ok(Confirmation::Nack(None)) => Err("Nacked: the broker refused the message".into()),
        // The broker closes the channel on a publish to a missing exchange (deleted mid-drain).
        Err(e) if e.is_not_found() => Err(format!(
            "NoExchange: the target exchange was deleted during the drain ({e})"
        )),
        Err(e) => Err(format!("PublishError: {e}")),
    }
}

/// A confirming publisher on a connection of its own.
pub struct Publisher {
    conn: Connection,
    channel: Channel,
    user: String,
    exchanges: HashMap<String, bool>,
}

impl Publisher {
    /// Open a confirming channel on `conn`; `user` is the connection's user (for `user-id`).
    pub async fn open(conn: Connection, user: &str) -> Result<Self, Error> {
        let channel = confirming_channel(&conn).await?;
        Ok(Self {
            conn,
            channel,
            user: user.into(),
            exchanges: HashMap::new(),
        })
    }

    /// The publishing connection.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// The connection's user.
    pub fn user(&self) -> &str {
        &self.user
    }

    /// Make sure the channel is usable (a publish to a vanished exchange closes it).
    pub async fn ensure_open(&mut self) -> Result<(), Error> {
        if !self.channel.is_open() {
            self.channel = confirming_channel(&self.conn).await?;
            self.exchanges.clear();
        }
        Ok(())
    }

    /// Whether an exchange exists (cached per run; `""` always does).
    pub async fn exchange_exists(&mut self, name: &str) -> Result<bool, Error> {
        if name.is_empty() || name.starts_with("amq.") {
            return Ok(true);
        }
        if let Some(known) = self.exchanges.get(name) {
            return Ok(*known);
        }
        // Passive declare on a throwaway channel: a missing exchange closes the channel it is
        // asked on, and that must not be the one carrying confirms.
        let ch = self.conn.create_channel().await?;
        let res = ch.exchange_declare_passive(name).await;
        let exists = match res {
            Ok(()) => {
                let _ = ch.close(200, "ok").await;
                true
            }
            Err(e) if e.is_not_found() => false,
            Err(e) => return Err(e.into()),
        };
        self.exchanges.insert(name.into(), exists);
        Ok(exists)
    }

    /// Publish with `mandatory`; the returned future resolves to the broker's confirm. The
    /// frames are queued at once: a step's publishes go out in one write.
    pub fn send(
        &self,
        dest: &Destination,
        props: Properties,
        body: &[u8],
    ) -> Result<Confirm, AmqpError> {
        // Destination names are at most 255 bytes: `classify::destination` guarantees it.
        confirmed(
            self.channel
                .basic_publish(&dest.exchange, &dest.routing_key, true, props, body),
        )
    }
}

/// The confirm of a publish on a confirming channel (which always has one).
pub fn confirmed(sent: Result<Option<Confirm>, AmqpError>) -> Result<Confirm, AmqpError> {
    sent?.ok_or_else(|| AmqpError::Protocol("publisher confirms were not enabled".into()))
}

/// A channel in confirm mode on `conn`.
pub async fn confirming_channel(conn: &Connection) -> Result<Channel, Error> {
    let channel = conn.create_channel().await?;
    channel.confirm_select().await?;
    Ok(channel)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::{AMQPValue, FieldTable, LongString};

    fn long(s: &str) -> AMQPValue {
        AMQPValue::LongString(LongString::from(s))
    }

    fn props() -> Properties {
        let mut h = FieldTable::default();
        h.insert("x-death".into(), AMQPValue::FieldArray(Default::default()));
        h.insert("x-first-death-queue".into(), long("work"));
        h.insert("x-last-death-reason".into(), long("rejected"));
        h.insert("x-delivery-count".into(), AMQPValue::LongInt(3));
        h.insert("x-exception-type".into(), long("TimeoutError"));
        h.insert(REPLAY_COUNT.into(), AMQPValue::ShortShortUInt(2));
        h.insert(REPLAY_ID.into(), long("an-earlier-replay"));
        BasicProperties::default()
            .with_headers(h)
            .with_message_id("m1".into())
            .with_user_id("alice".into())
            .into()
    }

    #[test]
    fn replay_strips_deaths_tags_and_keeps_the_rest() {
        let p = replay_properties(&props(), "r1", Some("idem:abc"), "guest").to_basic();
        let h = p.headers().clone().unwrap();
        let keys: Vec<&str> = h.inner().keys().map(|k| k.as_str()).collect();
        assert_eq!(
            keys,
            vec![
                "x-exception-type",
                "x-idempotency-key",
                "x-original-user-id",
                "x-replay-count",
                "x-replay-id"
            ]
        );
        assert_eq!(h.inner()[REPLAY_COUNT], AMQPValue::LongLongInt(3));
        assert_eq!(h.inner()[REPLAY_ID], long("r1"));
        assert_eq!(h.inner()[ORIGINAL_USER_ID], long("alice"));
        assert_eq!(p.message_id().as_ref().map(|m| m.as_str()), Some("m1"));
        assert_eq!(p.user_id(), &None);
        // Each tag once: the earlier replay's id was replaced, not kept beside the new one.
        let raw = replay_properties(&props(), "r1", Some("idem:abc"), "guest");
        let ids = raw
            .headers()
            .unwrap()
            .entries()
            .filter(|e| e.name == REPLAY_ID)
            .count();
        assert_eq!(ids, 1);
    }

    #[test]
    fn every_other_property_is_kept() {
        let basic = props()
            .to_basic()
            .with_content_type("application/json".into())
            .with_content_encoding("gzip".into())
            .with_delivery_mode(2)
            .with_priority(3)
            .with_correlation_id("c".into())
            .with_reply_to("r".into())
            .with_expiration("60000".into())
            .with_timestamp(7)
            .with_type("t".into())
            .with_app_id("a".into())
            .with_cluster_id("cl".into());
        let p = Properties::from(basic.clone());
        let q = quarantine_properties(&p, "r1", "NotJson", "alice").to_basic();
        assert_eq!(
            props::basic_but(p.basic(), false).with_user_id("alice".into()),
            *p.basic()
        );
        assert_eq!(q.content_type(), basic.content_type());
        assert_eq!(q.timestamp(), basic.timestamp());
        assert_eq!(q.cluster_id(), basic.cluster_id());
        assert_eq!(q.user_id(), basic.user_id());
    }

    #[test]
    fn own_user_id_is_kept_and_quarantine_keeps_deaths() {
        let p = quarantine_properties(&props(), "r1", "NotJson", "alice").to_basic();
        assert_eq!(p.user_id().as_ref().map(|u| u.as_str()), Some("alice"));
        let h = p.headers().clone().unwrap();
        assert!(h.contains_key("x-death"));
        assert_eq!(h.inner()[QUARANTINE_REASON], long("NotJson"));
        assert_eq!(h.inner()[REPLAY_ID], long("r1"));
    }

    #[test]
    fn a_foreign_user_id_moves_to_its_header_and_the_rest_stays_byte_for_byte() {
        let p = props();
        let moved = as_user(p.clone(), "guest");
        assert_eq!(moved.basic().user_id(), &None);
        let kept: Vec<&[u8]> = moved.headers().unwrap().entries().map(|e| e.raw).collect();
        let before: Vec<&[u8]> = p.headers().unwrap().entries().map(|e| e.raw).collect();
        assert_eq!(&kept[..before.len()], &before[..]);
        assert_eq!(
            moved
                .headers()
                .unwrap()
                .get(ORIGINAL_USER_ID)
                .and_then(|v| v.as_str())
                .as_deref(),
            Some("alice")
        );
        assert_eq!(as_user(p.clone(), "alice"), p);
    }
}
