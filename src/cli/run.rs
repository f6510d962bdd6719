//! `dlq-replay run`: a replay to its end (with `--approve`, bound to the plan it names), its
//! progress bar, and the resource printed with its final status.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use tokio_util::sync::CancellationToken;

use super::{resolve, Output, RunArgs};
use crate::api::{DlqReplay, Phase, ReplayStatus};
use crate::engine::{self, store, Options, Replay};
use crate::{manifest, Error};

pub(super) async fn run(args: RunArgs) -> Result<ExitCode, Error> {
    let mut resource = manifest::load(&args.file)?;
    let mut replay = resolve(&resource, &args.endpoints)?;
    if replay.spec.require_approval && !replay.spec.dry_run {
        match approved(&replay, args.approve.as_deref()).await? {
            Ok(expect) => replay.spec.expect = Some(expect),
            Err(why) => {
                eprintln!("error: {why}");
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    let opts = Options {
        window: args.window.max(1),
        pending_timeout: Some(Duration::from_secs(args.pending_timeout)),
        reconnect: Duration::from_secs(args.reconnect_timeout),
        ..Options::default()
    };
    if args.retry && !replay.spec.dry_run {
        let mut con = store::connect(&replay.redis_url).await?;
        let (ns, name) = (&replay.namespace, replay.state_name());
        match store::reopen(&mut con, ns, &name).await?.as_deref() {
            Some("CanaryFailed") => eprintln!(
                "--retry: {ns}/{name} ended CanaryFailed; retrying it in place, new canaries first"
            ),
            Some(phase) => eprintln!(
                "--retry: {ns}/{name} ended {phase} and is not reopened; what it left in the queue needs a new replay (another name)"
            ),
            None => {}
        }
    }
    // With the audit rows on stderr (spec.audit.sink: Log) they are the progress: a bar redrawn
    // on the same stream would cut into them.
    let bar = !args.no_progress && replay.spec.audit_sink() != crate::api::AuditSink::Log;
    let status = run_with_progress(&replay, &opts, bar).await?;
    resource.status = Some(status.clone().into());
    print_resource(&resource, args.output)?;
    Ok(exit_for(&status))
}

/// `spec.requireApproval` out of the cluster: the replay plans, and runs only when `--approve`
/// names the plan's digest, bound to that plan as `spec.expect` would bind it (what an earlier
/// run of it did counts on top: the plan sees only what is left). `Err`: why it does not run.
async fn approved(
    replay: &Replay,
    asked: Option<&str>,
) -> Result<Result<crate::api::ExpectSpec, String>, Error> {
    let report = crate::engine::plan::plan(replay).await?;
    let summary = format!(
        "plan {} {} of {} messages",
        report.digest,
        report.counts.would(),
        report.depth
    );
    match asked {
        None => return Ok(Err(format!(
            "spec.requireApproval: nothing moved; {summary}; `dlq-replay plan -f FILE` shows it, `--approve {}` runs it",
            report.digest
        ))),
        Some(d) if d != report.digest => return Ok(Err(format!(
            "--approve {d} is not the current plan (the dead-letter queue or its decisions changed); nothing moved; {summary}"
        ))),
        Some(_) => {}
    }
    let mut expect = crate::engine::plan::approved(&report.counts, &report.by_signature);
    let con = store::connect(&replay.redis_url).await?;
    if let Some(state) = store::Store::peek(con, &replay.namespace, &replay.state_name()).await? {
        let add = |max: Option<u64>, done: u64| max.map(|m| m + done);
        expect.max_replayed = add(expect.max_replayed, state.counts.replayed);
        expect.max_quarantined = add(expect.max_quarantined, state.counts.quarantined);
    }
    eprintln!("approved: {summary}");
    Ok(Ok(crate::engine::plan::bound(
        replay.spec.expect.as_ref(),
        expect,
    )))
}

/// Run the engine with a progress bar on a terminal, stopping cleanly on Ctrl-C.
pub async fn run_with_progress(
    replay: &Replay,
    opts: &Options,
    bar: bool,
) -> Result<ReplayStatus, Error> {
    let (tx, mut rx) = tokio::sync::watch::channel(ReplayStatus::default());
    let cancel = CancellationToken::new();
    let on_signal = cancel.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("interrupted: settling the messages in flight, then stopping");
            on_signal.cancel();
        }
    });
    let pb = if bar && std::io::stderr().is_terminal() {
        ProgressBar::new(0)
    } else {
        ProgressBar::hidden()
    };
    pb.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {per_sec} {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb.enable_steady_tick(Duration::from_millis(200));
    let watcher = pb.clone();
    let draw = tokio::spawn(async move {
        while rx.changed().await.is_ok() {
            let s = rx.borrow_and_update().clone();
            draw_status(&watcher, &s);
        }
    });
    // spec.audit.retentionSeconds: the keys' expiry is kept while it runs and set at its end.
    let retention = store::retention(replay, tx.subscribe());
    let result = engine::run(replay, opts, &tx, &cancel).await;
    drop(tx);
    let _ = draw.await;
    if let Some(expiry) = retention {
        let _ = tokio::time::timeout(Duration::from_secs(10), expiry).await;
    }
    pb.finish_and_clear();
    result
}

fn draw_status(pb: &ProgressBar, s: &ReplayStatus) {
    let c = s.counts;
    pb.set_length(s.source_depth_at_start.unwrap_or(0));
    pb.set_position(c.scanned);
    if s.phase == Some(Phase::Canary) || s.phase == Some(Phase::Pending) {
        pb.set_message(s.message.clone().unwrap_or_default());
        return;
    }
    pb.set_message(format!(
        "{} | replayed {} dup {} quar {} skip {} fail {}",
        s.phase.map(|p| p.to_string()).unwrap_or_default(),
        c.replayed,
        c.duplicates,
        c.quarantined,
        c.skipped,
        c.failed
    ));
}

/// The resource as it may be printed: inline URLs keep their user, host and vhost, not their
/// password.
pub fn masked(resource: &DlqReplay) -> DlqReplay {
    let mut r = resource.clone();
    let spec = &mut r.spec.0;
    let connections = [
        Some(&mut spec.broker),
        spec.idempotency.as_mut().and_then(|i| i.redis.as_mut()),
        spec.audit.as_mut().and_then(|a| a.redis.as_mut()),
    ];
    for c in connections.into_iter().flatten() {
        if let Some(u) = c.url.as_mut() {
            *u = crate::redact::url(u);
        }
    }
    r
}

fn print_resource(resource: &DlqReplay, output: Output) -> Result<(), Error> {
    let resource = &masked(resource);
    let text = match output {
        Output::Yaml => serde_yaml::to_string(resource).map_err(|e| Error::Io(e.to_string()))?,
        Output::Json => {
            serde_json::to_string_pretty(resource).map_err(|e| Error::Io(e.to_string()))? + "\n"
        }
    };
    print!("{text}");
    Ok(())
}

/// 0 for `Done`, 1 otherwise, with the reason on stderr.
pub fn exit_for(status: &ReplayStatus) -> ExitCode {
    if status.phase == Some(Phase::Done) {
        return ExitCode::SUCCESS;
    }
    eprintln!(
        "replay ended {}: {}",
        status
            .phase
            .map(|p| p.to_string())
            .unwrap_or_else(|| "without a phase".into()),
        status.message.as_deref().unwrap_or("no reason recorded")
    );
    ExitCode::from(1)
}
