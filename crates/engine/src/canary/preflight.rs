//! The ground a canary lands on, checked before it goes: its target queue exists, has a
//! consumer, and a small backlog.

use crate::amqp::Connection;
use crate::amqp::Delivery;

use crate::classify;
use crate::source;
use crate::spec::DlqReplaySpec;
use crate::Error;

/// The queue a canary would land on; none when the target exchange is overridden (the landing
/// queue is then the broker's business, not ours).
pub(crate) fn landing_queue(spec: &DlqReplaySpec, d: &Delivery) -> Option<String> {
    if spec.target.exchange.is_some() {
        return None;
    }
    classify::original_queue(&d.properties)
}

/// Check each of `queues`; returns the first failed check.
pub async fn preflight(
    conn: &Connection,
    spec: &DlqReplaySpec,
    queues: &[String],
) -> Result<Option<String>, Error> {
    for q in queues {
        match source::queue_state(conn, q).await? {
            None => {
                return Ok(Some(format!(
                    "TargetQueueMissing: target queue {q:?} does not exist"
                )))
            }
            Some((_, 0)) if spec.canary.require_consumer => {
                return Ok(Some(format!(
                    "NoConsumer: no consumer is attached to target queue {q:?}"
                )))
            }
            Some((n, _)) if u64::from(n) > spec.canary.max_backlog => {
                return Ok(Some(format!(
                "Backlog: target queue {q:?} holds {n} messages, more than canary.maxBacklog {}",
                spec.canary.max_backlog
            )))
            }
            Some(_) => {}
        }
    }
    Ok(None)
}
