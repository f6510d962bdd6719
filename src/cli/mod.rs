//! The `dlq-replay` command line: `run`, `plan`, `audit`, `report`, `demo`, `crd`.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use tokio_util::sync::CancellationToken;

use crate::api::DlqReplay;
use crate::engine::{Options, Replay};
use crate::{manifest, Error};

pub(crate) mod audit;
mod demo;
mod plan;
mod run;

pub use audit::write_audit;
pub use run::{exit_for, masked, run_with_progress};

/// Replay dead-lettered RabbitMQ messages safely: poison to quarantine, duplicates dropped,
/// the rest republished under a rate limit, every decision audited.
#[derive(Parser, Debug)]
#[command(name = "dlq-replay", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run a replay to its end and print the resource with its final status.
    Run(RunArgs),
    /// Dry run: classify every message and print the counts; change nothing.
    Plan(PlanArgs),
    /// Export the audit trail of a replay.
    Audit(AuditArgs),
    /// Write a replay's incident report (HTML or Markdown) from its audit trail and status.
    Report(ReportArgs),
    /// Build real dead letters on the local broker and replay them end to end.
    Demo(DemoArgs),
    /// Print the CustomResourceDefinition.
    Crd,
    /// Run the Kubernetes operator (in-cluster, or from the kubeconfig).
    Operator(OperatorArgs),
}

/// `operator` arguments.
#[derive(Args, Debug)]
pub struct OperatorArgs {
    /// Watch only this namespace (default: all).
    #[arg(long, env = "WATCH_NAMESPACE")]
    pub namespace: Option<String>,
    /// The most replays this operator drives at once.
    #[arg(long, default_value_t = 4)]
    pub max_concurrent_replays: usize,
    /// Seconds between two status writes of a draining replay.
    #[arg(long, default_value_t = 2)]
    pub status_interval: u64,
    /// This instance's name, for events and the leader Lease (the pod name).
    #[arg(long, env = "POD_NAME", default_value = "dlq-replay")]
    pub instance: String,
    /// Where /metrics, /healthz and /readyz are served.
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub http_addr: std::net::SocketAddr,
    /// The namespace of the leader-election Lease (the operator's own).
    #[arg(long, env = "POD_NAMESPACE", default_value = "dlq-replay")]
    pub lease_namespace: String,
    /// Drive replays without leader election (one replica only).
    #[arg(long)]
    pub no_leader_election: bool,
    /// Seconds a replay that lost its broker or Redis connection keeps reconnecting (with
    /// backoff) before it ends Failed.
    #[arg(long, default_value_t = 300)]
    pub reconnect_timeout: u64,
    /// Each replay's in-flight window (as `run --window`): messages claimed or published and not
    /// yet recorded, at most; the most a crash can leave unknown.
    #[arg(long, default_value_t = crate::engine::DEFAULT_WINDOW)]
    pub window: usize,
    /// Seconds a graceful stop (SIGTERM/SIGINT) may take before the process exits anyway (1):
    /// keep it below the pod's terminationGracePeriodSeconds, so that the operator says so
    /// instead of being killed.
    #[arg(long, default_value_t = 45)]
    pub shutdown_timeout: u64,
    /// Log lines as text or as JSON objects (one per line, for a log collector).
    #[arg(long, value_enum, default_value_t, env = "LOG_FORMAT")]
    pub log_format: LogFormat,
}

/// How the operator logs.
#[derive(ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines (coloured only on a terminal).
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

impl Cli {
    /// The tokio runtime the command runs on. The operator drives many replays and serves
    /// metrics and probes: a worker thread per core. Every other command drives one replay (or
    /// one read) and gains nothing from more threads: on one thread, a Redis reply or a
    /// broker confirm wakes the drain without a hop between threads, which costs CPU on every
    /// message (see bench/RESULTS.md for the measured difference).
    pub fn runtime(&self) -> std::io::Result<tokio::runtime::Runtime> {
        let mut builder = match &self.command {
            Command::Operator(_) => tokio::runtime::Builder::new_multi_thread(),
            _ => tokio::runtime::Builder::new_current_thread(),
        };
        builder.enable_all().build()
    }

    /// The default log filter (when `RUST_LOG` is unset) and whether to log JSON: `warn` for
    /// the commands a person runs, `info` for the operator.
    pub fn logging(&self) -> (&'static str, bool) {
        match &self.command {
            Command::Operator(a) => ("info,lapin::channel=off", a.log_format == LogFormat::Json),
            _ => ("warn,lapin::channel=off", false),
        }
    }
}

/// Where the broker and Redis are, when no cluster resolves the Secret references.
#[derive(Args, Debug, Clone, Default)]
pub struct Endpoints {
    /// Broker URL; stands in for spec.broker.urlSecretRef.
    #[arg(long, env = "AMQP_URL", hide_env_values = true)]
    pub amqp_url: Option<String>,
    /// Redis URL; stands in for spec.idempotency.redis / spec.audit.redis.
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    pub redis_url: Option<String>,
}

