//! Confirmed, mandatory publishing, and the header rewrite of replayed and quarantined messages.

use std::collections::HashMap;

use crate::amqp::{
    AMQPValue, AmqpError, BasicProperties, Channel, Confirm, Confirmation, Connection, FieldTable,
    LongString,
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
/// kept.
pub fn replay_properties(
    props: &BasicProperties,
    replay_id: &str,
    key: Option<&str>,
    user: &str,
) -> BasicProperties {
    let previous = crate::message::replay_count(props);
    let mut headers: FieldTable = FieldTable::default();
    if let Some(h) = props.headers() {
        for (k, v) in h.inner() {
            if !is_death_header(k.as_str()) {
                headers.insert(k.clone(), v.clone());
            }
        }
    }
    headers.insert(REPLAY_ID.into(), long(replay_id));
    headers.insert(
        REPLAY_COUNT.into(),
        AMQPValue::LongLongInt(previous.saturating_add(1).min(i64::MAX as u64) as i64),
    );
    if let Some(k) = key {
        headers.insert(IDEMPOTENCY_KEY.into(), long(k));
    }
    assertable(all_but(props, Omit::Headers), &mut headers, user).with_headers(headers)
}

/// Properties of a quarantined message: every header kept, the reason and replay id added.
pub fn quarantine_properties(
    props: &BasicProperties,
    replay_id: &str,
    reason: &str,
    user: &str,
) -> BasicProperties {
    let mut headers = props.headers().clone().unwrap_or_default();
    headers.insert(QUARANTINE_REASON.into(), long(reason));
    headers.insert(REPLAY_ID.into(), long(replay_id));
    assertable(all_but(props, Omit::Headers), &mut headers, user).with_headers(headers)
}

/// Which property [`all_but`] leaves out.
#[derive(Clone, Copy, PartialEq)]
enum Omit {
    /// The caller sets its own, so the original table (with its `x-death` entries) is not
    /// deep-copied only to be replaced.
    Headers,
    /// A `user-id` the connection's user may not assert (see [`assertable`]).
    UserId,
}

/// Every property of `p` but the one named.
fn all_but(p: &BasicProperties, omit: Omit) -> BasicProperties {
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
    if omit != Omit::Headers {
        copy!(headers => with_headers);
    }
    if omit != Omit::UserId {
        copy!(user_id => with_user_id);
    }
    out
}

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// The properties as the connection's `user` may publish them: a foreign `user-id` moves to the
/// `x-original-user-id` header (see [`assertable`]); anything else is unchanged.
pub fn as_user(props: BasicProperties, user: &str) -> BasicProperties {
    match props.user_id() {
        Some(u) if u.as_str() != user => {
            let mut headers = props.headers().clone().unwrap_or_default();
            assertable(props, &mut headers, user).with_headers(headers)
        }
        _ => props,
    }
}

/// RabbitMQ refuses (and closes the channel on) a `user-id` that differs from the connection's
/// user. Such a value moves to a header instead, so the replay goes on and nothing is lost.
fn assertable(props: BasicProperties, headers: &mut FieldTable, user: &str) -> BasicProperties {
    match props.user_id() {
        Some(u) if u.as_str() != user => {
            headers.insert(ORIGINAL_USER_ID.into(), long(u.as_str()));
            all_but(&props, Omit::UserId)
        }
        _ => props,
    }
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
        props: BasicProperties,
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

    fn props() -> BasicProperties {
        let mut h = FieldTable::default();
        h.insert("x-death".into(), AMQPValue::FieldArray(Default::default()));
        h.insert("x-first-death-queue".into(), long("work"));
        h.insert("x-last-death-reason".into(), long("rejected"));
        h.insert("x-delivery-count".into(), AMQPValue::LongInt(3));
        h.insert("x-exception-type".into(), long("TimeoutError"));
        h.insert(REPLAY_COUNT.into(), AMQPValue::ShortShortUInt(2));
        BasicProperties::default()
            .with_headers(h)
            .with_message_id("m1".into())
            .with_user_id("alice".into())
    }

    #[test]
    fn replay_strips_deaths_tags_and_keeps_the_rest() {
        let p = replay_properties(&props(), "r1", Some("idem:abc"), "guest");
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
        assert_eq!(p.message_id().as_ref().map(|m| m.as_str()), Some("m1"));
        assert_eq!(p.user_id(), &None);
    }

    #[test]
    fn without_headers_keeps_every_other_property() {
        let p = props()
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
        let h = p.headers().clone().unwrap();
        assert_eq!(all_but(&p, Omit::Headers).with_headers(h), p);
    }

    #[test]
    fn own_user_id_is_kept_and_quarantine_keeps_deaths() {
        let p = quarantine_properties(&props(), "r1", "NotJson", "alice");
        assert_eq!(p.user_id().as_ref().map(|u| u.as_str()), Some("alice"));
        let h = p.headers().clone().unwrap();
        assert!(h.contains_key("x-death"));
        assert_eq!(h.inner()[QUARANTINE_REASON], long("NotJson"));
    }
}
