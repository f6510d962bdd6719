//! Reading a replay's audit rows and stored status from Redis, for `dlq-replay report`.

use crate::api::{AuditRef, CanaryStatus, DlqReplay, IdempotencyMode, ReplayStatus};
use crate::engine::store::{self, AuditRow, Store};
use crate::Error;

use super::Meta;

/// The manifest-side facts of a replay.
pub fn meta_of(resource: &DlqReplay) -> Meta {
    let spec = &resource.spec;
    let target = match (&spec.target.exchange, &spec.target.routing_key) {
        (None, None) => "each message's original exchange and routing key".to_string(),
        (e, k) => format!(
            "exchange {:?}, routing key {}",
            e.as_deref().unwrap_or(""),
            k.as_deref().unwrap_or("(the message's own)")
        ),
    };
    Meta {
        namespace: resource.namespace_or_default(),
        name: resource.name_or_empty(),
        audit_key: String::new(),
        source_queue: Some(spec.source.queue.clone()),
        mode: Some(match spec.idempotency.as_ref().map(|i| i.mode) {
            Some(IdempotencyMode::Check) => "Check".into(),
            Some(IdempotencyMode::Claim) => "Claim".into(),
            None => "none (no idempotency gate)".into(),
        }),
        target: Some(target),
        rate: spec.rate.as_ref().map(|r| r.messages_per_second),
    }
}

/// The namespace and name in an audit key `dlq:audit:<namespace>/<name>/<replay id>`.
pub fn names_of_key(key: &str) -> Option<(String, String)> {
    store::Keys::names_of_audit(key)
}

/// The replay's status as stored: its final status once it ended Done or CanaryFailed, else
/// what the state holds (counts, start, canary results; no phase).
pub fn status_of(state: &store::State, key: &str) -> Result<ReplayStatus, Error> {
    if let Some(json) = &state.final_status {
        let mut status: ReplayStatus = serde_json::from_str(json)
            .map_err(|e| Error::Redis(format!("stored final status is unreadable: {e}")))?;
        if status.started_at.is_none() && !state.started_at.is_empty() {
            status.started_at = Some(state.started_at.clone());
        }
        return Ok(status);
    }
    let canary: Vec<CanaryStatus> = match &state.canary {
        Some(json) => serde_json::from_str(json)
            .map_err(|e| Error::Redis(format!("stored canary results: {e}")))?,
        None => Vec::new(),
    };
    Ok(ReplayStatus {
        replay_id: Some(state.replay_id.clone()),
        source_depth_at_start: Some(state.depth_at_start),
        counts: state.counts,
        canary,
        audit: Some(AuditRef {
            key: key.to_string(),
            records: state.records,
            ..AuditRef::default()
        }),
        started_at: (!state.started_at.is_empty()).then(|| state.started_at.clone()),
        ..ReplayStatus::default()
    })
}

/// Counts from audit rows alone (what is left in the DLQ has no row: skipped stays 0).
pub fn counts_of(rows: &[AuditRow]) -> crate::api::Counts {
    let mut c = crate::api::Counts::default();
    for r in rows {
        match store::Decision::parse(&r.decision) {
            Some(store::Decision::Replayed) => c.replayed += 1,
            Some(store::Decision::Duplicate) => c.duplicates += 1,
            Some(store::Decision::Quarantined) => c.quarantined += 1,
            Some(store::Decision::Failed) => c.failed += 1,
            None => continue,
        }
        c.scanned += 1;
    }
    c
}

/// Read what a report of the replay `meta` (namespace and name set) needs: its audit key (given,
/// or that of its stored replay id), status and rows.
pub async fn load(
    redis_url: &str,
    mut meta: Meta,
    key: Option<&str>,
) -> Result<(Meta, ReplayStatus, Vec<AuditRow>), Error> {
    let con = store::connect(redis_url).await?;
    let state = Store::peek(con.clone(), &meta.namespace, &meta.name).await?;
    let key = match (key, &state) {
        (Some(k), _) => k.to_string(),
        (None, Some(s)) => {
            store::Keys::audit_of(con.layout(), &meta.namespace, &meta.name, &s.replay_id)
        }
        (None, None) => {
            return Err(Error::Config(format!(
                "replay {}/{} has never run",
                meta.namespace, meta.name
            )))
        }
    };
    let mut con = con;
    let rows = store::read_audit(&mut con, &key).await?;
    let status = match &state {
        // The state is that of the key's replay only if the ids agree.
        Some(s) if key.ends_with(&format!("/{}", s.replay_id)) => status_of(s, &key)?,
        _ => ReplayStatus {
            replay_id: key.rsplit('/').next().map(str::to_string),
            counts: counts_of(&rows),
            audit: Some(AuditRef {
                key: key.clone(),
                records: rows.len() as u64,
                ..AuditRef::default()
            }),
            message: Some(
                "no stored state for this audit key (expired, or another run of the replay): only the audit rows are shown".into(),
            ),
            ..ReplayStatus::default()
        },
    };
    if rows.is_empty() && state.is_none() {
        return Err(Error::Config(format!(
            "no audit rows under {key:?} and no stored state: nothing to report"
        )));
    }
    meta.audit_key = key;
    Ok((meta, status, rows))
}
