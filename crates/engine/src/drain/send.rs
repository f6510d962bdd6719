//! The publish stage: a step's quarantines and replays go out without waiting (`send`); its
//! confirms are awaited when the step lands (`resolve`), so the next steps publish meanwhile.

use crate::amqp::{Confirm, Properties};

use super::{Act, Drain, Item};
use crate::publish;
use crate::Error;

impl Drain<'_> {
    /// Publish the step's quarantines and replays; the confirms are returned, not awaited.
    /// Each publish is queued for the connection's writer as it is decided, so without a rate
    /// limit the step's publishes leave together (one write, not one wait per message); with
    /// one, each waits for its token.
    pub(super) async fn send(
        &mut self,
        items: &mut [Item],
    ) -> Result<Vec<(usize, Confirm)>, Error> {
        self.publisher.ensure_open().await?;
        let mut out = Vec::new();
        for (i, item) in items.iter_mut().enumerate() {
            let Some(props) = self.outgoing(item).await else {
                continue;
            };
            // Where it goes, borrowed from its act (a replay's destination, or the quarantine).
            let dest = match &item.act {
                Act::Replay(dest) => dest,
                _ => &self.quarantine,
            };
            match self.publisher.send(dest, props, &item.delivery.data) {
                Ok(confirm) => out.push((i, confirm)),
                // Refused before it left (e.g. the channel is closed): it was not sent.
                Err(e) => item.act = Act::Failed(format!("NotSent: {e}")),
            }
        }
        Ok(out)
    }

    /// The properties an item is published with (to the destination its act names, or the
    /// quarantine), or `None` when it is not published (or cannot be: its act then says why).
    async fn outgoing(&mut self, item: &mut Item) -> Option<Properties> {
        let props = &item.delivery.properties;
        match &item.act {
            Act::Quarantine(reason) => {
                let user = self.publisher.user();
                Some(publish::quarantine_properties(
                    props,
                    &self.replay_id,
                    reason,
                    user,
                ))
            }
            Act::Replay(dest) => {
                let not_sent = match self.publisher.exchange_exists(&dest.exchange).await {
                    Ok(true) => None,
                    Ok(false) => Some(format!(
                        "NoExchange: exchange {:?} does not exist",
                        dest.exchange
                    )),
                    // Not sent: earlier publishes of the step still land with their confirms.
                    Err(e) => Some(format!("NotSent: {e}")),
                };
                if let Some(why) = not_sent {
                    item.act = Act::Failed(why);
                    return None;
                }
                if let Some(l) = &self.limiter {
                    // At a low rate a step waits for its tokens: a stop ends the wait, and what
                    // the step has not sent yet stays for the next run.
                    let stopped = tokio::select! {
                        biased;
                        _ = self.cancel.cancelled() => true,
                        _ = l.until_ready() => false,
                    };
                    if stopped {
                        item.act = Act::Unsent;
                        return None;
                    }
                }
                let user = self.publisher.user();
                Some(publish::replay_properties(
                    props,
                    &self.replay_id,
                    item.key.as_deref(),
                    user,
                ))
            }
            _ => None,
        }
    }

    /// Wait for the step's confirms and turn each publish into its outcome.
    pub(super) async fn resolve(
        &mut self,
        items: &mut [Item],
        confirms: Vec<(usize, Confirm)>,
        sent: std::time::Instant,
    ) {
        let (idx, confirms): (Vec<usize>, Vec<_>) = confirms.into_iter().unzip();
        let observer = crate::observe::observer();
        let timed = confirms.into_iter().map(|c| async move {
            let res = c.await;
            observer.confirmed(sent.elapsed());
            res
        });
        let results = futures::future::join_all(timed).await;
        // A confirm that never came (the channel or the connection closed first) leaves the
        // outcome unknown, even when the broker closed the channel because of a later publish
        // (e.g. to an exchange deleted mid-drain): an earlier one may have been routed and
        // persisted with its confirm still on the way.
        for (i, res) in idx.into_iter().zip(results) {
            let item = &mut items[i];
            let unconfirmed = res.is_err();
            // Taken, not cloned: the act's destination or reason moves into its outcome.
            let act = std::mem::replace(&mut item.act, Act::Leftover);
            item.act = match (publish::outcome(res), act) {
                (Ok(()), Act::Replay(d)) => Act::Replayed(d),
                (Ok(()), Act::Quarantine(r)) => Act::Quarantined(r),
                (Err(why), _) if unconfirmed => Act::Unknown(why),
                (Err(why), _) => Act::Failed(why),
                (Ok(()), other) => other,
            };
        }
        self.explain_not_sent(items);
        self.orphans(items);
    }

    /// A publish to a deleted exchange closes the channel: what this step and the steps after
    /// it could not send was refused for the same reason, and says so.
    fn explain_not_sent(&mut self, items: &mut [Item]) {
        let closed_on = items.iter().find_map(|it| match &it.act {
            Act::Unknown(r) if r.starts_with("NoExchange") => Some(r.clone()),
            _ => None,
        });
        if closed_on.is_some() {
            self.closed_on = closed_on;
        }
        let Some(cause) = &self.closed_on else {
            return;
        };
        for it in items.iter_mut() {
            if matches!(&it.act, Act::Failed(r) if r.starts_with("NotSent")) {
                it.act = Act::Failed(format!("{cause}; not sent after it"));
            }
        }
    }

    /// A message whose key was claimed earlier in this pass (this step or one before it still in
    /// flight) by one that failed is not a duplicate after all: its work never went out (or may
    /// not have). It stays in the queue; the twin of a message left unsent stays unsent too, so
    /// the next run decides both.
    fn orphans(&mut self, items: &mut [Item]) {
        for it in items.iter() {
            let Some(k) = it.key.as_deref() else {
                continue;
            };
            match it.act {
                Act::Unsent => {
                    self.failed_keys.insert(k.to_string(), true);
                }
                Act::Failed(_) | Act::Unknown(_) => {
                    self.failed_keys.entry(k.to_string()).or_insert(false);
                }
                // Claimed again (and published) by this step once the earlier claim was
                // released: its twins here are duplicates of this one.
                Act::Replayed(_) => {
                    self.failed_keys.remove(k);
                }
                _ => {}
            }
        }
        if self.failed_keys.is_empty() {
            return;
        }
        for it in items.iter_mut() {
            let same_attempt = matches!(
                it.act,
                Act::Duplicate {
                    same_attempt: true,
                    ..
                }
            );
            let twin_unsent = match it.key.as_deref() {
                Some(k) if same_attempt => self.failed_keys.get(k).copied(),
                _ => None,
            };
            it.act = match twin_unsent {
                Some(true) => Act::Unsent,
                Some(false) => {
                    Act::Failed("same key as a message of this pass whose publish failed".into())
                }
                None => continue,
            };
        }
    }
}
