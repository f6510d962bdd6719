//! The server's state: objects, the global resourceVersion, each kind's history for watches;
//! admission (schema, defaults, CEL rules, ratcheting), events, lists and watches.

use super::*;

pub(super) struct Watcher {
    pub(super) kind: usize,
    pub(super) filter: Filter,
    pub(super) tx: mpsc::UnboundedSender<Value>,
}

pub(super) struct HistoryEntry {
    pub(super) kind: usize,
    pub(super) rv: u64,
    pub(super) event: Value,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) rv: u64,
    /// Watches from a resourceVersion below this answer 410 Gone.
    pub(super) compacted: u64,
    pub(super) objects: BTreeMap<Key, Value>,
    pub(super) history: Vec<HistoryEntry>,
    pub(super) watchers: Vec<Watcher>,
    /// Events in creation order, with their latest stored form.
    pub(super) event_keys: Vec<Key>,
    pub(super) event_last: HashMap<Key, Value>,
    pub(super) status_writes: HashMap<(String, String), usize>,
    /// Which field manager last set each field (JSON pointer) of each object, for the
    /// conflicts of server-side apply.
    pub(super) owners: HashMap<Key, BTreeMap<String, String>>,
    /// The schema of a `CustomResourceDefinition` written to the fake, by its resourceVersion.
    pub(super) crd_schema: Option<(String, Arc<Schemas>)>,
    /// The `Warning` headers of the request being answered.
    pub(super) warnings: Vec<String>,
}

