//! Idempotency key derivation: `prefix` + first 32 hex chars of sha256(values joined by ":").
//!
//! Pure, so the operator, the CLI, the benchmark and the workers' own tooling agree on a key.

use std::borrow::Cow;

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::spec::KeySpec;

/// Why no key could be derived.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// A field without default is absent from the body.
    #[error("idempotency key field {0} is missing and has no default")]
    Missing(String),
}

/// Derive the key of a JSON body.
pub fn derive(spec: &KeySpec, body: &Value) -> Result<String, KeyError> {
    let mut joined = String::new();
    for (i, field) in spec.fields.iter().enumerate() {
        let value = match body.pointer(&field.pointer).and_then(field_text) {
            Some(v) => v,
            None => field
                .default
                .clone()
                .ok_or_else(|| KeyError::Missing(field.pointer.clone()))?,
        };
        if i > 0 {
            joined.push(':');
        }
        joined.push_str(&value);
    }
    Ok(key_of(&spec.prefix, &joined))
}

/// Derive the key of a body that is not parsed yet: only the values the key's pointers name are
/// built (see [`pick`]). `None` when the body is not JSON.
pub fn derive_body(spec: &KeySpec, body: &[u8]) -> Option<Result<String, KeyError>> {
    let pointers: Vec<&str> = spec.fields.iter().map(|f| f.pointer.as_str()).collect();
    let values = pick(body, &pointers)?;
    let mut joined = String::new();
    for (i, (field, value)) in spec.fields.iter().zip(values).enumerate() {
        let value = match value.as_ref().and_then(field_text) {
            Some(v) => v,
            None => match field.default.clone() {
                Some(d) => d,
                None => return Some(Err(KeyError::Missing(field.pointer.clone()))),
            },
        };
        if i > 0 {
            joined.push(':');
        }
        joined.push_str(&value);
    }
    Some(Ok(key_of(&spec.prefix, &joined)))
}

/// The values at `pointers` in a JSON body, as `Value::pointer` on the parsed body gives them,
/// without building the document: the values pointed at are built, everything else is parsed as
/// `serde_json::from_slice::<Value>` parses it (so a body it refuses is refused here too) and
/// dropped. `None` when the body is not JSON.
pub fn pick(body: &[u8], pointers: &[&str]) -> Option<Vec<Option<Value>>> {
    let tokens: Vec<Option<Vec<Cow<str>>>> = pointers
        .iter()
        .map(|p| {
            if p.is_empty() {
                return Some(Vec::new());
            }
            let rest = p.strip_prefix('/')?;
            Some(
                rest.split('/')
                    // Escaped tokens are rare: the others are borrowed, not copied per message.
                    .map(|t| match t.contains('~') {
                        true => Cow::Owned(t.replace("~1", "/").replace("~0", "~")),
                        false => Cow::Borrowed(t),
                    })
                    .collect(),
            )
        })
        .collect();
    let wants: Vec<(usize, &[Cow<str>])> = tokens
        .iter()
        .enumerate()
        .filter_map(|(i, t)| t.as_deref().map(|t| (i, t)))
        .collect();
    let mut de = serde_json::Deserializer::from_slice(body);
    let found = serde::de::DeserializeSeed::deserialize(pick::Pick(&wants), &mut de).ok()?;
    de.end().ok()?;
    let mut out = vec![None; pointers.len()];
    for (i, v) in found {
        out[i] = v;
    }
    Some(out)
}

mod pick {
    //! The seeds of [`super::pick`]: `Pick` follows the pointers still wanted below a value,
    //! `Skip` parses a value and keeps nothing (with `deserialize_any`, as `Value` does: not
    //! `IgnoredAny`, whose laxer parse takes numbers out of range).
    use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
    use serde_json::Value;
    use std::borrow::Cow;
    use std::fmt;

    /// The pointers (by index) wanted below this value, with their remaining tokens. Yields,
    /// for each of them, the value found (or none).
    pub(super) struct Pick<'a, 'b>(pub(super) &'a [(usize, &'b [Cow<'b, str>])]);

    type Found = Vec<(usize, Option<Value>)>;

    impl<'de> DeserializeSeed<'de> for Pick<'_, '_> {
        type Value = Found;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Found, D::Error> {
            if self.0.iter().any(|(_, t)| t.is_empty()) {
                // A pointer ends here: this value is built, and the others follow it there.
                let v = Value::deserialize(d)?;
                return Ok(self
                    .0
                    .iter()
                    .map(|(i, t)| (*i, walk(&v, t).cloned()))
                    .collect());
            }
            d.deserialize_any(PickVisitor(self.0))
        }
    }

    use serde::Deserialize;

    /// `Value::pointer`'s walk over already split tokens.
    fn walk<'v>(v: &'v Value, tokens: &[Cow<str>]) -> Option<&'v Value> {
        tokens.iter().try_fold(v, |target, token| match target {
            Value::Object(map) => map.get(token.as_ref()),
            Value::Array(list) => index(token).and_then(|x| list.get(x)),
            _ => None,
        })
    }

