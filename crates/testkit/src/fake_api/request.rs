//! What a request asks besides its path: label and field selectors, and the context of a write.

use super::*;

/// A label or field requirement of a selector.
#[derive(Debug, Clone)]
pub(super) enum Req {
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

impl Req {
    pub(super) fn matches(&self, get: &dyn Fn(&str) -> Option<String>) -> bool {
        match self {
            Req::Eq(k, v) => get(k).as_deref() == Some(v.as_str()),
            Req::Ne(k, v) => get(k).as_deref() != Some(v.as_str()),
            Req::In(k, vs) => get(k).is_some_and(|x| vs.contains(&x)),
            Req::NotIn(k, vs) => !get(k).is_some_and(|x| vs.contains(&x)),
            Req::Exists(k) => get(k).is_some(),
            Req::NotExists(k) => get(k).is_none(),
        }
    }
}

/// Splits `a=b,c in (x,y),!d` at the commas outside parentheses.
pub(super) fn split_selector(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0;
    let mut cur = String::new();
    for c in s.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    out.push(cur);
    out.into_iter()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

pub(super) fn parse_selector(s: &str) -> Vec<Req> {
    let set = |v: &str| -> Vec<String> {
        v.trim()
            .trim_start_matches('(')
            .trim_end_matches(')')
            .split(',')
            .map(|x| x.trim().to_string())
            .collect()
    };
    split_selector(s)
        .into_iter()
        .filter_map(|term| {
            if let Some((k, v)) = term.split_once("!=") {
                Some(Req::Ne(k.trim().into(), v.trim().into()))
            } else if let Some((k, v)) = term.split_once("==") {
                Some(Req::Eq(k.trim().into(), v.trim().into()))
            } else if let Some((k, v)) = term.split_once('=') {
                Some(Req::Eq(k.trim().into(), v.trim().into()))
            } else if let Some((k, v)) = term.split_once(" notin ") {
                Some(Req::NotIn(k.trim().into(), set(v)))
            } else if let Some((k, v)) = term.split_once(" in ") {
                Some(Req::In(k.trim().into(), set(v)))
            } else if let Some(k) = term.strip_prefix('!') {
                Some(Req::NotExists(k.trim().into()))
            } else if term.contains(char::is_whitespace) {
                None
            } else {
                Some(Req::Exists(term))
            }
        })
        .collect()
}

/// Which objects a list or watch sees.
#[derive(Debug, Clone, Default)]
pub(super) struct Filter {
    pub(super) namespace: Option<String>,
    pub(super) labels: Vec<Req>,
    /// Only `metadata.name` and `metadata.namespace` are understood; other fields are ignored.
    pub(super) fields: Vec<Req>,
}

impl Filter {
    pub(super) fn from_query(namespace: Option<String>, q: &HashMap<String, String>) -> Self {
        let fields = q
            .get("fieldSelector")
            .map(|s| parse_selector(s))
            .unwrap_or_default()
            .into_iter()
            .filter(|r| {
                let k = match r {
                    Req::Eq(k, _) | Req::Ne(k, _) | Req::In(k, _) | Req::NotIn(k, _) => k,
                    Req::Exists(k) | Req::NotExists(k) => k,
                };
                k == "metadata.name" || k == "metadata.namespace"
            })
            .collect();
        Self {
            namespace,
            labels: q
                .get("labelSelector")
                .map(|s| parse_selector(s))
                .unwrap_or_default(),
            fields,
        }
    }

    pub(super) fn matches(&self, obj: &Value) -> bool {
        let meta = &obj["metadata"];
        if let Some(ns) = &self.namespace {
            if meta["namespace"].as_str().unwrap_or("") != ns {
                return false;
            }
        }
        let label = |k: &str| meta["labels"][k].as_str().map(str::to_string);
        let field = |k: &str| match k {
            "metadata.name" => meta["name"].as_str().map(str::to_string),
            "metadata.namespace" => meta["namespace"].as_str().map(str::to_string),
            _ => None,
        };
        self.labels.iter().all(|r| r.matches(&label))
            && self.fields.iter().all(|r| r.matches(&field))
    }
}

/// What a write request says besides its body.
#[derive(Debug, Clone, Default)]
pub(super) struct Ctx {
    /// `dryRun`: answer as if written, store nothing.
    pub(super) dry_run: bool,
    /// `force=true`: a server-side apply takes over fields other managers own.
    pub(super) force: bool,
    /// `fieldManager`, else the User-Agent's product, else `unknown`.
    pub(super) manager: String,
    /// `fieldValidation`: `Strict` refuses unknown fields, `Ignore` drops them silently, and
    /// `Warn` (the default) drops them with a `Warning` header.
    pub(super) field_validation: Option<String>,
}
