//! The canary, inside the drain: one message per failure signature proves the fix before the
//! rest of its signature is replayed, at a cost that does not grow with the queue.
//!
//! Signatures are discovered as the drain meets them ([`Tracker`]). The replay first reads a
//! look-ahead (`canary.lookAhead` messages, or the whole queue when it is shorter) and sets it
//! aside: `maxSignatures`, `maxQuarantineRatio` and the pre-flight are decided on it before
//! anything moves. Then the first message of every signature met is its canary (published,
//! audited and acked like any replay, and watched), the messages of proven signatures are
//! replayed at once and those of a signature whose canary is still out are set aside (held by
//! the replay, unacknowledged, in their order); a signature first met deeper in the queue gets
//! its canary when it is met. With a look-ahead's worth set aside, the drain waits for the
//! canaries instead of reading on. A passed canary releases its signature's messages into the
//! drain; a returned one's are left in the queue ([`crate::spec::CanaryFailure`]).
//!
//! Returns are watched on a queue of our own bound to the dead-letter routes
//! ([`crate::watch::Returns`]); where no route is known, the watched queues are searched by
//! traversal when a canary's wait ends ([`search`]).
//!
//! Nothing is published to set a message aside, and nothing set aside is acked before its own
//! outcome is durable: a crash or a stop hands the set-aside messages back with the channel.
//! The verdicts are stored as they are made, so a resumed replay does not send the canary of a
//! decided signature again; one whose canary was still out gets a new one.

mod preflight;
pub(crate) mod search;
mod track;

pub(crate) use preflight::landing_queue;
pub use preflight::preflight;
pub(crate) use track::{Gate, Tracker};
