//! The properties against amq-protocol's own parser and generator, and the table's reads.

use super::header::write_header;
use super::table::{validate_table, MAX_DEPTH};
use super::*;
use amq_protocol::frame::{gen_frame, parse_frame, AMQPContentHeader, AMQPFrame};
use amq_protocol::types::AMQPValue;
use amq_protocol::types::{FieldArray, LongString};

fn full() -> BasicProperties {
    let mut death = FieldTable::default();
    death.insert("count".into(), AMQPValue::LongLongInt(3));
    death.insert("queue".into(), AMQPValue::LongString("work".into()));
    death.insert(
        "routing-keys".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::LongString("rk".into())])),
    );
    let mut h = FieldTable::default();
    h.insert(
        "x-death".into(),
        AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
    );
    h.insert("b".into(), AMQPValue::Boolean(true));
    h.insert("i8".into(), AMQPValue::ShortShortInt(-3));
    h.insert("u8".into(), AMQPValue::ShortShortUInt(3));
    h.insert("i16".into(), AMQPValue::ShortInt(-300));
    h.insert("u16".into(), AMQPValue::ShortUInt(300));
    h.insert("i32".into(), AMQPValue::LongInt(-70000));
    h.insert("u32".into(), AMQPValue::LongUInt(70000));
    h.insert("f".into(), AMQPValue::Float(1.5));
    h.insert("d".into(), AMQPValue::Double(2.5));
    h.insert(
        "dec".into(),
        AMQPValue::DecimalValue(amq_protocol::types::DecimalValue {
            scale: 2,
            value: 314,
        }),
    );
    h.insert("t".into(), AMQPValue::Timestamp(1_700_000_000));
    h.insert("x".into(), AMQPValue::ByteArray(vec![0, 255].into()));
    h.insert("v".into(), AMQPValue::Void);
    h.insert(
        "s".into(),
        AMQPValue::LongString(LongString::from(vec![0xff, b'a'])),
    );
    BasicProperties::default()
        .with_content_type("application/json".into())
        .with_content_encoding("gzip".into())
        .with_headers(h)
        .with_delivery_mode(2)
        .with_priority(4)
        .with_correlation_id("c".into())
        .with_reply_to("r".into())
        .with_expiration("60000".into())
        .with_message_id("m-1".into())
        .with_timestamp(42)
        .with_type("t".into())
        .with_user_id("guest".into())
        .with_app_id("app".into())
        .with_cluster_id("cl".into())
}

/// What amq-protocol generates for a header frame of `p`, and its payload.
fn amq_header(p: &BasicProperties) -> Vec<u8> {
    let f = AMQPFrame::Header(
        1,
        AMQPContentHeader {
            class_id: 60,
            body_size: 7,
            properties: p.clone(),
        },
    );
    let bytes = cookie_factory::gen_simple(gen_frame(&f), Vec::new()).unwrap();
    bytes[7..bytes.len() - 1].to_vec()
}

