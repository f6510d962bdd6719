//! The engine's AMQP client (`engine::amqp`) against the real brokers, on every broker and queue
//! type: confirms one per publish, returns matched to their publish, a channel closed by the
//! broker reported with its code, bodies across frames, `basic.get`, consumers in order.

use dlq_replay::engine::amqp::{
    AMQPValue, AmqpError, BasicProperties, Confirmation, Connection, FieldTable, LongString,
};
use dlq_replay_testkit::world::*;
use futures::StreamExt;

fn props(i: usize) -> BasicProperties {
    let mut h = FieldTable::default();
    h.insert("n".into(), AMQPValue::LongLongInt(i as i64));
    h.insert(
        "x-exception-type".into(),
        AMQPValue::LongString(LongString::from("E")),
    );
    BasicProperties::default()
        .with_message_id(format!("m{i}").into())
        .with_delivery_mode(2)
        .with_headers(h)
}

async fn connect(w: &World) -> Connection {
    Connection::connect(w.amqp_url(), "amqp client test")
        .await
        .expect("connect")
}

/// Every publish is confirmed on its own; a consumer gets them in order, whole; acks settle them.
async fn publish_confirm_consume_ack(t: Target) {
    let w = World::on("amqp-pcc", &t).await;
    let conn = connect(&w).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select().await.unwrap();
    let n = 600;
    let confirms: Vec<_> = (0..n)
        .map(|i| {
            ch.basic_publish(
                "",
                &w.topo.dlq,
                true,
                props(i),
                format!("body {i}").as_bytes(),
            )
            .unwrap()
            .expect("a confirm on a confirming channel")
        })
        .collect();
    for c in confirms {
        assert_eq!(c.await.unwrap(), Confirmation::Ack(None));
    }
    assert_eq!(w.depth(&w.topo.dlq).await, n as u32);

    let src = conn.create_channel().await.unwrap();
    src.basic_qos(64).await.unwrap();
    let mut consumer = src.basic_consume(&w.topo.dlq, "t").await.unwrap();
    for i in 0..n {
        let d = consumer.next().await.unwrap().unwrap();
        assert_eq!(d.data, format!("body {i}").into_bytes());
        assert_eq!(
            d.properties.to_basic(),
            props(i),
            "properties arrive as published"
        );
        assert_eq!(d.routing_key.as_str(), w.topo.dlq);
        // n is a multiple of 50: the last ack covers the last message.
        if i % 50 == 49 {
            src.basic_ack(d.delivery_tag, true).unwrap();
        }
    }
    src.basic_cancel("t").await.unwrap();
    assert!(
        consumer.next().await.is_none(),
        "a cancelled consumer's stream ends"
    );
    // basic.get answers after the acks sent before it: the queue is empty.
    assert_eq!(src.basic_get(&w.topo.dlq, false).await.unwrap(), None);
    src.close(200, "ok").await.unwrap();
    conn.close(200, "ok").await.unwrap();
    assert!(!conn.is_open());
    w.cleanup().await;
}
matrix!(publish_confirm_consume_ack);

/// A mandatory publish no queue takes comes back with its own confirm, not a neighbour's.
async fn returns_find_their_publish(t: Target) {
    let w = World::on("amqp-ret", &t).await;
    let conn = connect(&w).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select().await.unwrap();
    let nowhere = format!("{}-nowhere", w.topo.dlq);
    let mut confirms = Vec::new();
    for i in 0..40 {
        let q = if i % 7 == 3 { &nowhere } else { &w.topo.dlq };
        let c = ch
            .basic_publish("", q, true, props(i), b"x")
            .unwrap()
            .unwrap();
        confirms.push((i, c));
    }
    for (i, c) in confirms {
        match c.await.unwrap() {
            Confirmation::Ack(Some(r)) => {
                assert_eq!(i % 7, 3, "message {i} was routed, not returned");
                assert_eq!(r.reply_code, 312);
            }
            Confirmation::Ack(None) => assert_ne!(i % 7, 3, "message {i} was not routed"),
            other => panic!("message {i}: {other:?}"),
        }
    }
    assert_eq!(w.depth(&w.topo.dlq).await, 34);
    w.cleanup().await;
}
matrix!(returns_find_their_publish);

