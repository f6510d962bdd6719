//! Real dead letters on a real broker, for the demo, the tests and the benchmark.
//!
//! A work exchange routes `job` to a work queue whose dead-letter exchange feeds the DLQ; a
//! consumer that rejects (without requeue) turns published jobs into dead letters with the
//! broker's own `x-death` headers.
//!
//! The work queue, the DLQ (and, for quorum queues, the quarantine queue) are classic or quorum
//! queues ([`QueueType`]), like users' queues on RabbitMQ 3.x and 4.x.

use std::fmt;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, BasicRejectOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, ExchangeKind};

use dlq_replay_engine::Error;

/// The routing key jobs are published with.
pub const ROUTING_KEY: &str = "job";

/// The type of a queue: `x-queue-type` at its declaration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum QueueType {
    /// A classic queue (what RabbitMQ declares when `x-queue-type` is absent).
    #[default]
    Classic,
    /// A quorum queue: durable, never exclusive or auto-delete; refuses global QoS; counts every
    /// delivery handed back toward its delivery limit (RabbitMQ 4 sets 20 by default).
    Quorum,
}

impl QueueType {
    /// The value of the `x-queue-type` argument: `classic` or `quorum`.
    pub fn as_arg(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        }
    }
}

impl fmt::Display for QueueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_arg())
    }
}

impl std::str::FromStr for QueueType {
    type Err = String;

    /// `classic` or `quorum`, as [`QueueType::as_arg`] writes them.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "classic" => Ok(QueueType::Classic),
            "quorum" => Ok(QueueType::Quorum),
            other => Err(format!("queue type {other:?}: expected classic or quorum")),
        }
    }
}

/// Names of a work topology and its dead-letter queue.
#[derive(Debug, Clone)]
pub struct Topology {
    /// The direct exchange jobs are published to.
    pub exchange: String,
    /// The work queue, bound with [`ROUTING_KEY`].
    pub work: String,
    /// The dead-letter exchange (fanout).
    pub dlx: String,
    /// The dead-letter queue.
    pub dlq: String,
    /// The quarantine queue.
    pub quarantine: String,
    /// The type of the work queue and the DLQ (and of the quarantine queue when it is quorum:
    /// see [`Topology::declare`]).
    pub queue_type: QueueType,
    /// `x-delivery-limit` of those queues when they are quorum queues; `None` leaves the
    /// broker's default (none on 3.x, 20 on 4.x). Ignored for classic queues.
    pub delivery_limit: Option<u32>,
}

impl Topology {
    /// Names under one prefix, e.g. `demo` → `demo.jobs`, `demo.work`, `demo.dlq`..., with
    /// classic queues.
    pub fn named(prefix: &str) -> Self {
        Self {
            exchange: format!("{prefix}.jobs"),
            work: format!("{prefix}.work"),
            dlx: format!("{prefix}.dlx"),
            dlq: format!("{prefix}.dlq"),
            quarantine: format!("{prefix}.quarantine"),
            queue_type: QueueType::Classic,
            delivery_limit: None,
        }
    }

    /// The same names with queues of type `queue_type`, e.g.
    /// `Topology::named(p).of_type(QueueType::Quorum).delivery_limit(Some(3))`.
    pub fn of_type(self, queue_type: QueueType) -> Self {
        Self { queue_type, ..self }
    }

    /// `x-delivery-limit` for quorum queues (`None`: the broker's default).
    pub fn delivery_limit(self, delivery_limit: Option<u32>) -> Self {
        Self {
            delivery_limit,
            ..self
        }
    }

