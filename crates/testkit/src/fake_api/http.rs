//! HTTP: the routes of the Kubernetes REST API the fake answers, and its responses (JSON objects,
//! `Status` errors, streamed watches).

use super::*;

pub(super) type Body = UnsyncBoxBody<Bytes, Infallible>;

pub(super) fn parse_json_or_yaml(body: &[u8]) -> Result<Value, String> {
    match serde_json::from_slice(body) {
        Ok(v) => Ok(v),
        Err(json_err) => serde_yaml::from_slice(body).map_err(|e| format!("{json_err}; {e}")),
    }
}

/// A parsed request path.
pub(super) struct Route {
    pub(super) kind: usize,
    pub(super) namespace: Option<String>,
    pub(super) name: Option<String>,
    pub(super) subresource: Option<String>,
}

pub(super) fn route(path: &str) -> Result<Route, ApiError> {
    let unknown = || {
        err(
            404,
            "NotFound",
            "the server could not find the requested resource",
        )
    };
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segs.as_slice() {
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return Err(unknown()),
    };
    let (namespace, plural, name, sub) = match rest {
        ["namespaces", ns, plural, tail @ ..]
            if !(tail.is_empty() && (*plural == "status" || *plural == "finalize")) =>
        {
            (Some(ns.to_string()), *plural, tail.first(), tail.get(1))
        }
        [plural, tail @ ..] => (None, *plural, tail.first(), tail.get(1)),
        [] => return Err(unknown()),
    };
    if rest.len() > 5 {
        return Err(unknown());
    }
    let kind = kind_index(group, version, plural).ok_or_else(unknown)?;
    if KINDS[kind].namespaced != namespace.is_some() && name.is_some() {
        return Err(unknown());
    }
    if !KINDS[kind].namespaced && namespace.is_some() {
        return Err(unknown());
    }
    Ok(Route {
        kind,
        namespace,
        name: name.map(|s| s.to_string()),
        subresource: sub.map(|s| s.to_string()),
    })
}

pub(super) fn json_response(code: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(v.to_string())).boxed_unsync())
        .expect("response")
}

