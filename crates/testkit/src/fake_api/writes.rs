//! Writes: create, update, the patches (merge, JSON, strategic-as-merge, apply-as-merge, with
//! server-side apply conflicts and owners), delete with finalizers.

use super::*;

impl State {
    pub(super) fn create(
        &mut self,
        k: usize,
        ns: &str,
        mut body: Value,
        ctx: &Ctx,
    ) -> ApiResult<Value> {
        let kind = KINDS[k];
        if !body.is_object() {
            return Err(err(400, "BadRequest", "the body must be a JSON object"));
        }
        body["apiVersion"] = json!(kind.api_version());
        body["kind"] = json!(kind.kind);
        let meta = meta_mut(&mut body);
        let mut name = meta
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if name.is_empty() {
            if let Some(prefix) = meta.get("generateName").and_then(Value::as_str) {
                name = format!(
                    "{prefix}{}",
                    &uuid::Uuid::new_v4().simple().to_string()[..5]
                );
            }
        }
        if name.is_empty() {
            return Err(err(
                422,
                "Invalid",
                format!(
                    "{} \"\" is invalid: metadata.name: Required value: name or generateName is required",
                    kind.kind
                ),
            ));
        }
        if kind.namespaced {
            match meta.get("namespace").and_then(Value::as_str) {
                Some(other) if !other.is_empty() && other != ns => {
                    return Err(err(
                        400,
                        "BadRequest",
                        "the namespace of the provided object does not match the namespace sent on the request",
                    ))
                }
                _ => {}
            }
            meta.insert("namespace".into(), json!(ns));
        } else {
            meta.remove("namespace");
        }
        let key: Key = (
            k,
            if kind.namespaced {
                ns.into()
            } else {
                String::new()
            },
            name.clone(),
        );
        if self.objects.contains_key(&key) {
            return Err(obj_err(
                409,
                "AlreadyExists",
                &kind,
                &name,
                "already exists",
            ));
        }
        meta.insert("name".into(), json!(name));
        meta.insert("uid".into(), json!(uuid::Uuid::new_v4().to_string()));
        meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
        meta.insert("generation".into(), json!(1));
        meta.remove("deletionTimestamp");
        meta.remove("deletionGracePeriodSeconds");
        meta.remove("resourceVersion");
        meta.remove("managedFields");
        if kind.status {
            if let Some(m) = body.as_object_mut() {
                m.remove("status");
            }
        }
        normalize(&kind, &mut body);
        self.admit(k, &name, &mut body, None, false, ctx)?;
        if ctx.dry_run {
            return Ok(body);
        }
        let rv = self.bump();
        body["metadata"]["resourceVersion"] = json!(rv.to_string());
        self.record_owners(&key, None, &body, &ctx.manager, None);
        self.objects.insert(key, body.clone());
        self.emit(k, "ADDED", &body);
        Ok(body)
    }

