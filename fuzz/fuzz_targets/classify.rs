//! Everything the engine runs on each dead letter, on arbitrary properties, headers, body and
//! spec: x-death and header parsing, the failure signature, the selector, the poison gate, the
//! destination, the key, and the header rewrite of a replayed or quarantined message.
//!
//! Besides "no panic", it checks what the engine relies on: the verdict is a pure function of its
//! input, a replay destination fits an AMQP short string (publish.rs builds `ShortString`s from it,
//! which panics beyond 255 bytes), a key is `prefix` + 32 hex digits, and the rewritten headers
//! carry no death headers and the next replay count.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;

use dlq_replay_engine::classify::{self, Rules, SkipReason, Verdict};
use dlq_replay_engine::amqp::Properties;
use dlq_replay_engine::message::{self, IDEMPOTENCY_KEY, QUARANTINE_REASON, REPLAY_ID};
use dlq_replay_engine::publish;
use dlq_replay_fuzz::{is_key, Body, Message, Spec, Text};
use lapin::types::ShortString;

#[derive(Arbitrary, Debug)]
struct Input {
    spec: Spec,
    message: Message,
    user: Text,
    /// Last, so a `Body::Raw` takes the rest of the fuzzer's bytes as they are.
    body: Body,
}

fuzz_target!(|input: Input| {
    let spec = input.spec.get();
    let replay_id = input.spec.replay_id.get();
    let Some(props) = input.message.get(&spec.canary.signature_header) else {
        return;
    };
    // As a delivery holds them: the headers encoded, read in place.
    let props: Properties = props.into();
    let body = input.body.get();
    let rules = Rules::of(&spec, &replay_id);

    // The readers of properties, as the engine, plan and canary call them.
    let deaths = message::deaths(&props);
    let count = message::death_count_of(&deaths, &props);
    assert_eq!(count, message::death_count(&props));
    assert!(count >= message::replay_count(&props));
    assert!(deaths.iter().all(|d| count >= d.count));
    if let Some(h) = message::headers(&props) {
        for e in h.entries() {
            let _ = e.value.as_str();
            let _ = e.value.as_int();
            assert_eq!(e.value.to_amqp(), h.to_field_table().inner()[e.name].clone());
        }
    }
    for name in spec.selector.headers.keys() {
        let _ = message::header_text(&props, name);
    }
    let _ = message::identity(&props, &body);
    let _ = message::fingerprint(&props, &body);
    let signature = classify::signature(&spec.canary.signature_header, &props);
    assert_eq!(
        signature,
        classify::signature(&spec.canary.signature_header, &props)
    );
    assert_eq!(
        classify::original_queue(&props),
        deaths.first().map(|d| d.queue.to_string())
    );
    if let Some(d) = classify::destination(&spec.target, deaths.first()) {
        assert!(ShortString::try_new(d.exchange).is_ok());
        assert!(ShortString::try_new(d.routing_key).is_ok());
    }

    // The verdict.
    let verdict = classify::classify(&rules, &props, &body);
    assert_eq!(
        verdict,
        classify::classify(&rules, &props, &body),
        "not deterministic"
    );
    let returned = message::header_text(&props, REPLAY_ID).as_deref() == Some(replay_id.as_str());
    assert_eq!(returned, verdict == Verdict::Skip(SkipReason::Returned));

    match &verdict {
        Verdict::Skip(_) => {}
        Verdict::Poison(reason) => {
            let q = publish::quarantine_properties(&props, &replay_id, reason, &input.user.get());
            assert_eq!(
                message::header_text(&q, QUARANTINE_REASON).as_deref(),
                Some(reason.as_str())
            );
            assert_eq!(
                message::header_text(&q, REPLAY_ID).as_deref(),
                Some(replay_id.as_str())
            );
        }
        Verdict::Replay { key, destination } => {
            // publish.rs: `ShortString::from(dest.exchange.as_str())`, which panics past 255 bytes.
            assert!(
                ShortString::try_new(destination.exchange.as_str()).is_ok(),
                "exchange of {} bytes",
                destination.exchange.len()
            );
            assert!(
                ShortString::try_new(destination.routing_key.as_str()).is_ok(),
                "routing key of {} bytes",
                destination.routing_key.len()
            );
            match (rules.key, key) {
                (None, None) => {}
                (Some(k), Some(key)) => assert!(is_key(&k.prefix, key), "bad key {key:?}"),
                (k, key) => panic!("key spec {k:?} but key {key:?}"),
            }
            let user = input.user.get();
            let r = publish::replay_properties(&props, &replay_id, key.as_deref(), &user);
            let headers = r.headers().expect("a replay sets headers");
            assert!(
                headers.entries().all(|e| !publish::is_death_header(e.name)),
                "death header kept"
            );
            assert!(message::deaths(&r).is_empty());
            let next = message::replay_count(&props)
                .saturating_add(1)
                .min(i64::MAX as u64);
            assert_eq!(message::replay_count(&r), next);
            assert_eq!(
                message::header_text(&r, REPLAY_ID).as_deref(),
                Some(replay_id.as_str())
            );
            if key.is_some() {
                assert_eq!(&message::header_text(&r, IDEMPOTENCY_KEY), key);
            }
            // A replayed message is recognised when it comes back.
            assert_eq!(
                classify::classify(&rules, &r, &body),
                Verdict::Skip(SkipReason::Returned)
            );
        }
    }
});
