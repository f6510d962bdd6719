//! What the broker itself counted during a run, read with rabbitmqctl rather than taken from
//! the replay's status: the node's AMQP 0-9-1 publishes (`messages_received_total` of
//! `rabbit_global_counters`, every client's) and the messages each of the run's classic queues
//! enqueued (`next_seq_id` of its backing queue, which grows by one per message put on the
//! queue: published into it or dead-lettered into it, whether or not a consumer takes it at
//! once; a requeue keeps its number).
//!
//! The node-wide figure counts every client of the node, another engineer's test suite
//! included; the per-queue figures count only this run's queues. A message delivered at once to
//! a consumer that does not ack (the bench's arrival clock on the target) is never enqueued, so
//! the target's count comes from the clock's arrivals instead.

use crate::broker::Broker;

/// The broker's counters at one moment.
#[derive(Debug, Clone, Default)]
pub(crate) struct BrokerCounts {
    /// AMQP 0-9-1 messages the node received from publishers, since it started.
    pub(crate) received: u64,
    /// Messages each queue asked for has enqueued since it was declared (0 when it is missing).
    pub(crate) enqueued: Vec<u64>,
}

/// What the broker counted over one replay, less what the harness itself did meanwhile.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Published {
    /// Publishes received by the node, less the harness's own (the unrelated jobs).
    pub(crate) node: i64,
    /// Published by the harness during the run.
    pub(crate) harness: u64,
    /// Enqueued on the run's DLQ less what was dead-lettered into it (the unrelated jobs, the
    /// replay's messages that came back): what the replay published back into its DLQ.
    pub(crate) into_dlq: i64,
    /// Enqueued on the run's quarantine queue.
    pub(crate) into_quarantine: i64,
}

impl Published {
    /// `after - before`; `harness` publishes and `dead_lettered` messages into the DLQ were the
    /// harness's and the workers' doing, not the replay's.
    pub(crate) fn between(
        before: &BrokerCounts,
        after: &BrokerCounts,
        harness: u64,
        dead_lettered: u64,
    ) -> Self {
        let queue = |i: usize| {
            after.enqueued.get(i).copied().unwrap_or(0) as i64
                - before.enqueued.get(i).copied().unwrap_or(0) as i64
        };
        Published {
            node: after.received as i64 - before.received as i64 - harness as i64,
            harness,
            into_dlq: queue(0) - harness as i64 - dead_lettered as i64,
            into_quarantine: queue(1),
        }
    }
}

impl Broker {
    /// The node's publishes and the messages each of `queues` (classic, in vhost `/`) enqueued;
    /// `None` when rabbitmqctl did not answer as expected.
    pub(crate) async fn counts(&self, queues: &[&str]) -> Option<BrokerCounts> {
        let names: Vec<String> = queues.iter().map(|q| format!("<<\"{q}\">>")).collect();
        // A tuple, not a list: the shell prints a list of small integers as a string.
        let expr = format!(
            "R = maps:get(messages_received_total, maps:get([{{protocol, amqp091}}], rabbit_global_counters:overview())), \
             S = fun(N) -> case rabbit_amqqueue:lookup(rabbit_misc:r(<<\"/\">>, queue, N)) of \
               {{ok, Q}} -> proplists:get_value(next_seq_id, proplists:get_value(backing_queue_status, rabbit_amqqueue:info(Q, [backing_queue_status]), []), 0); \
               _ -> 0 end end, \
             list_to_tuple([R | [S(N) || N <- [{}]]]).",
            names.join(", ")
        );
        let out = self.ctl(&["-q", "eval", &expr]).output().await.ok()?;
        parse_counts(&String::from_utf8_lossy(&out.stdout), queues.len())
    }
}

/// `{Received,Enqueued1,...}` as the eval above prints it.
fn parse_counts(text: &str, queues: usize) -> Option<BrokerCounts> {
    let inner = text.trim().strip_prefix('{')?.strip_suffix('}')?;
    let values: Vec<u64> = inner
        .split(',')
        .map(|v| v.trim().parse().ok())
        .collect::<Option<_>>()?;
    let (&received, enqueued) = values.split_first()?;
    (enqueued.len() == queues).then(|| BrokerCounts {
        received,
        enqueued: enqueued.to_vec(),
    })
}