    /// Stores `new` in place of `old` (which is stored under `key`), as the real server would:
    /// immutable metadata kept, `.status` only through the subresource, generation bumped on spec
    /// changes, no-op writes not bumping the resourceVersion, and an object being deleted removed
    /// once its last finalizer is gone.
    pub(super) fn commit_update(
        &mut self,
        key: &Key,
        old: &Value,
        mut new: Value,
        status_sub: bool,
        ctx: &Ctx,
        applied: Option<&Value>,
    ) -> ApiResult<Value> {
        let kind = KINDS[key.0];
        if !new.is_object() {
            return Err(err(400, "BadRequest", "the body must be a JSON object"));
        }
        if status_sub {
            // Only `.status` changes through /status.
            let mut merged = old.clone();
            set_status(&mut merged, &new);
            new = merged;
        } else {
            if let Some(uid) = new["metadata"]["uid"].as_str() {
                if !uid.is_empty() && Some(uid) != old["metadata"]["uid"].as_str() {
                    return Err(obj_err(
                        409,
                        "Conflict",
                        &kind,
                        &key.2,
                        "Precondition failed: UID in precondition does not match the UID in record",
                    ));
                }
            }
            new["apiVersion"] = json!(kind.api_version());
            new["kind"] = json!(kind.kind);
            let old_meta = old["metadata"].clone();
            let meta = meta_mut(&mut new);
            for k in [
                "name",
                "namespace",
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "generation",
            ] {
                match old_meta.get(k) {
                    Some(v) => {
                        meta.insert(k.into(), v.clone());
                    }
                    None => {
                        meta.remove(k);
                    }
                }
            }
            meta.remove("managedFields");
            if kind.status {
                set_status(&mut new, old);
            }
        }
        normalize(&kind, &mut new);
        self.admit(key.0, &key.2, &mut new, Some(old), status_sub, ctx)?;
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"].clone();
        if spec_part(&new) != spec_part(old) {
            let generation = old["metadata"]["generation"].as_i64().unwrap_or(0) + 1;
            new["metadata"]["generation"] = json!(generation);
        }
        let deleting = !new["metadata"]["deletionTimestamp"].is_null();
        if new == *old && !(deleting && finalizers(&new) == 0) {
            // A no-op write: nothing stored, no event, same resourceVersion.
            return Ok(new);
        }
        if ctx.dry_run {
            return Ok(new);
        }
        let rv = self.bump();
        new["metadata"]["resourceVersion"] = json!(rv.to_string());
        if deleting && finalizers(&new) == 0 {
            self.objects.remove(key);
            self.owners.remove(key);
            self.emit(key.0, "DELETED", &new);
        } else {
            self.record_owners(key, Some(old), &new, &ctx.manager, applied);
            self.objects.insert(key.clone(), new.clone());
            self.emit(key.0, "MODIFIED", &new);
        }
        Ok(new)
    }

    /// Server-side apply without `force`: a field the patch sets to a new value while another
    /// manager owns it is a conflict (409), as on the real server. Field ownership is tracked per
    /// leaf (JSON pointer), without the real server's list-merge keys.
    pub(super) fn apply_conflicts(
        &self,
        key: &Key,
        old: &Value,
        patch: &Value,
        status_sub: bool,
        manager: &str,
    ) -> ApiResult<()> {
        let Some(owners) = self.owners.get(key) else {
            return Ok(());
        };
        let has_status = KINDS[key.0].status;
        let mut conflicts = Vec::new();
        for (path, value) in leaves(patch) {
            let in_status = path == "/status" || path.starts_with("/status/");
            if value.is_null() || (has_status && in_status != status_sub) {
                continue;
            }
            let Some(current) = old.pointer(&path) else {
                continue;
            };
            if *current == value {
                continue;
            }
            if let Some(owner) = owners.get(&path).filter(|o| o.as_str() != manager) {
                conflicts.push((
                    format!("conflict with \"{owner}\""),
                    format!(".{}", path.trim_start_matches('/').replace('/', ".")),
                ));
            }
        }
        if conflicts.is_empty() {
            return Ok(());
        }
        // As kube-apiserver: no name, group or kind, one `FieldManagerConflict` cause per field.
        let causes: Vec<Value> = conflicts
            .iter()
            .map(|(m, f)| json!({"reason": "FieldManagerConflict", "message": m, "field": f}))
            .collect();
        let each: Vec<String> = conflicts.iter().map(|(m, f)| format!("{m}: {f}")).collect();
        Err(ApiError {
            code: 409,
            reason: "Conflict",
            message: format!(
                "Apply failed with {} conflict{}: {}",
                conflicts.len(),
                if conflicts.len() == 1 { "" } else { "s" },
                each.join(", ")
            ),
            details: Some(json!({ "causes": causes })),
        })
    }

