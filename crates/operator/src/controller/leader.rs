//! Leading: only the holder of the Lease drives replays; shutdown signals.

use std::time::Duration;

use kube::Client;
use tokio_util::sync::CancellationToken;

use super::{lease, run_until, Settings, LEASE};

/// The `/healthz` names of the controller and of the lease loop.
pub(super) const CONTROLLER_PART: &str = "controller";
pub(super) const LEASE_PART: &str = "lease";

/// Lead, then drive replays while leading, until `shutdown` is cancelled: only the holder of the
/// [`LEASE`] runs replays, so two replicas never replay the same queue (see [`lease`]).
///
/// - Losing the Lease (another replica holds it, or it could not be renewed within the renew
///   deadline) stops every task after its in-flight messages settle, then follows again.
/// - `shutdown` stops the controller and every task the same way (status `OperatorStopped`),
///   keeps renewing meanwhile, then releases the Lease so that another replica takes over at its
///   next ask (2 s), and returns `Ok`. A follower returns at once.
/// - The controller dying (a panic) stops the tasks, releases the Lease and returns `Err`;
///   `/healthz` says so meanwhile, and so it does when the lease loop stalls.
pub async fn run_with_leader_election(
    client: Client,
    settings: Settings,
    lease_ns: &str,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    shutdown: CancellationToken,
) -> Result<(), String> {
    let cfg = lease::LeaseConfig::new(LEASE, lease_ns, &settings.instance);
    let (retry, stale) = (cfg.retry, cfg.duration * 2);
    let mut elector = lease::Elector::new(client.clone(), cfg);
    loop {
        metrics.leader.set(0);
        loop {
            metrics.alive(LEASE_PART, Some(stale));
            match elector.try_acquire_or_renew().await {
                Ok(true) => break,
                Ok(false) => metrics.set_ready(true),
                Err(e) => tracing::warn!(error = %e, "asking for the lease"),
            }
            tokio::select! {
                _ = tokio::time::sleep(jittered(retry)) => {}
                _ = shutdown.cancelled() => {
                    metrics.stopped(LEASE_PART);
                    tracing::info!("shutdown: not leading, nothing to settle");
                    return Ok(());
                }
            }
        }
        metrics.set_ready(true);
        metrics.leader.set(1);
        tracing::info!(instance = %settings.instance, "leading: driving replays");
        // Cancelled by a shutdown, or by this loop when the Lease is lost.
        let stop = shutdown.child_token();
        let mut controller = tokio::spawn(run_until(
            client.clone(),
            settings.clone(),
            stop.clone().cancelled_owned(),
        ));
        // Renew while the controller runs and while its replays settle after a stop: the Lease
        // stays ours until they did.
        let ended = loop {
            tokio::select! {
                ended = &mut controller => break ended,
                _ = tokio::time::sleep(retry) => {}
            }
            metrics.alive(LEASE_PART, Some(stale));
            if stop.is_cancelled() && !shutdown.is_cancelled() {
                continue; // stepping down: no more renewals
            }
            match elector.try_acquire_or_renew().await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!("another replica holds the lease: stopping the replays");
                    stop.cancel();
                }
                Err(e) if elector.renewal_overdue() => {
                    tracing::warn!(error = %e, "could not renew the lease within the renew deadline: stopping the replays");
                    stop.cancel();
                }
                Err(e) => tracing::warn!(error = %e, "renewing the lease; trying again"),
            }
        };
        metrics.leader.set(0);
        let died = match ended {
            Ok(Ok(())) => None,
            Ok(Err(why)) => Some(why),
            Err(e) => Some(format!("the controller task failed: {e}")),
        };
        if died.is_none() && !shutdown.is_cancelled() {
            tracing::warn!("lost the lease: replays stopped, waiting to lead again");
            continue;
        }
        match elector.release().await {
            Ok(true) => tracing::info!("released the lease"),
            Ok(false) => tracing::info!("the lease was no longer ours"),
            Err(e) => tracing::warn!(error = %e, "releasing the lease; it expires by itself"),
        }
        metrics.stopped(LEASE_PART);
        return match died {
            Some(why) => Err(why),
            None => Ok(()),
        };
    }
}

/// `d` ± 10 %, so that replicas do not ask in step.
pub(super) fn jittered(d: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |t| t.subsec_nanos());
    d.mul_f64(0.9 + f64::from(nanos % 1000) / 5000.0)
}

/// SIGTERM or SIGINT (Ctrl-C): the name of the one that came.
pub async fn signalled() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            return tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
        }
    }
    let _ = tokio::signal::ctrl_c().await;
    "SIGINT"
}
