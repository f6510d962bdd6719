//! Error answers: a `Status` with the code, reason, message and causes kube-apiserver gives.

use super::*;

/// An error answer: HTTP code, reason and message of a `Status`.
pub(super) struct ApiError {
    pub(super) code: u16,
    pub(super) reason: &'static str,
    pub(super) message: String,
    pub(super) details: Option<Value>,
}

pub(super) type ApiResult<T> = Result<T, ApiError>;

pub(super) fn err(code: u16, reason: &'static str, message: impl Into<String>) -> ApiError {
    ApiError {
        code,
        reason,
        message: message.into(),
        details: None,
    }
}

pub(super) fn obj_err(
    code: u16,
    reason: &'static str,
    kind: &Kind,
    name: &str,
    what: &str,
) -> ApiError {
    ApiError {
        code,
        reason,
        message: match reason {
            "Conflict" => format!(
                "Operation cannot be fulfilled on {} \"{name}\": {what}",
                kind.qualified()
            ),
            _ => format!("{} \"{name}\" {what}", kind.qualified()),
        },
        details: Some(json!({"name": name, "group": kind.group, "kind": kind.plural})),
    }
}

pub(super) fn not_found(kind: &Kind, name: &str) -> ApiError {
    obj_err(404, "NotFound", kind, name, "not found")
}

/// kube-apiserver's answer to an object its schema or CEL rules refuse: 422 `Invalid`, one
/// cause per field.
pub(super) fn invalid(kind: &Kind, name: &str, violations: &[Cause]) -> ApiError {
    let each: Vec<String> = violations
        .iter()
        .map(|c| format!("{}: {}", c.field, c.detail))
        .collect();
    let summary = match each.as_slice() {
        [one] => one.clone(),
        many => format!("[{}]", many.join(", ")),
    };
    let causes: Vec<Value> = violations
        .iter()
        .map(|c| json!({"reason": c.reason, "message": c.detail, "field": c.field}))
        .collect();
    ApiError {
        code: 422,
        reason: "Invalid",
        message: format!(
            "{}.{} \"{name}\" is invalid: {summary}",
            kind.kind, kind.group
        ),
        details: Some(json!({
            "name": name,
            "group": kind.group,
            "kind": kind.kind,
            "causes": causes,
        })),
    }
}

pub(super) fn status_body(e: &ApiError) -> Value {
    let mut v = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": e.message,
        "reason": e.reason,
        "code": e.code,
    });
    if e.reason.is_empty() {
        // As kube-apiserver's answer to an error it has no reason for (a 500).
        if let Some(m) = v.as_object_mut() {
            m.remove("reason");
        }
    }
    if let Some(d) = &e.details {
        v["details"] = d.clone();
    }
    v
}
