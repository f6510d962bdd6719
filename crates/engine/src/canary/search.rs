//! Looking for returned canaries where no dead-letter route can be watched (a dead-letter queue
//! fed through the default exchange): a traversal of the watched queues that moves every
//! message to the tail (never hands one back), when a canary's wait ends. It costs a pass over
//! those queues per wait; a known route costs nothing of the kind ([`crate::watch::Returns`]).

use crate::amqp::Connection;
use crate::store::Redis;

use crate::scan::Scan;
use crate::spec::DlqReplaySpec;
use crate::watch::{self, Returned};
use crate::Error;

/// Traverse the source queue and `canary.watchQueues`; returns this replay's returned messages.
pub(crate) async fn search(
    conn: &Connection,
    publish: &Connection,
    redis: Redis,
    amqp_url: &str,
    spec: &DlqReplaySpec,
    replay_id: &str,
) -> Result<Vec<Returned>, Error> {
    let mut found = Vec::new();
    for q in std::iter::once(&spec.source.queue).chain(&spec.canary.watch_queues) {
        // The drain's consumer holds (and may still take) some of the source queue's messages,
        // and its moves' ledger counts are its own to take back.
        let mut scan = Scan::open(conn, publish, redis.clone(), amqp_url, q)
            .await?
            .beside_a_drain();
        while let Some(d) = scan.next().await? {
            if let Some(r) = watch::returned(&d, replay_id, &spec.canary.signature_header) {
                found.push(r);
            }
            scan.keep(d).await?;
        }
        scan.finish().await?;
    }
    Ok(found)
}