    /// Records `manager` as the owner of every field it changed (and, for an apply, of every
    /// field it applied).
    pub(super) fn record_owners(
        &mut self,
        key: &Key,
        old: Option<&Value>,
        new: &Value,
        manager: &str,
        applied: Option<&Value>,
    ) {
        let before = old.map(leaves).unwrap_or_default();
        let after = leaves(new);
        let owners = self.owners.entry(key.clone()).or_default();
        owners.retain(|p, _| after.contains_key(p));
        for (p, v) in &after {
            if before.get(p) != Some(v) {
                owners.insert(p.clone(), manager.to_string());
            }
        }
        if let Some(a) = applied {
            for (p, v) in leaves(a) {
                if !v.is_null() && after.contains_key(&p) {
                    owners.insert(p, manager.to_string());
                }
            }
        }
    }

    pub(super) fn get(&self, key: &Key) -> ApiResult<Value> {
        self.objects
            .get(key)
            .cloned()
            .ok_or_else(|| not_found(&KINDS[key.0], &key.2))
    }

    pub(super) fn update(
        &mut self,
        key: &Key,
        body: Value,
        status_sub: bool,
        ctx: &Ctx,
    ) -> ApiResult<Value> {
        let kind = KINDS[key.0];
        let old = self.get(key)?;
        if let Some(name) = body["metadata"]["name"].as_str() {
            if name != key.2 {
                return Err(err(
                    400,
                    "BadRequest",
                    "the name of the object does not match the name on the URL",
                ));
            }
        }
        if let Some(rv) = body["metadata"]["resourceVersion"].as_str() {
            if !rv.is_empty() && Some(rv) != old["metadata"]["resourceVersion"].as_str() {
                return Err(obj_err(
                    409,
                    "Conflict",
                    &kind,
                    &key.2,
                    "the object has been modified; please apply your changes to the latest version and try again",
                ));
            }
        }
        self.commit_update(key, &old, body, status_sub, ctx, None)
    }

    pub(super) fn patch(
        &mut self,
        key: &Key,
        content_type: &str,
        body: &[u8],
        status_sub: bool,
        ctx: &Ctx,
    ) -> ApiResult<(StatusCode, Value)> {
        let kind = KINDS[key.0];
        let bad = |e: String| err(400, "BadRequest", format!("cannot decode the patch: {e}"));
        if content_type == "application/apply-patch+yaml" {
            let applied = parse_json_or_yaml(body).map_err(bad)?;
            self.check_apply_fields(key, &applied)?;
        }
        let old = match self.objects.get(key) {
            Some(o) => o.clone(),
            None if content_type == "application/apply-patch+yaml" && !status_sub => {
                let mut obj = parse_json_or_yaml(body).map_err(bad)?;
                if obj.is_object() && obj["metadata"]["name"].is_null() {
                    meta_mut(&mut obj).insert("name".into(), json!(key.2));
                }
                return self
                    .create(key.0, &key.1, obj, ctx)
                    .map(|o| (StatusCode::CREATED, o));
            }
            None => return Err(not_found(&kind, &key.2)),
        };
        if content_type == "application/strategic-merge-patch+json" && kind.is_custom() {
            // As the real server: custom resources have no strategic merge schema.
            return Err(err(
                415,
                "UnsupportedMediaType",
                "strategic merge patch is not supported for custom resources",
            ));
        }
        let mut doc = old.clone();
        let mut applied = None;
        match content_type {
            "application/json-patch+json" => {
                let patch: json_patch::Patch =
                    serde_json::from_slice(body).map_err(|e| bad(e.to_string()))?;
                for op in patch.0.iter() {
                    if let json_patch::PatchOperation::Test(t) = op {
                        // As the real server (evanphx/json-patch): testing a missing path for null
                        // succeeds; kube's finalizer helper relies on it.
                        if t.value.is_null() && doc.pointer(t.path.as_str()).is_none() {
                            continue;
                        }
                    }
                    // As kube-apiserver: a failed test or a missing path says no more than this.
                    json_patch::patch(&mut doc, std::slice::from_ref(op)).map_err(|_| {
                        ApiError {
                            code: 422,
                            reason: "Invalid",
                            message:
                                "the server rejected our request due to an error in our request"
                                    .into(),
                            details: Some(json!({})),
                        }
                    })?;
                }
            }
            "application/merge-patch+json"
            | "application/strategic-merge-patch+json"
            | "application/apply-patch+yaml" => {
                let patch = if content_type == "application/apply-patch+yaml" {
                    parse_json_or_yaml(body).map_err(bad)?
                } else {
                    serde_json::from_slice(body).map_err(|e| bad(e.to_string()))?
                };
                if !patch.is_object() {
                    return Err(bad("the patch must be a JSON object".into()));
                }
                if content_type == "application/apply-patch+yaml" {
                    if !ctx.force {
                        self.apply_conflicts(key, &old, &patch, status_sub, &ctx.manager)?;
                    }
                    applied = Some(patch.clone());
                } else if let Some(rv) = patch["metadata"]["resourceVersion"].as_str() {
                    if Some(rv) != old["metadata"]["resourceVersion"].as_str() {
                        return Err(obj_err(
                                409,
                                "Conflict",
                                &kind,
                                &key.2,
                                "the object has been modified; please apply your changes to the latest version and try again",
                            ));
                    }
                }
                json_patch::merge(&mut doc, &patch);
            }
            other => {
                return Err(err(
                    415,
                    "UnsupportedMediaType",
                    format!("the body of the request was in an unknown format: {other}"),
                ))
            }
        }
        if applied.is_none() {
            self.strict_patch(key, &doc, ctx)?;
        }
        self.commit_update(key, &old, doc, status_sub, ctx, applied.as_ref())
            .map(|o| (StatusCode::OK, o))
    }