#[test]
fn parses_what_amq_protocol_writes_and_writes_what_it_parses() {
    for p in [
        full(),
        BasicProperties::default(),
        BasicProperties::default().with_message_id("m".into()),
    ] {
        let payload = amq_header(&p);
        let (size, ours) = parse_header(&payload).unwrap();
        assert_eq!(size, 7);
        assert_eq!(ours.to_basic(), p);
        let mut out = Vec::new();
        write_header(&mut out, 7, &ours);
        // Our frame parsed by amq-protocol gives the same properties back.
        let mut frame = vec![2, 0, 1];
        frame.extend_from_slice(&(out.len() as u32).to_be_bytes());
        frame.extend_from_slice(&out);
        frame.push(0xCE);
        match parse_frame(frame.as_slice()).unwrap().1 {
            AMQPFrame::Header(1, h) => {
                assert_eq!(h.body_size, 7);
                assert_eq!(h.properties, p);
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn reads_values_in_place() {
    let p = Properties::from(full());
    let h = p.headers().unwrap();
    assert_eq!(h.get("i16").and_then(Value::as_int), Some(-300));
    assert_eq!(h.get("u32").and_then(Value::as_int), Some(70000));
    assert_eq!(h.get("b").and_then(Value::as_str).as_deref(), Some("true"));
    assert_eq!(
        h.get("s").and_then(Value::as_str).as_deref(),
        Some("\u{fffd}a")
    );
    let Some(Value::Array(deaths)) = h.get("x-death") else {
        panic!("no x-death");
    };
    let Some(Value::Table(d)) = deaths.iter().next() else {
        panic!("no entry");
    };
    assert_eq!(d.get("count").and_then(Value::as_int), Some(3));
    assert_eq!(
        d.get("queue").and_then(Value::as_str).as_deref(),
        Some("work")
    );
    assert!(h.get("missing").is_none());
    assert!(h.contains("v"));
}

#[test]
fn a_written_table_keeps_copied_entries_byte_for_byte() {
    let p = Properties::from(full());
    let mut w = TableWriter::default();
    for e in p
        .headers()
        .unwrap()
        .entries()
        .filter(|e| e.name != "x-death")
    {
        w.copy(&e);
    }
    w.long_string("x-replay-id", b"r1");
    w.long_long("x-replay-count", 2);
    let q = p.with_header_bytes(Some(w.into_bytes()));
    let t = q.to_basic().headers().clone().unwrap();
    assert!(!t.contains_key("x-death"));
    assert_eq!(
        t.inner().get("x-replay-count"),
        Some(&AMQPValue::LongLongInt(2))
    );
    assert_eq!(
        t.inner().get("x-replay-id"),
        Some(&AMQPValue::LongString("r1".into()))
    );
    assert_eq!(
        t.inner().get("dec"),
        full().headers().as_ref().unwrap().inner().get("dec")
    );
}

#[test]
fn get_finds_what_the_entries_hold() {
    let p = Properties::from(full());
    let h = p.headers().unwrap();
    for e in h.entries() {
        assert_eq!(h.get(e.name), Some(e.value), "{}", e.name);
        assert_eq!(
            Value::size(&e.raw[1 + e.name.len()..]),
            Some(e.raw.len() - 1 - e.name.len())
        );
    }
}

#[test]
fn the_last_of_a_name_given_twice_counts() {
    let mut w = TableWriter::default();
    w.long_long("n", 1);
    w.long_long("n", 2);
    let out = w.into_bytes();
    let t = Table(&out);
    assert_eq!(t.get("n").and_then(Value::as_int), Some(2));
}

#[test]
fn malformed_tables_are_refused_not_read() {
    // A long string longer than its table.
    let mut bad_len = vec![1, b'a', b'S'];
    bad_len.extend_from_slice(&100u32.to_be_bytes());
    assert!(validate_table(&bad_len, 0).is_none());
    // An unknown type.
    assert!(validate_table(&[1, b'a', b'?'], 0).is_none());
    // A name that is not UTF-8.
    assert!(validate_table(&[1, 0xff, b'V'], 0).is_none());
    // Tables nested past the limit.
    let mut deep = vec![b'V'];
    for _ in 0..(MAX_DEPTH + 2) {
        let mut t = vec![1, b'a'];
        t.extend_from_slice(&deep);
        let mut v = vec![b'F'];
        v.extend_from_slice(&(t.len() as u32).to_be_bytes());
        v.extend_from_slice(&t);
        deep = v;
    }
    let mut top = vec![1, b'a'];
    top.extend_from_slice(&deep);
    assert!(validate_table(&top, 0).is_none());
    // A truncated header frame is an error, not a panic.
    let payload = amq_header(&full());
    for cut in [0, 5, 13, 20, payload.len() - 1] {
        assert!(parse_header(&payload[..cut]).is_err(), "cut at {cut}");
    }
}