pub(super) fn error_response(e: &ApiError) -> Response<Body> {
    json_response(
        StatusCode::from_u16(e.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        &status_body(e),
    )
}

pub(super) fn watch_response(
    initial: VecDeque<Value>,
    rx: Option<mpsc::UnboundedReceiver<Value>>,
    timeout: Option<Duration>,
) -> Response<Body> {
    struct W {
        initial: VecDeque<Value>,
        rx: Option<mpsc::UnboundedReceiver<Value>>,
        deadline: Option<tokio::time::Instant>,
    }
    let w = W {
        initial,
        rx,
        deadline: timeout.map(|t| tokio::time::Instant::now() + t),
    };
    let frame = |v: Value| -> Result<Frame<Bytes>, Infallible> {
        Ok(Frame::data(Bytes::from(format!("{v}\n"))))
    };
    let stream = futures::stream::unfold(w, move |mut w| async move {
        if let Some(v) = w.initial.pop_front() {
            return Some((frame(v), w));
        }
        let rx = w.rx.as_mut()?;
        let next = match w.deadline {
            Some(d) => tokio::time::timeout_at(d, rx.recv()).await.ok().flatten(),
            None => rx.recv().await,
        };
        next.map(|v| (frame(v), w))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(BodyExt::boxed_unsync(StreamBody::new(stream)))
        .expect("response")
}

pub(super) async fn handle(state: &Mutex<State>, req: Request<Incoming>) -> Response<Body> {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let q: HashMap<String, String> =
        url::form_urlencoded::parse(req.uri().query().unwrap_or("").as_bytes())
            .into_owned()
            .collect();
    let content_type = req
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_string();
    let user_agent = req
        .headers()
        .get("user-agent")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split('/').next())
        .filter(|v| !v.is_empty())
        .map(str::to_string);
    if path == "/version" {
        return json_response(
            StatusCode::OK,
            &json!({"major": "1", "minor": "36", "gitVersion": "v1.36.0-fake", "platform": "linux/amd64"}),
        );
    }
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return error_response(&err(400, "BadRequest", e.to_string())),
    };
    let r = match route(&path) {
        Ok(r) => r,
        Err(e) => return error_response(&e),
    };
    let kind = KINDS[r.kind];
    let ns = r.namespace.clone().unwrap_or_default();
    let ctx = Ctx {
        dry_run: q.contains_key("dryRun"),
        force: q.get("force").map(String::as_str) == Some("true"),
        manager: q
            .get("fieldManager")
            .cloned()
            .or(user_agent)
            .unwrap_or_else(|| "unknown".into()),
        field_validation: q.get("fieldValidation").cloned(),
    };
    let status_sub = match r.subresource.as_deref() {
        None => false,
        Some("status") if kind.status => true,
        Some(_) => {
            return error_response(&err(
                404,
                "NotFound",
                "the server could not find the requested resource",
            ))
        }
    };
    let is_watch = matches!(q.get("watch").map(String::as_str), Some("true" | "1"));
    let parse_body = || -> ApiResult<Value> {
        serde_json::from_slice(&body)
            .map_err(|e| err(400, "BadRequest", format!("cannot decode the body: {e}")))
    };
    let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
    if status_sub && (method == Method::PUT || method == Method::PATCH) {
        if let Some(name) = &r.name {
            *s.status_writes
                .entry((ns.clone(), name.clone()))
                .or_default() += 1;
        }
    }
    let result: ApiResult<(StatusCode, Value)> = match (&method, &r.name) {
        (&Method::GET, None) if is_watch => {
            let filter = Filter::from_query(r.namespace.clone(), &q);
            let (initial, rx) = s.watch(r.kind, filter, &q);
            let timeout = q
                .get("timeoutSeconds")
                .and_then(|t| t.parse::<u64>().ok())
                .map(Duration::from_secs);
            return watch_response(initial, rx, timeout);
        }
        (&Method::GET, None) => {
            let filter = Filter::from_query(r.namespace.clone(), &q);
            Ok((StatusCode::OK, s.list(r.kind, &filter, &q)))
        }
        (&Method::POST, None) if kind.namespaced && r.namespace.is_none() => Err(err(
            405,
            "MethodNotAllowed",
            "create a namespaced object under /namespaces/{ns}/",
        )),
        (&Method::POST, None) => parse_body()
            .and_then(|b| s.create(r.kind, &ns, b, &ctx))
            .map(|o| (StatusCode::CREATED, o)),
        (&Method::DELETE, None) => {
            let filter = Filter::from_query(r.namespace.clone(), &q);
            let names: Vec<Key> = s
                .matching(r.kind, &filter)
                .iter()
                .map(|o| {
                    (
                        r.kind,
                        o["metadata"]["namespace"]
                            .as_str()
                            .unwrap_or("")
                            .to_string(),
                        o["metadata"]["name"].as_str().unwrap_or("").to_string(),
                    )
                })
                .collect();
            let mut items = Vec::new();
            let mut failed = None;
            for key in names {
                match s.delete(&key, &Value::Null, &ctx) {
                    Ok(o) if o["kind"] != "Status" => items.push(o),
                    Ok(_) => {}
                    Err(e) => failed = Some(e),
                }
            }
            match failed {
                Some(e) => Err(e),
                None => Ok((
                    StatusCode::OK,
                    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}),
                )),
            }
        }
        (&Method::GET, Some(name)) => s
            .get(&(r.kind, ns.clone(), name.clone()))
            .map(|o| (StatusCode::OK, o)),
        (&Method::PUT, Some(name)) => parse_body()
            .and_then(|b| s.update(&(r.kind, ns.clone(), name.clone()), b, status_sub, &ctx))
            .map(|o| (StatusCode::OK, o)),
        (&Method::PATCH, Some(name)) => s.patch(
            &(r.kind, ns.clone(), name.clone()),
            &content_type,
            &body,
            status_sub,
            &ctx,
        ),
        (&Method::DELETE, Some(name)) => {
            let opts = if body.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&body).unwrap_or(Value::Null)
            };
            s.delete(&(r.kind, ns.clone(), name.clone()), &opts, &ctx)
                .map(|o| (StatusCode::OK, o))
        }
        _ => Err(err(
            405,
            "MethodNotAllowed",
            format!("{method} is not supported here"),
        )),
    };
    let warnings = std::mem::take(&mut s.warnings);
    drop(s);
    let mut response = match result {
        Ok((code, v)) => json_response(code, &v),
        Err(e) => error_response(&e),
    };
    for w in warnings {
        let value = format!("299 - {}", serde_json::Value::String(w));
        if let Ok(v) = hyper::header::HeaderValue::from_str(&value) {
            response.headers_mut().append("warning", v);
        }
    }
    response
}