    pub(super) fn delete(&mut self, key: &Key, opts: &Value, ctx: &Ctx) -> ApiResult<Value> {
        let kind = KINDS[key.0];
        let old = self.get(key)?;
        let pre = &opts["preconditions"];
        for (field, what) in [("uid", "UID"), ("resourceVersion", "ResourceVersion")] {
            if let Some(want) = pre[field].as_str() {
                if Some(want) != old["metadata"][field].as_str() {
                    return Err(obj_err(
                        409,
                        "Conflict",
                        &kind,
                        &key.2,
                        &format!(
                            "Precondition failed: {what} in precondition: {want}, {what} in object meta: {}",
                            old["metadata"][field].as_str().unwrap_or("")
                        ),
                    ));
                }
            }
        }
        if finalizers(&old) > 0 {
            if !old["metadata"]["deletionTimestamp"].is_null() || ctx.dry_run {
                return Ok(old);
            }
            let mut new = old.clone();
            new["metadata"]["deletionTimestamp"] = json!(now_rfc3339());
            new["metadata"]["deletionGracePeriodSeconds"] = json!(0);
            let rv = self.bump();
            new["metadata"]["resourceVersion"] = json!(rv.to_string());
            self.objects.insert(key.clone(), new.clone());
            self.emit(key.0, "MODIFIED", &new);
            return Ok(new);
        }
        let details = json!({
            "name": key.2,
            "group": kind.group,
            "kind": kind.plural,
            "uid": old["metadata"]["uid"],
        });
        if !ctx.dry_run {
            let mut gone = old.clone();
            let rv = self.bump();
            gone["metadata"]["resourceVersion"] = json!(rv.to_string());
            self.objects.remove(key);
            self.owners.remove(key);
            self.emit(key.0, "DELETED", &gone);
        }
        if !kind.is_custom() {
            // Built-in resources answer with the deleted object.
            Ok(old)
        } else {
            // Custom resources answer with a Success status.
            Ok(json!({
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Success",
                "details": details,
            }))
        }
    }
}