impl State {
    pub(super) fn bump(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    /// The schema `kind`'s objects are checked against: that of its CRD when one was written to
    /// the fake (as after `kubectl apply -f` of another version of the CRD), else the committed
    /// one.
    pub(super) fn schema_of(&mut self, kind: &Kind) -> Arc<Schemas> {
        let Some(crds) = KINDS
            .iter()
            .position(|k| k.plural == "customresourcedefinitions")
        else {
            return committed_schema();
        };
        let Some(stored) = self
            .objects
            .get(&(crds, String::new(), kind.crd_name()))
            .cloned()
        else {
            return committed_schema();
        };
        let rv = stored["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if let Some((cached_rv, schema)) = &self.crd_schema {
            if *cached_rv == rv {
                return schema.clone();
            }
        }
        let schema = serde_json::from_value::<CustomResourceDefinition>(stored)
            .map_err(|e| e.to_string())
            .and_then(|crd| Schemas::new(&crd, kind.version));
        match schema {
            Ok(schema) => {
                let schema = Arc::new(schema);
                self.crd_schema = Some((rv, schema.clone()));
                schema
            }
            Err(e) => panic!(
                "the CustomResourceDefinition {} written to the fake: {e}",
                kind.crd_name()
            ),
        }
    }

    /// What kube-apiserver does to a custom resource before it stores it: prunes unknown fields
    /// (a warning, or with `fieldValidation=Strict` a 400: a patch is checked before, by
    /// [`State::strict_patch`]), applies the schema's defaults, and
    /// validates the schema and the CEL rules (`old`: the stored object of an update, for
    /// transition rules and ratcheting), refusing with 422.
    pub(super) fn admit(
        &mut self,
        k: usize,
        name: &str,
        obj: &mut Value,
        old: Option<&Value>,
        status_sub: bool,
        ctx: &Ctx,
    ) -> ApiResult<()> {
        let kind = KINDS[k];
        if !kind.has_schema() {
            return Ok(());
        }
        let schema = self.schema_of(&kind);
        let unknown = schema.full.prune(obj);
        if !unknown.is_empty() {
            let each: Vec<String> = unknown
                .iter()
                .map(|f| format!("unknown field \"{f}\""))
                .collect();
            match ctx.field_validation.as_deref() {
                Some("Strict") => {
                    return Err(err(
                        400,
                        "BadRequest",
                        format!(
                        "{} in version \"{}\" cannot be handled as a {}: strict decoding error: {}",
                        kind.kind,
                        kind.version,
                        kind.kind,
                        each.join(", ")
                    ),
                    ))
                }
                Some("Ignore") => {}
                _ => self.warnings.extend(each),
            }
        }
        schema.full.default(obj);
        let violations = schema.validate(obj, old, status_sub);
        if violations.is_empty() {
            Ok(())
        } else {
            Err(invalid(&kind, name, &violations))
        }
    }

    /// A server-side apply may not set a field the schema does not declare: kube-apiserver
    /// v1.36 fails it with a 500 (structured-merge-diff cannot type the patch).
    pub(super) fn check_apply_fields(&mut self, key: &Key, patch: &Value) -> ApiResult<()> {
        let kind = KINDS[key.0];
        if !kind.has_schema() {
            return Ok(());
        }
        let mut probe = patch.clone();
        let unknown = self.schema_of(&kind).full.prune(&mut probe);
        match unknown.first() {
            None => Ok(()),
            Some(field) => Err(err(
                500,
                "",
                format!(
                    "failed to create typed patch object ({}/{}; {}, Kind={}): .{field}: field not declared in schema",
                    key.1,
                    key.2,
                    kind.api_version(),
                    kind.kind
                ),
            )),
        }
    }

    /// `fieldValidation=Strict` on a merge or JSON patch: kube-apiserver decodes the patched
    /// object strictly and refuses an unknown field anywhere in it (also outside the part the
    /// subresource writes) with 422 `Invalid`, no kind or name, and one cause, field `patch`,
    /// whose value is the patched object.
    pub(super) fn strict_patch(&mut self, key: &Key, patched: &Value, ctx: &Ctx) -> ApiResult<()> {
        let kind = KINDS[key.0];
        if ctx.field_validation.as_deref() != Some("Strict") || !kind.has_schema() {
            return Ok(());
        }
        let mut probe = patched.clone();
        let unknown = self.schema_of(&kind).full.prune(&mut probe);
        if unknown.is_empty() {
            return Ok(());
        }
        let each: Vec<String> = unknown
            .iter()
            .map(|f| format!("unknown field \"{f}\""))
            .collect();
        let value = Value::String(patched.to_string()).to_string();
        let detail = format!(
            "Invalid value: {value}: strict decoding error: {}",
            each.join(", ")
        );
        Err(ApiError {
            code: 422,
            reason: "Invalid",
            message: format!(" \"\" is invalid: patch: {detail}"),
            details: Some(json!({
                "causes": [{"reason": "FieldValueInvalid", "message": detail, "field": "patch"}],
            })),
        })
    }

    /// Records a change for watches and the history.
    pub(super) fn emit(&mut self, kind: usize, etype: &str, obj: &Value) {
        let event = json!({"type": etype, "object": obj});
        self.history.push(HistoryEntry {
            kind,
            rv: self.rv,
            event: event.clone(),
        });
        self.watchers.retain(|w| {
            if w.kind != kind || !w.filter.matches(obj) {
                return !w.tx.is_closed();
            }
            w.tx.send(event.clone()).is_ok()
        });
        if KINDS[kind].is_event() {
            let key = (
                kind,
                obj["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
                obj["metadata"]["name"].as_str().unwrap_or("").to_string(),
            );
            if etype == "ADDED" {
                self.event_keys.push(key.clone());
            }
            self.event_last.insert(key, obj.clone());
        }
    }

    pub(super) fn matching(&self, k: usize, filter: &Filter) -> Vec<Value> {
        self.objects
            .iter()
            .filter(|((kk, _, _), o)| *kk == k && filter.matches(o))
            .map(|(_, o)| o.clone())
            .collect()
    }

    pub(super) fn list(&self, k: usize, filter: &Filter, q: &HashMap<String, String>) -> Value {
        let kind = KINDS[k];
        let mut items = self.matching(k, filter);
        let key_of = |o: &Value| {
            format!(
                "{}/{}",
                o["metadata"]["namespace"].as_str().unwrap_or(""),
                o["metadata"]["name"].as_str().unwrap_or("")
            )
        };
        if let Some(token) = q.get("continue").filter(|t| !t.is_empty()) {
            items.retain(|o| key_of(o).as_str() > token.as_str());
        }
        let mut meta = json!({"resourceVersion": self.rv.to_string()});
        if let Some(limit) = q
            .get("limit")
            .and_then(|l| l.parse::<usize>().ok())
            .filter(|l| *l > 0)
        {
            if items.len() > limit {
                let rest = items.len() - limit;
                items.truncate(limit);
                meta["continue"] = json!(key_of(items.last().expect("limit > 0")));
                meta["remainingItemCount"] = json!(rest);
            }
        }
        json!({
            "kind": format!("{}List", kind.kind),
            "apiVersion": kind.api_version(),
            "metadata": meta,
            "items": items,
        })
    }

    /// Starts a watch: the events to send first and, unless the watch is answered by a 410,
    /// the channel of live events.
    pub(super) fn watch(
        &mut self,
        k: usize,
        filter: Filter,
        q: &HashMap<String, String>,
    ) -> (VecDeque<Value>, Option<mpsc::UnboundedReceiver<Value>>) {
        let kind = KINDS[k];
        let rv_param = q.get("resourceVersion").map(String::as_str).unwrap_or("");
        let mut initial = VecDeque::new();
        if rv_param.is_empty() || rv_param == "0" {
            // "Start at most recent / any": the current state as ADDED, then what follows.
            for o in self.matching(k, &filter) {
                initial.push_back(json!({"type": "ADDED", "object": o}));
            }
            if q.get("sendInitialEvents").map(String::as_str) == Some("true") {
                initial.push_back(json!({"type": "BOOKMARK", "object": {
                    "kind": kind.kind,
                    "apiVersion": kind.api_version(),
                    "metadata": {
                        "resourceVersion": self.rv.to_string(),
                        "annotations": {"k8s.io/initial-events-end": "true"},
                    },
                }}));
            }
        } else {
            let from: u64 = match rv_param.parse() {
                Ok(n) => n,
                Err(_) => {
                    let e = err(
                        400,
                        "BadRequest",
                        format!("invalid resource version: {rv_param}"),
                    );
                    initial.push_back(json!({"type": "ERROR", "object": status_body(&e)}));
                    return (initial, None);
                }
            };
            if from < self.compacted {
                let e = err(
                    410,
                    "Expired",
                    format!("too old resource version: {from} ({})", self.rv),
                );
                initial.push_back(json!({"type": "ERROR", "object": status_body(&e)}));
                return (initial, None);
            }
            for h in &self.history {
                if h.kind == k && h.rv > from && filter.matches(&h.event["object"]) {
                    initial.push_back(h.event.clone());
                }
            }
        }
        let (tx, rx) = mpsc::unbounded_channel();
        self.watchers.push(Watcher {
            kind: k,
            filter,
            tx,
        });
        (initial, Some(rx))
    }
}