/// Output formats of the resource.
#[derive(ValueEnum, Clone, Copy, Debug, Default)]
pub enum Output {
    /// YAML.
    #[default]
    Yaml,
    /// JSON.
    Json,
}

/// `run` arguments.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// The DlqReplay manifest (`-` for standard input).
    #[arg(short = 'f', long = "filename")]
    pub file: String,
    #[command(flatten)]
    pub endpoints: Endpoints,
    /// Output format of the final resource.
    #[arg(short = 'o', long, value_enum, default_value_t)]
    pub output: Output,
    /// The in-flight window: messages claimed or published and not yet recorded, at most; the
    /// most a crash (kill -9) can leave unknown. The drain works in steps of half of it; a larger
    /// window drains faster where the broker confirms slowly.
    #[arg(long, default_value_t = crate::engine::DEFAULT_WINDOW)]
    pub window: usize,
    /// Do not draw the progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Give up (exit 1, nothing touched) when the pre-flight checks keep the replay Pending this
    /// many seconds.
    #[arg(long, default_value_t = 600)]
    pub pending_timeout: u64,
    /// Seconds a replay that lost its broker or Redis connection keeps reconnecting (with
    /// backoff) before it ends Failed; 0 ends it at the first loss.
    #[arg(long, default_value_t = 60)]
    pub reconnect_timeout: u64,
    /// Retry a replay that ended CanaryFailed, in place (same replay id): its stored end and
    /// canary decisions are removed, so new canaries go first. A Failed or stopped replay
    /// resumes on any rerun without it; a Done one is not reopened.
    #[arg(long)]
    pub retry: bool,
    /// With `spec.requireApproval`: the digest of the plan you approve (`dlq-replay plan` prints
    /// it). The replay plans again and runs only when the queue still gives that digest, bound
    /// to that plan (its signatures and counts).
    #[arg(long, value_name = "DIGEST")]
    pub approve: Option<String>,
}

/// `plan` arguments.
#[derive(Args, Debug)]
pub struct PlanArgs {
    /// The DlqReplay manifest (`-` for standard input).
    #[arg(short = 'f', long = "filename")]
    pub file: String,
    #[command(flatten)]
    pub endpoints: Endpoints,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Audit export formats.
#[derive(ValueEnum, Clone, Copy, Debug, Default)]
pub enum AuditFormat {
    /// One JSON object per line.
    #[default]
    Jsonl,
    /// Comma-separated, with a header row.
    Csv,
}

/// Which replay's audit trail `audit` and `report` read, and from where: one definition for
/// both commands (a manifest, or an audit key; Redis, or a log).
#[derive(Args, Debug)]
pub struct TrailArgs {
    /// The DlqReplay manifest of the replay.
    #[arg(short = 'f', long = "filename", required_unless_present = "key")]
    pub file: Option<String>,
    /// The audit stream key (status.audit.key) instead of a manifest; with both, the key names
    /// the run and the manifest the replay.
    #[arg(long)]
    pub key: Option<String>,
    /// Read the rows from this log (`-`: standard input) instead of Redis: for a replay with
    /// `spec.audit.sink: Log`, its JSON lines as the log collector kept them.
    #[arg(long, value_name = "FILE")]
    pub log: Option<String>,
    #[command(flatten)]
    pub endpoints: Endpoints,
}

/// `audit` arguments.
#[derive(Args, Debug)]
pub struct AuditArgs {
    #[command(flatten)]
    pub trail: TrailArgs,
    /// Export format.
    #[arg(long, value_enum, default_value_t)]
    pub format: AuditFormat,
}

/// `report` arguments.
#[derive(Args, Debug)]
pub struct ReportArgs {
    #[command(flatten)]
    pub trail: TrailArgs,
    /// Page format.
    #[arg(long, value_enum, default_value_t)]
    pub format: crate::report::Format,
    /// Write to this file instead of standard output.
    #[arg(short = 'o', long)]
    pub output: Option<std::path::PathBuf>,
}

/// `demo` arguments.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// The replay manifest the demo runs.
    #[arg(short = 'f', long = "filename", default_value = "examples/replay.yaml")]
    pub file: String,
    #[command(flatten)]
    pub endpoints: Endpoints,
}