    /// An array index as `Value::pointer` reads one.
    fn index(s: &str) -> Option<usize> {
        if s.starts_with('+') || (s.starts_with('0') && s.len() != 1) {
            return None;
        }
        s.parse().ok()
    }

    struct PickVisitor<'a, 'b>(&'a [(usize, &'b [Cow<'b, str>])]);

    impl PickVisitor<'_, '_> {
        fn none(&self) -> Found {
            self.0.iter().map(|(i, _)| (*i, None)).collect()
        }
    }

    macro_rules! scalars {
        ($($name:ident: $t:ty),*) => {$(
            fn $name<E>(self, _: $t) -> Result<Found, E> {
                Ok(self.none())
            }
        )*};
    }

    impl<'de> Visitor<'de> for PickVisitor<'_, '_> {
        type Value = Found;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("any JSON value")
        }
        scalars!(visit_bool: bool, visit_i64: i64, visit_u64: u64, visit_f64: f64,
            visit_str: &str);
        fn visit_unit<E>(self) -> Result<Found, E> {
            Ok(self.none())
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Found, A::Error> {
            let mut out = self.none();
            while let Some(key) = map.next_key_seed(KeyOf(self.0))? {
                let Some(key) = key else {
                    map.next_value::<Skip>()?;
                    continue;
                };
                let below: Vec<(usize, &[Cow<str>])> = self
                    .0
                    .iter()
                    .filter(|(_, t)| t[0] == key)
                    .map(|(i, t)| (*i, &t[1..]))
                    .collect();
                // A key given twice: the last one counts, as in a parsed `Value`.
                for (i, v) in map.next_value_seed(Pick(&below))? {
                    if let Some(slot) = out.iter_mut().find(|(j, _)| *j == i) {
                        slot.1 = v;
                    }
                }
            }
            Ok(out)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Found, A::Error> {
            let mut out = self.none();
            let mut n = 0usize;
            loop {
                let below: Vec<(usize, &[Cow<str>])> = self
                    .0
                    .iter()
                    .filter(|(_, t)| index(&t[0]) == Some(n))
                    .map(|(i, t)| (*i, &t[1..]))
                    .collect();
                if below.is_empty() {
                    if seq.next_element::<Skip>()?.is_none() {
                        break;
                    }
                } else {
                    let Some(found) = seq.next_element_seed(Pick(&below))? else {
                        break;
                    };
                    for (i, v) in found {
                        if let Some(slot) = out.iter_mut().find(|(j, _)| *j == i) {
                            slot.1 = v;
                        }
                    }
                }
                n += 1;
            }
            Ok(out)
        }
    }

    /// A map key: itself when some pointer takes it next, else none (nothing kept).
    struct KeyOf<'a, 'b>(&'a [(usize, &'b [Cow<'b, str>])]);

    impl<'de> DeserializeSeed<'de> for KeyOf<'_, '_> {
        type Value = Option<String>;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Option<String>, D::Error> {
            d.deserialize_string(self)
        }
    }

    impl<'de> Visitor<'de> for KeyOf<'_, '_> {
        type Value = Option<String>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a string key")
        }
        fn visit_str<E>(self, v: &str) -> Result<Option<String>, E> {
            Ok(self.0.iter().any(|(_, t)| t[0] == v).then(|| v.to_owned()))
        }
    }

    /// Any value, parsed and dropped.
    pub(super) struct Skip;

    impl<'de> Deserialize<'de> for Skip {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Skip, D::Error> {
            d.deserialize_any(SkipVisitor)
        }
    }

    struct SkipVisitor;

    macro_rules! skip_scalars {
        ($($name:ident: $t:ty),*) => {$(
            fn $name<E>(self, _: $t) -> Result<Skip, E> {
                Ok(Skip)
            }
        )*};
    }

    impl<'de> Visitor<'de> for SkipVisitor {
        type Value = Skip;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("any JSON value")
        }
        skip_scalars!(visit_bool: bool, visit_i64: i64, visit_u64: u64, visit_f64: f64,
            visit_str: &str);
        fn visit_unit<E>(self) -> Result<Skip, E> {
            Ok(Skip)
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Skip, A::Error> {
            while map.next_key_seed(KeyOf(&[]))?.is_some() {
                map.next_value::<Skip>()?;
            }
            Ok(Skip)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Skip, A::Error> {
            while seq.next_element::<Skip>()?.is_some() {}
            Ok(Skip)
        }
    }
}

/// The key of an already-joined value string.
pub fn key_of(prefix: &str, joined: &str) -> String {
    crate::message::short_hex(prefix, &Sha256::digest(joined.as_bytes()))
}

/// A field's text: strings by their content, numbers and booleans by their JSON form, objects
/// and arrays by their compact JSON. `null` counts as missing, so its default applies.
pub fn field_text(v: &Value) -> Option<String> {
    match v {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        other => Some(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::KeyField;
    use serde_json::json;

    fn spec() -> KeySpec {
        let f = |p: &str, d: Option<&str>| KeyField {
            pointer: p.into(),
            default: d.map(Into::into),
        };
        KeySpec {
            fields: vec![
                f("/asset_id", None),
                f("/stage", None),
                f("/version", Some("1")),
            ],
            prefix: "idem:".into(),
        }
    }

    #[test]
    fn matches_the_documented_example() {
        let body = json!({"asset_id": "ep214", "stage": "rss_publish"});
        let expected = format!(
            "idem:{}",
            &hex::encode(Sha256::digest(b"ep214:rss_publish:1"))[..32]
        );
        assert_eq!(derive(&spec(), &body).unwrap(), expected);
    }

    #[test]
    fn numbers_and_explicit_values_count() {
        let a = derive(&spec(), &json!({"asset_id": 7, "stage": "s", "version": 2})).unwrap();
        assert_eq!(a, key_of("idem:", "7:s:2"));
    }

    #[test]
    fn picking_finds_what_a_parsed_value_finds() {
        let bodies = [
            r#"{"a": 1, "b": {"c": [10, {"d": "x"}], "e~f/g": true}, "a": {"z": null}}"#,
            r#"{"id": "bench-1", "kind": "bench", "padding": "aaaa\u00e9"}"#,
            r#"[1, [2, 3], {"k": 1.5e3}]"#,
            r#"{"a": {"b": 1}, "a": {"c": 2}}"#,
            r#""just a string""#,
            r#"{"n": -0, "big": 18446744073709551615, "neg": -9223372036854775808}"#,
        ];
        let pointers = [
            "",
            "/a",
            "/a/z",
            "/b/c/1/d",
            "/b/c/01",
            "/b/c/+1",
            "/b/e~0f~1g",
            "/id",
            "/padding",
            "/0",
            "/1/1",
            "/2/k",
            "/a/b",
            "/a/c",
            "x",
            "/n",
            "/big",
            "/neg",
            "/missing/deeper",
            "/b/c/5",
        ];
        for body in bodies {
            let v: Value = serde_json::from_str(body).unwrap();
            let got = pick(body.as_bytes(), &pointers).expect(body);
            for (p, g) in pointers.iter().zip(got) {
                assert_eq!(g.as_ref(), v.pointer(p), "{body} at {p:?}");
            }
        }
    }

    #[test]
    fn picking_refuses_what_parsing_refuses() {
        for body in [
            "",
            "{",
            "{\"a\": 1} x",
            "{\"a\": 1e400}",
            "[1e400]",
            "{\"a\": \"\\ud800\"}",
            "nul",
            "{\"a\" 1}",
            "[1,]",
        ] {
            let parsed = serde_json::from_str::<Value>(body).is_ok();
            assert_eq!(pick(body.as_bytes(), &["/a"]).is_some(), parsed, "{body:?}");
        }
        let deep = "[".repeat(200) + &"]".repeat(200);
        assert_eq!(
            pick(deep.as_bytes(), &["/0"]).is_some(),
            serde_json::from_str::<Value>(&deep).is_ok()
        );
    }

    #[test]
    fn derive_body_is_derive() {
        let body = json!({"asset_id": "ep214", "stage": "rss_publish", "x": [1, 2]});
        let text = body.to_string();
        assert_eq!(
            derive_body(&spec(), text.as_bytes()),
            Some(derive(&spec(), &body))
        );
        let body = json!({"asset_id": "x"});
        assert_eq!(
            derive_body(&spec(), body.to_string().as_bytes()),
            Some(derive(&spec(), &body))
        );
        assert_eq!(derive_body(&spec(), b"not json"), None);
    }

    #[test]
    fn missing_field_without_default_is_an_error() {
        let e = derive(&spec(), &json!({"asset_id": "x"})).unwrap_err();
        assert_eq!(e, KeyError::Missing("/stage".into()));
    }
}