    /// The arguments every queue of this topology is declared with: for a quorum queue
    /// `x-queue-type: quorum` and `x-delivery-limit` when set. A classic queue is declared
    /// without `x-queue-type`, as before, so that a later declaration without arguments (the
    /// engine's, a user's tool's) stays equivalent; the broker's default type is classic.
    pub fn queue_args(&self) -> FieldTable {
        let mut args = FieldTable::default();
        if self.queue_type == QueueType::Quorum {
            args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString(self.queue_type.as_arg().into()),
            );
            if let Some(limit) = self.delivery_limit {
                args.insert(
                    "x-delivery-limit".into(),
                    AMQPValue::LongInt(i32::try_from(limit).unwrap_or(i32::MAX)),
                );
            }
        }
        args
    }

    /// Declare the quarantine queue (durable, with [`Topology::queue_args`]), so that the engine,
    /// which declares a missing quarantine queue as a classic one, finds it of this topology's
    /// type.
    pub async fn declare_quarantine(&self, ch: &Channel) -> Result<(), Error> {
        ch.queue_declare(
            self.quarantine.as_str().into(),
            QueueDeclareOptions::durable(),
            self.queue_args(),
        )
        .await?;
        Ok(())
    }

    /// Declare everything (durable), from scratch. Quorum queues are durable, never exclusive
    /// or auto-delete, as the broker requires. A quorum topology also declares its quarantine
    /// queue ([`Topology::declare_quarantine`]); a classic one leaves it to the engine, as
    /// before.
    pub async fn declare(&self, ch: &Channel) -> Result<(), Error> {
        self.delete(ch).await?;
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        };
        ch.exchange_declare(
            self.exchange.as_str().into(),
            ExchangeKind::Direct,
            durable,
            FieldTable::default(),
        )
        .await?;
        ch.exchange_declare(
            self.dlx.as_str().into(),
            ExchangeKind::Fanout,
            durable,
            FieldTable::default(),
        )
        .await?;
        let mut args = self.queue_args();
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(self.dlx.as_str().into()),
        );
        ch.queue_declare(
            self.work.as_str().into(),
            QueueDeclareOptions::durable(),
            args,
        )
        .await?;
        ch.queue_declare(
            self.dlq.as_str().into(),
            QueueDeclareOptions::durable(),
            self.queue_args(),
        )
        .await?;
        if self.queue_type == QueueType::Quorum {
            self.declare_quarantine(ch).await?;
        }
        let bind = |q: &str, x: &str, k: &str| {
            ch.queue_bind(
                q.into(),
                x.into(),
                k.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
        };
        bind(&self.work, &self.exchange, ROUTING_KEY).await?;
        bind(&self.dlq, &self.dlx, "").await?;
        Ok(())
    }

    /// Delete every queue and exchange of the topology (missing ones are fine).
    pub async fn delete(&self, ch: &Channel) -> Result<(), Error> {
        for q in [&self.work, &self.dlq, &self.quarantine] {
            ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                .await?;
        }
        for x in [&self.exchange, &self.dlx] {
            ch.exchange_delete(x.as_str().into(), ExchangeDeleteOptions::default())
                .await?;
        }
        Ok(())
    }
}

/// Publish `jobs` to the work exchange and reject each from the work queue, so they land in the
/// DLQ with real `x-death` headers, in order. Returns when the DLQ holds them all.
pub async fn dead_letter(
    ch: &Channel,
    topo: &Topology,
    jobs: Vec<(BasicProperties, Vec<u8>)>,
) -> Result<(), Error> {
    let n = jobs.len();
    let before = depth(ch, &topo.dlq).await?;
    let pub_ch = ch.clone();
    pub_ch
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    for chunk in jobs.chunks(1000) {
        for (props, body) in chunk {
            pub_ch
                .basic_publish(
                    topo.exchange.as_str().into(),
                    ROUTING_KEY.into(),
                    BasicPublishOptions::default(),
                    body,
                    props.clone(),
                )
                .await?;
        }
        pub_ch.wait_for_confirms().await?;
    }
    let rejecter = ch.clone();
    // Per consumer (`global: false`, the default): quorum queues refuse a global prefetch.
    rejecter
        .basic_qos(500, BasicQosOptions { global: false })
        .await?;
    let mut consumer = rejecter
        .basic_consume(
            topo.work.as_str().into(),
            "fixture-rejecter".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut rejected = 0;
    while rejected < n {
        let next = tokio::time::timeout(Duration::from_secs(30), consumer.next()).await;
        let Ok(Some(d)) = next else {
            return Err(Error::Broker(format!(
                "fixture: only {rejected} of {n} jobs reached the work queue"
            )));
        };
        d?.reject(BasicRejectOptions { requeue: false }).await?;
        rejected += 1;
    }
    rejecter
        .basic_cancel("fixture-rejecter".into(), Default::default())
        .await?;
    for _ in 0..600 {
        if depth(ch, &topo.dlq).await? >= before + n as u32 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(Error::Broker(
        "fixture: dead letters did not all reach the DLQ".into(),
    ))
}

/// Ready messages in a queue (0 when it does not exist).
pub async fn depth(ch: &Channel, queue: &str) -> Result<u32, Error> {
    let conn_ch = ch.clone();
    let q = conn_ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok(q.message_count())
}

/// A JSON job with a message id and an exception-type header, as a worker would have failed it.
pub fn job(id: &str, body: serde_json::Value, exception: &str) -> (BasicProperties, Vec<u8>) {
    let mut headers = FieldTable::default();
    headers.insert(
        "x-exception-type".into(),
        AMQPValue::LongString(exception.into()),
    );
    let props = BasicProperties::default()
        .with_message_id(id.into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_headers(headers);
    (props, body.to_string().into_bytes())
}
