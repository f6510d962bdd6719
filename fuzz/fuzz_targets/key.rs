//! The idempotency key: `key_of` on any prefix and joined value, and `derive` (JSON pointers,
//! `field_text`, defaults) on any key spec and body, raw bytes included.
//!
//! Besides "no panic", it checks the documented contract: a key is `prefix` + the first 32 hex
//! digits of sha256 of the field values joined by `:`, a missing field without default is the
//! error, and `classify` gives a message the key `derive` gives its body (or quarantines it for
//! the same reason), so `plan` and `run` agree with the workers' own tooling.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

use dlq_replay_engine::spec::{PoisonSpec, SelectorSpec, TargetSpec};
use dlq_replay_engine::classify::{self, Rules, Verdict};
use dlq_replay_engine::key::{self, KeyError};
use dlq_replay_fuzz::{is_key, Body, Key};
use lapin::BasicProperties;

#[derive(Arbitrary, Debug)]
struct Input {
    prefix: String,
    joined: String,
    spec: Key,
    /// Last, so a `Body::Raw` takes the rest of the fuzzer's bytes as they are.
    body: Body,
}

/// Visit every value of a document (serde_json caps its depth at 128 when parsing).
fn walk(v: &Value, f: &mut impl FnMut(&Value)) {
    f(v);
    match v {
        Value::Array(a) => a.iter().for_each(|x| walk(x, f)),
        Value::Object(o) => o.values().for_each(|x| walk(x, f)),
        _ => {}
    }
}

fuzz_target!(|input: Input| {
    let k = key::key_of(&input.prefix, &input.joined);
    assert!(is_key(&input.prefix, &k), "bad key {k:?}");
    assert_eq!(k, key::key_of(&input.prefix, &input.joined));

    let spec = input.spec.get();
    let body = input.body.get();
    let json: Option<Value> = serde_json::from_slice(&body).ok();

    let derived = json.as_ref().map(|v| key::derive(&spec, v));
    if let Some(v) = &json {
        walk(v, &mut |x| {
            let text = key::field_text(x);
            match x {
                Value::Null => assert_eq!(text, None),
                Value::String(s) => assert_eq!(text.as_ref(), Some(s)),
                _ => assert!(text.is_some()),
            }
        });
        // The documented derivation, field by field.
        let mut values = Vec::new();
        let mut missing = None;
        for f in &spec.fields {
            match v
                .pointer(&f.pointer)
                .and_then(key::field_text)
                .or_else(|| f.default.clone())
            {
                Some(text) => values.push(text),
                None => {
                    missing = Some(f.pointer.clone());
                    break;
                }
            }
        }
        match (derived.as_ref().expect("derived"), missing) {
            (Ok(k), None) => {
                assert!(is_key(&spec.prefix, k), "bad key {k:?}");
                assert_eq!(*k, key::key_of(&spec.prefix, &values.join(":")));
            }
            (Err(KeyError::Missing(p)), Some(m)) => assert_eq!(*p, m),
            (got, want) => panic!("derive gave {got:?}, missing field {want:?}"),
        }
    }

    // The same key through the classifier, as the engine derives it on each message.
    let (selector, poison) = (SelectorSpec::default(), PoisonSpec::default());
    let target = TargetSpec {
        exchange: Some(String::new()),
        routing_key: Some("q".into()),
    };
    let rules = Rules {
        selector: &selector,
        poison: &poison,
        key: Some(&spec),
        target: &target,
        signature_header: "x-exception-type",
        replay_id: "r1",
    };
    let verdict = classify::classify(&rules, &BasicProperties::default().into(), &body);
    match (derived, verdict) {
        (Some(Ok(k)), Verdict::Replay { key: Some(got), .. }) => assert_eq!(got, k),
        (Some(Err(e)), Verdict::Poison(reason)) => assert_eq!(reason, e.to_string()),
        (None, Verdict::Poison(reason)) => {
            assert!(reason.starts_with("NotJson"), "{reason}")
        }
        (d, v) => panic!("derive gave {d:?} but classify {v:?}"),
    }
});