/// A publish to a missing exchange: the broker closes the channel (404), the publish's confirm
/// and the calls after it fail with that code, and the connection goes on.
async fn a_closed_channel_says_why(t: Target) {
    let w = World::on("amqp-404", &t).await;
    let conn = connect(&w).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select().await.unwrap();
    let c = ch
        .basic_publish("no-such-exchange-amqp-test", "k", true, props(0), b"x")
        .unwrap()
        .unwrap();
    let e = c.await.unwrap_err();
    assert!(e.is_not_found(), "{e}");
    assert!(!e.is_connection_lost(), "{e}");
    assert!(!ch.is_open());
    let again = ch.basic_publish("", &w.topo.dlq, true, props(1), b"x");
    assert!(
        matches!(again, Err(AmqpError::ChannelClosed { code: 404, .. })),
        "{again:?}"
    );
    let passive = conn.create_channel().await.unwrap();
    let e = passive
        .exchange_declare_passive("no-such-exchange-amqp-test")
        .await
        .unwrap_err();
    assert!(e.is_not_found(), "{e}");
    assert!(conn.is_open());
    let fine = conn.create_channel().await.unwrap();
    fine.confirm_select().await.unwrap();
    let c = fine
        .basic_publish("", &w.topo.dlq, true, props(2), b"x")
        .unwrap()
        .unwrap();
    assert_eq!(c.await.unwrap(), Confirmation::Ack(None));
    conn.close(200, "ok").await.unwrap();
    let after = fine.basic_publish("", &w.topo.dlq, true, props(3), b"x");
    assert!(after.is_err_and(|e| e.is_connection_lost()));
    w.cleanup().await;
}
matrix!(a_closed_channel_says_why);

/// Bodies larger than a frame (frame_max 128 KiB) go out in several body frames and come back
/// whole, through `basic.get`; an empty body too.
async fn large_and_empty_bodies(t: Target) {
    let w = World::on("amqp-big", &t).await;
    let conn = connect(&w).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select().await.unwrap();
    let big: Vec<u8> = (0..700_000u32).map(|i| (i % 251) as u8).collect();
    for body in [&big[..], b""] {
        let c = ch
            .basic_publish("", &w.topo.dlq, true, props(7), body)
            .unwrap()
            .unwrap();
        assert_eq!(c.await.unwrap(), Confirmation::Ack(None));
    }
    let got = ch.basic_get(&w.topo.dlq, false).await.unwrap().unwrap();
    assert_eq!(got.data.len(), big.len());
    assert!(got.data == big);
    let empty = ch.basic_get(&w.topo.dlq, false).await.unwrap().unwrap();
    assert!(empty.data.is_empty());
    ch.basic_nack(empty.delivery_tag, true).unwrap();
    ch.basic_ack(got.delivery_tag, false).unwrap();
    let again = ch.basic_get(&w.topo.dlq, false).await.unwrap().unwrap();
    assert!(again.redelivered, "the nacked message came back");
    ch.basic_ack(again.delivery_tag, false).unwrap();
    assert_eq!(ch.basic_get(&w.topo.dlq, false).await.unwrap(), None);
    w.cleanup().await;
}
matrix!(large_and_empty_bodies);

/// A refused login is the broker's answer (403), not a lost connection to retry; a missing
/// vhost likewise (its code); a closed port is a lost connection.
#[tokio::test]
async fn login_errors_are_not_lost_connections() {
    let bad = AMQP.replace("guest:guest", "guest:wrong");
    let e = Connection::connect(&bad, "t").await.err().expect("refused");
    assert_eq!(e.reply_code(), Some(403), "{e}");
    assert!(!e.is_connection_lost(), "{e}");
    let vhost = AMQP.replace("%2f", "no-such-vhost");
    let e = Connection::connect(&vhost, "t")
        .await
        .err()
        .expect("refused");
    assert_eq!(e.reply_code(), Some(530), "{e}");
    assert!(!e.is_connection_lost(), "{e}");
    let e = Connection::connect("amqp://guest:guest@127.0.0.1:1/%2f", "t")
        .await
        .err()
        .expect("refused");
    assert!(e.is_connection_lost(), "{e}");
}

/// A channel handle that outlives its close does not touch the channel opened after it: ids are
/// not reused while others are free.
#[tokio::test]
async fn a_closed_channels_handle_leaves_the_next_channel_alone() {
    let w = World::new("amqp-ids").await;
    let conn = connect(&w).await;
    let old = conn.create_channel().await.unwrap();
    old.close(200, "done").await.unwrap();
    let new = conn.create_channel().await.unwrap();
    new.confirm_select().await.unwrap();
    drop(old);
    let c = new
        .basic_publish("", &w.topo.dlq, true, props(0), b"x")
        .unwrap()
        .unwrap();
    assert_eq!(c.await.unwrap(), Confirmation::Ack(None));
    assert!(new.is_open());
    w.cleanup().await;
}