/// Run the command line; the exit code is 0 only when the replay ended `Done`.
pub async fn main(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Command::Run(a) => run::run(a).await,
        Command::Plan(a) => plan::plan(a).await,
        Command::Audit(a) => audit::audit(a).await,
        Command::Report(a) => audit::report(a).await,
        Command::Demo(a) => demo::run(a).await,
        Command::Crd => crd(),
        Command::Operator(a) => operator(a).await,
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

/// Run the operator until SIGTERM or SIGINT: the replays in flight settle and say
/// `OperatorStopped`, the Lease is released, and the process exits 0 (a second signal exits at
/// once, 130). Exits non-zero when the controller died.
async fn operator(args: OperatorArgs) -> Result<ExitCode, Error> {
    let metrics = crate::metrics::Metrics::global();
    let shutdown = CancellationToken::new();
    // First, so that a SIGTERM during start-up is a clean stop too.
    tokio::spawn(on_signals(shutdown.clone(), metrics.clone()));
    let deadline = Duration::from_secs(args.shutdown_timeout);
    let watchdog = shutdown.clone();
    tokio::spawn(async move {
        watchdog.cancelled().await;
        tokio::time::sleep(deadline).await;
        tracing::error!(
            after_s = deadline.as_secs(),
            "the graceful stop did not finish in time (API server or broker not answering?): exiting now; the batches in flight are decided again by the next run"
        );
        std::process::exit(1);
    });
    let client = kube::Client::try_default().await.map_err(|e| {
        Error::Config(format!(
            "no Kubernetes client (in-cluster or kubeconfig): {e}"
        ))
    })?;
    let settings = crate::controller::Settings {
        namespace: args.namespace,
        max_concurrent: args.max_concurrent_replays.max(1),
        status_interval: Duration::from_secs(args.status_interval.max(1)),
        instance: args.instance,
        engine: Options {
            window: args.window.max(1),
            reconnect: Duration::from_secs(args.reconnect_timeout),
            ..Options::default()
        },
        ..crate::controller::Settings::default()
    };
    let listener = tokio::net::TcpListener::bind(args.http_addr)
        .await
        .map_err(|e| Error::Config(format!("--http-addr {}: {e}", args.http_addr)))?;
    let http = tokio::spawn(crate::metrics::serve_on(listener, metrics.clone()));
    let started = std::time::Instant::now();
    let result = if args.no_leader_election {
        metrics.set_ready(true);
        metrics.leader.set(1);
        crate::controller::run_until(client, settings, shutdown.clone().cancelled_owned()).await
    } else {
        crate::controller::run_with_leader_election(
            client,
            settings,
            &args.lease_namespace,
            metrics.clone(),
            shutdown.clone(),
        )
        .await
    };
    metrics.set_ready(false);
    http.abort();
    result.map_err(Error::Config)?;
    tracing::info!(
        up_s = started.elapsed().as_secs(),
        "stopped: replays settled, lease released"
    );
    Ok(ExitCode::SUCCESS)
}

/// The first SIGTERM/SIGINT asks for a graceful stop (not ready from then on); a second one
/// exits at once.
async fn on_signals(shutdown: CancellationToken, metrics: std::sync::Arc<crate::metrics::Metrics>) {
    let first = crate::controller::signalled().await;
    tracing::info!(
        signal = first,
        "graceful shutdown requested: settling the messages in flight, then releasing the lease"
    );
    metrics.set_ready(false);
    shutdown.cancel();
    let second = crate::controller::signalled().await;
    tracing::warn!(
        signal = second,
        "second signal: exiting now; the batches in flight are decided again by the next run"
    );
    std::process::exit(130);
}

fn crd() -> Result<ExitCode, Error> {
    let yaml = serde_yaml::to_string(&crate::api::crd()).map_err(|e| Error::Io(e.to_string()))?;
    print!("{yaml}");
    Ok(ExitCode::SUCCESS)
}

/// Resolve a manifest into a runnable replay: inline URLs, or the command line's stand-ins for
/// the Secret references.
pub fn resolve(resource: &DlqReplay, endpoints: &Endpoints) -> Result<Replay, Error> {
    let spec = &resource.spec;
    let amqp_url = endpoints.amqp_url.clone().or_else(|| spec.broker.url.clone()).ok_or_else(|| {
        Error::Config(match &spec.broker.url_secret_ref {
            Some(s) => format!(
                "spec.broker.urlSecretRef ({}/{}) needs a cluster; without one pass --amqp-url or AMQP_URL",
                s.name, s.key
            ),
            None => "spec.broker: no URL; set spec.broker.url or pass --amqp-url / AMQP_URL".into(),
        })
    })?;
    manifest::check_url(&amqp_url, &crate::api::AMQP_SCHEMES)
        .map_err(|e| Error::Config(format!("broker URL: {e}")))?;
    let inline = spec
        .idempotency
        .as_ref()
        .and_then(|i| i.redis.as_ref())
        .and_then(|r| r.url.clone())
        .or_else(|| {
            spec.audit
                .as_ref()
                .and_then(|a| a.redis.as_ref())
                .and_then(|r| r.url.clone())
        });
    let redis_url = endpoints.redis_url.clone().or(inline).ok_or_else(|| {
        Error::Config(
            "no Redis URL for the audit trail: set spec.idempotency.redis.url or spec.audit.redis.url, or pass --redis-url / REDIS_URL".into(),
        )
    })?;
    manifest::check_url(&redis_url, &crate::api::REDIS_SCHEMES)
        .map_err(|e| Error::Config(format!("Redis URL: {e}")))?;
    Ok(Replay {
        namespace: resource.namespace_or_default(),
        name: resource.name_or_empty(),
        spec: spec.0.clone(),
        amqp_url,
        redis_url,
        uid: None,
    })
}
