//! Pruning: the fields the schema does not know go, as kube-apiserver drops them.

use serde_json::{Map, Value};

pub(super) fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

pub(super) fn prune_object(
    map: &mut Map<String, Value>,
    schema: &Value,
    path: &str,
    root: bool,
    unknown: &mut Vec<String>,
) {
    let props = schema.get("properties").and_then(Value::as_object);
    let additional = schema.get("additionalProperties").filter(|a| a.is_object());
    let keep_unknown =
        preserves_unknown(schema) || schema.get("additionalProperties") == Some(&Value::Bool(true));
    let keys: Vec<String> = map.keys().cloned().collect();
    for key in keys {
        if root && matches!(key.as_str(), "apiVersion" | "kind" | "metadata") {
            continue;
        }
        let sub = props.and_then(|p| p.get(&key)).or(additional);
        let Some(sub) = sub else {
            if !keep_unknown {
                map.remove(&key);
                unknown.push(join(path, &key));
            }
            continue;
        };
        let child_path = join(path, &key);
        let value = map.get_mut(&key).expect("key from the map");
        if value.is_null() {
            if sub.get("nullable").and_then(Value::as_bool) != Some(true) {
                map.remove(&key);
            }
            continue;
        }
        prune_value(value, sub, &child_path, unknown);
    }
}

pub(super) fn prune_value(
    value: &mut Value,
    schema: &Value,
    path: &str,
    unknown: &mut Vec<String>,
) {
    match value {
        Value::Object(map) => prune_object(map, schema, path, false, unknown),
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items").filter(|s| s.is_object()) {
                for (i, item) in items.iter_mut().enumerate() {
                    prune_value(item, item_schema, &format!("{path}[{i}]"), unknown);
                }
            }
        }
        _ => {}
    }
}

fn preserves_unknown(schema: &Value) -> bool {
    schema
        .get("x-kubernetes-preserve-unknown-fields")
        .and_then(Value::as_bool)
        == Some(true)
}
