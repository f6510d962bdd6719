//! How long a replay's keys live (`spec.audit.retentionSeconds`), and reopening a replay whose
//! canary failed.

use std::time::Duration;

use super::{connect, Keys, Redis};
use crate::Error;

/// Set the expiry of a replay's keys (its state hash, settled hash, audit stream and its
/// dictionary) to
/// `seconds` from now: `spec.audit.retentionSeconds`. Returns whether the replay has a state
/// (`false`: it never began, nothing to expire yet).
pub async fn retain(
    con: &mut Redis,
    namespace: &str,
    name: &str,
    seconds: u64,
) -> Result<bool, Error> {
    let state = Keys::state_of(con.layout(), namespace, name);
    let id: Option<String> = redis::cmd("HGET")
        .arg(&state)
        .arg("id")
        .query_async(con)
        .await?;
    let Some(id) = id else {
        return Ok(false);
    };
    let keys = Keys::new(con.layout(), namespace, name, &id);
    let mut p = redis::pipe();
    for key in keys.all() {
        p.cmd("EXPIRE").arg(key).arg(seconds).ignore();
    }
    p.query_async::<()>(con).await?;
    Ok(true)
}

/// How often [`retain_while`] sets the expiry again: a quarter of the retention, at most every
/// ten minutes.
fn keep_every(seconds: u64) -> Duration {
    Duration::from_secs((seconds / 4).clamp(1, 600))
}

/// Keep a replay's Redis keys for its `spec.audit.retentionSeconds` ([`retain`]) while it runs
/// and after it ends, on a task of its own: once `progress` shows a replay id (the engine has
/// begun), then every [`keep_every`] however long the replay runs or waits (a canary wait, a
/// pending pre-flight, a Redis outage), and a last time when `progress` closes (the engine
/// returned), so the keys expire that long after the replay's end. Failures are logged and
/// tried again at the next turn. `None` for a dry run, which writes nothing.
pub fn retention(
    replay: &crate::Replay,
    progress: tokio::sync::watch::Receiver<crate::status::ReplayStatus>,
) -> Option<tokio::task::JoinHandle<()>> {
    if replay.spec.dry_run {
        return None;
    }
    let url = replay.redis_url.clone();
    let (namespace, name) = (replay.namespace.clone(), replay.state_name());
    let seconds = replay.spec.retention_seconds();
    Some(tokio::spawn(async move {
        match connect(&url).await {
            Ok(con) => retain_while(progress, con, &namespace, &name, seconds).await,
            Err(e) => {
                tracing::warn!(error = %e, replay = %format!("{namespace}/{name}"), "no Redis for the expiry of the replay's keys")
            }
        }
    }))
}

async fn retain_while(
    mut progress: tokio::sync::watch::Receiver<crate::status::ReplayStatus>,
    mut con: Redis,
    namespace: &str,
    name: &str,
    seconds: u64,
) {
    let every = keep_every(seconds);
    let mut last: Option<tokio::time::Instant> = None;
    let mut ended = false;
    loop {
        let begun = progress.borrow_and_update().replay_id.is_some();
        if ended || (begun && last.is_none_or(|t| t.elapsed() >= every)) {
            last = Some(tokio::time::Instant::now());
            if let Err(e) = retain(&mut con, namespace, name, seconds).await {
                tracing::warn!(error = %e, replay = %format!("{namespace}/{name}"), "setting the expiry of the replay's Redis keys");
            }
        }
        if ended {
            return;
        }
        tokio::select! {
            changed = progress.changed() => ended = changed.is_err(),
            _ = tokio::time::sleep(every) => {}
        }
    }
}

/// Removes a stored `CanaryFailed` final status with the canary decisions (see [`reopen`]);
/// returns the stored final status's phase, `''` for none.
const REOPEN: &str = r#"
local final = redis.call('HGET', KEYS[1], 'final')
if not final then return '' end
local ok, status = pcall(cjson.decode, final)
local phase = ok and type(status) == 'table' and status['phase'] or '?'
if phase == 'CanaryFailed' then
  redis.call('HDEL', KEYS[1], 'final', 'canary')
end
return phase
"#;

/// Open a finished replay for a retry in place (same replay id): a stored `CanaryFailed` final
/// status is removed with the canary decisions, so the next run sends new canaries and drains
/// as a rerun would. Returns the phase of the stored final status that was there (`None`: none,
/// as after `Failed`, which a rerun resumes anyway); any other (`Done`) is left as it is.
pub async fn reopen(con: &mut Redis, namespace: &str, name: &str) -> Result<Option<String>, Error> {
    let phase: String = redis::Script::new(REOPEN)
        .key(Keys::state_of(con.layout(), namespace, name))
        .invoke_async(con)
        .await?;
    Ok((!phase.is_empty()).then_some(phase))
}

#[cfg(test)]
mod tests {
    //! Against the real Redis (REDIS_URL, else the local one), under keys of their own.
    use super::*;
    use crate::status::Counts;
    use crate::store::testing::*;
    use std::collections::HashMap;

    #[tokio::test]
    async fn retain_expires_every_key_of_a_replay_that_began() {
        let mut s = store("retain").await;
        let mut con = s.redis();
        let ns = s.keys().state.trim_start_matches("dlq:replay:").to_string();
        let (ns, name) = ns.split_once('/').unwrap();
        s.commit(
            &[row("a")],
            &[("fp".into(), "replayed".into())],
            &[],
            &Counts::default(),
        )
        .await
        .unwrap();
        assert!(retain(&mut con, ns, name, 3600).await.unwrap());
        let k = s.keys().clone();
        for key in k.all() {
            let ttl: i64 = redis::cmd("TTL")
                .arg(key)
                .query_async(&mut con)
                .await
                .unwrap();
            assert!((3590..=3600).contains(&ttl), "{key}: {ttl}");
        }
        assert!(!retain(&mut con, ns, "never-ran", 3600).await.unwrap());
        cleanup(&mut s, &[]).await;
    }

    #[tokio::test]
    async fn reopen_clears_a_canary_failed_end_only() {
        let mut s = store("reopen").await;
        let mut con = s.redis();
        let state = s.keys().state.clone();
        let (ns, name) = state
            .trim_start_matches("dlq:replay:")
            .split_once('/')
            .unwrap();
        assert_eq!(reopen(&mut con, ns, name).await.unwrap(), None);
        s.save_canary("[]").await.unwrap();
        s.finish(r#"{"phase":"Done"}"#, true).await.unwrap();
        assert_eq!(
            reopen(&mut con, ns, name).await.unwrap().as_deref(),
            Some("Done")
        );
        s.finish(r#"{"phase":"CanaryFailed"}"#, false)
            .await
            .unwrap();
        assert_eq!(
            reopen(&mut con, ns, name).await.unwrap().as_deref(),
            Some("CanaryFailed")
        );
        let left: HashMap<String, String> = redis::cmd("HGETALL")
            .arg(&state)
            .query_async(&mut con)
            .await
            .unwrap();
        assert!(
            !left.contains_key("final") && !left.contains_key("canary"),
            "{left:?}"
        );
        assert!(left.contains_key("id"), "the replay id stays: {left:?}");
        cleanup(&mut s, &[]).await;
    }
}
