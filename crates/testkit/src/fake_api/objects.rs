//! Objects as JSON: metadata, the spec and status parts, finalizers, and the leaves of an object.

use super::*;

pub(super) fn now_rfc3339() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// The object minus what does not count as a spec change.
pub(super) fn spec_part(obj: &Value) -> Value {
    let mut v = obj.clone();
    if let Some(m) = v.as_object_mut() {
        for k in ["metadata", "status", "apiVersion", "kind"] {
            m.remove(k);
        }
    }
    v
}

pub(super) fn finalizers(obj: &Value) -> usize {
    obj["metadata"]["finalizers"]
        .as_array()
        .map(Vec::len)
        .unwrap_or(0)
}

pub(super) fn meta_mut(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj["metadata"].is_object() {
        obj["metadata"] = json!({});
    }
    obj["metadata"]
        .as_object_mut()
        .expect("metadata is an object")
}

/// What the real API server does to every stored object: empty metadata collections are
/// omitted, a Secret's `stringData` is folded into `data`.
pub(super) fn normalize(kind: &Kind, obj: &mut Value) {
    let meta = meta_mut(obj);
    for k in ["finalizers", "labels", "annotations", "ownerReferences"] {
        let empty = match meta.get(k) {
            Some(Value::Array(a)) => a.is_empty(),
            Some(Value::Object(o)) => o.is_empty(),
            Some(Value::Null) => true,
            _ => false,
        };
        if empty {
            meta.remove(k);
        }
    }
    if kind.plural == "secrets" {
        if let Some(Value::Object(sd)) = obj.as_object_mut().and_then(|o| o.remove("stringData")) {
            if !obj["data"].is_object() {
                obj["data"] = json!({});
            }
            for (k, v) in sd {
                let text = v.as_str().unwrap_or_default().to_string();
                obj["data"][k] = json!(base64::engine::general_purpose::STANDARD.encode(text));
            }
        }
    }
}

pub(super) fn set_status(target: &mut Value, from: &Value) {
    if let Some(m) = target.as_object_mut() {
        match from.get("status") {
            Some(s) if !s.is_null() => {
                m.insert("status".into(), s.clone());
            }
            _ => {
                m.remove("status");
            }
        }
    }
}

pub(super) fn escape_pointer(s: &str) -> String {
    s.replace('~', "~0").replace('/', "~1")
}

/// The fields of an object a field manager can own, as JSON pointers to their values: leaves of
/// everything but `apiVersion`/`kind`, and of `metadata` only labels, annotations, finalizers and
/// ownerReferences. Arrays are leaves.
pub(super) fn leaves(obj: &Value) -> BTreeMap<String, Value> {
    fn walk(v: &Value, path: String, out: &mut BTreeMap<String, Value>) {
        match v {
            Value::Object(o) if !o.is_empty() => {
                for (k, val) in o {
                    walk(val, format!("{path}/{}", escape_pointer(k)), out);
                }
            }
            _ => {
                out.insert(path, v.clone());
            }
        }
    }
    let mut out = BTreeMap::new();
    let Some(o) = obj.as_object() else {
        return out;
    };
    for (k, val) in o {
        match k.as_str() {
            "apiVersion" | "kind" => {}
            "metadata" => {
                for mk in ["labels", "annotations"] {
                    if let Some(m) = val.get(mk).and_then(Value::as_object) {
                        for (lk, lv) in m {
                            out.insert(
                                format!("/metadata/{mk}/{}", escape_pointer(lk)),
                                lv.clone(),
                            );
                        }
                    }
                }
                for mk in ["finalizers", "ownerReferences"] {
                    if let Some(x) = val.get(mk) {
                        out.insert(format!("/metadata/{mk}"), x.clone());
                    }
                }
            }
            _ => walk(val, format!("/{}", escape_pointer(k)), &mut out),
        }
    }
    out
}
