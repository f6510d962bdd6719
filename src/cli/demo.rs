//! `dlq-replay demo`: real dead letters on the local broker, a fixed worker, a real replay.
//!
//! The mix shows every decision: good jobs (replayed), jobs whose key the worker already marked
//! done (duplicates), malformed jobs (quarantined) and jobs of another show (skipped by the
//! selector, left in the DLQ).

use std::process::ExitCode;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions};
use lapin::types::FieldTable;
use serde_json::json;

use super::DemoArgs;
use crate::cli;
use crate::engine::{key, store, Options};
use crate::fixture::{self, Topology};
use crate::{manifest, Error};

/// Build the demo's dead letters, run the replay of `args.file`, print its status.
pub async fn run(args: DemoArgs) -> Result<ExitCode, Error> {
    let mut resource = manifest::load(&args.file)?;
    let replay = cli::resolve(&resource, &args.endpoints)?;
    let topo = Topology::named("demo");
    if replay.spec.source.queue != topo.dlq {
        return Err(Error::Config(format!(
            "the demo builds {}; the manifest replays {}",
            topo.dlq, replay.spec.source.queue
        )));
    }
    let conn = fixture::connect(&replay.amqp_url, "dlq-replay demo").await?;
    let ch = conn.create_channel().await.map_err(fixture::broker)?;
    topo.declare(&ch).await?;
    let mut redis = store::connect(&replay.redis_url).await?;
    forget(
        &mut redis,
        &format!("dlq:*:{}/{}*", replay.namespace, replay.name),
    )
    .await?;

    let idem = replay
        .spec
        .idempotency
        .clone()
        .ok_or_else(|| Error::Config("the demo manifest needs spec.idempotency".into()))?;
    forget(&mut redis, &format!("{}*", idem.key.prefix)).await?;
    let mut jobs = Vec::new();
    let mut done_keys = Vec::new();
    for i in 0..60 {
        let body = json!({"asset_id": format!("ep{i:03}"), "stage": "rss_publish", "show": "daily", "chapters": "[]"});
        if i % 6 == 5 {
            // The worker finished these before the ack was lost: replaying them would post twice.
            done_keys
                .push(key::derive(&idem.key, &body).map_err(|e| Error::Config(e.to_string()))?);
        }
        jobs.push(fixture::job(&format!("job-{i:03}"), body, "TimeoutError"));
    }
    for i in 0..4 {
        jobs.push(fixture::job(
            &format!("bad-{i}"),
            json!({"stage": "rss_publish", "show": "daily"}),
            "KeyError",
        ));
    }
    jobs.push(fixture::job(
        "bad-chapters",
        json!({"asset_id": "ep900", "stage": "x", "show": "daily", "chapters": "[1,"}),
        "JSONDecodeError",
    ));
    for i in 0..5 {
        jobs.push(fixture::job(
            &format!("weekly-{i}"),
            json!({"asset_id": format!("wk{i}"), "stage": "rss_publish", "show": "weekly"}),
            "TimeoutError",
        ));
    }
    let total = jobs.len();
    fixture::dead_letter(&ch, &topo, jobs).await?;
    for k in &done_keys {
        redis::cmd("SET")
            .arg(k)
            .arg(&idem.done_value)
            .arg("EX")
            .arg(3600)
            .query_async::<()>(&mut redis)
            .await?;
    }
    eprintln!(
        "demo: {total} dead letters in {} ({} already done, 5 malformed, 5 of another show); a fixed worker now consumes {}",
        topo.dlq,
        done_keys.len(),
        topo.work
    );
    let worker = tokio::spawn(fixed_worker(
        conn.create_channel().await.map_err(fixture::broker)?,
        topo.work.clone(),
        redis.clone(),
        idem.done_value.clone(),
    ));
    let status = cli::run_with_progress(
        &replay,
        &Options {
            pending_timeout: Some(Duration::from_secs(60)),
            ..Options::default()
        },
        true,
    )
    .await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    worker.abort();
    resource.status = Some(status.clone().into());
    print!(
        "{}",
        serde_yaml::to_string(&cli::masked(&resource)).map_err(|e| Error::Io(e.to_string()))?
    );
    let left = fixture::depth(&ch, &topo.dlq).await?;
    let quarantined = fixture::depth(&ch, &topo.quarantine).await?;
    eprintln!(
        "demo: {} still holds {left} (skipped), {} holds {quarantined}",
        topo.dlq, topo.quarantine
    );
    if let Some(a) = &status.audit {
        eprintln!(
            "demo: audit trail: dlq-replay audit -f {} ({} rows in {})",
            args.file, a.records, a.key
        );
    }
    let _ = conn.close(200, "demo done".into()).await;
    Ok(cli::exit_for(&status))
}

/// A worker with the bug fixed: it processes each job and marks its key done.
async fn fixed_worker(
    ch: lapin::Channel,
    queue: String,
    mut redis: crate::engine::store::Redis,
    done: String,
) {
    let Ok(mut consumer) = ch
        .basic_consume(
            queue.as_str().into(),
            "demo-worker".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
    else {
        return;
    };
    while let Some(Ok(d)) = consumer.next().await {
        // The worker's own client (lapin) hands amq-protocol's properties: read as the engine
        // reads them.
        let key = crate::engine::message::header_text(
            &(&d.properties).into(),
            crate::engine::message::IDEMPOTENCY_KEY,
        );
        if let Some(k) = key {
            let _ = redis::cmd("SET")
                .arg(k)
                .arg(&done)
                .arg("EX")
                .arg(3600)
                .query_async::<()>(&mut redis)
                .await;
        }
        let _ = d.ack(BasicAckOptions::default()).await;
    }
}

/// Drop the demo's keys (replay state, audit, idempotency) so it can run again from scratch.
async fn forget(redis: &mut crate::engine::store::Redis, pattern: &str) -> Result<(), Error> {
    let keys: Vec<String> = redis::cmd("KEYS").arg(pattern).query_async(redis).await?;
    if !keys.is_empty() {
        redis::cmd("DEL")
            .arg(&keys)
            .query_async::<()>(redis)
            .await?;
    }
    Ok(())
}
