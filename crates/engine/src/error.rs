//! What can go wrong outside a single message's decision, and which of it is worth a reconnect.

/// What can go wrong outside a single message's decision.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The manifest is invalid.
    #[error("{0}")]
    Manifest(String),
    /// A file could not be read or written.
    #[error("{0}")]
    Io(String),
    /// Missing configuration, e.g. no broker URL.
    #[error("{0}")]
    Config(String),
    /// The source queue does not exist.
    #[error("source queue {0:?} does not exist (spec.source.queue); nothing was touched")]
    SourceMissing(String),
    /// The broker failed.
    #[error("broker: {0}")]
    Broker(String),
    /// Redis failed.
    #[error("redis: {0}")]
    Redis(String),
    /// A connection to the broker or to Redis was lost (or could not be made again): worth
    /// reconnecting, unlike the errors above.
    #[error("{0}")]
    Connection(String),
}

impl Error {
    /// Whether reconnecting may help: the connection went away, the request itself was fine.
    pub fn is_transient(&self) -> bool {
        matches!(self, Error::Connection(_))
    }
}

/// Whether a Redis error means the connection is gone (or Redis stopped answering), or the
/// server is failing over: read-only (a master that was demoted), its master down, the cluster
/// moving slots or down for now, loading its data after a restart, no sentinel naming a master
/// that answers as one (mid-failover). Asking again, once the client found the new master, helps.
/// (A replay whose first connection fails so, a wrong master name, ends at once all the same:
/// see [`crate::run`].) A `WAIT` refused by a replica is a demoted master too: a Cluster's slot
/// map older than the failover sent it to the node that was the slot's master.
pub fn redis_connection_lost(e: &redis::RedisError) -> bool {
    use redis::ServerErrorKind as K;
    e.is_io_error()
        || refused_by_replica(e)
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || matches!(
            e.kind(),
            redis::ErrorKind::Server(
                K::ReadOnly | K::MasterDown | K::ClusterDown | K::TryAgain | K::BusyLoading
            ) | redis::ErrorKind::ClusterConnectionNotFound
                | redis::ErrorKind::MasterNameNotFoundBySentinel
        )
}

impl From<crate::amqp::AmqpError> for Error {
    fn from(e: crate::amqp::AmqpError) -> Self {
        if e.is_connection_lost() {
            Error::Connection(format!("broker connection lost: {e}"))
        } else {
            Error::Broker(e.to_string())
        }
    }
}

impl From<redis::ParsingError> for Error {
    fn from(e: redis::ParsingError) -> Self {
        Error::Redis(e.to_string())
    }
}

impl From<redis::RedisError> for Error {
    fn from(e: redis::RedisError) -> Self {
        if redis_connection_lost(&e) {
            Error::Connection(format!("redis connection lost: {e}"))
        } else {
            Error::Redis(e.to_string())
        }
    }
}

/// Redis's answer to a `WAIT` sent to a replica ("WAIT cannot be used with replica instances"),
/// which has no error kind of its own (its code is `ERR`).
fn refused_by_replica(e: &redis::RedisError) -> bool {
    e.code() == Some("ERR")
        && e.detail()
            .is_some_and(|d| d.starts_with("WAIT cannot be used with replica"))
}

#[cfg(test)]
mod tests {
    use super::Error;
    use crate::amqp::AmqpError;

    #[test]
    fn a_lost_connection_is_transient_and_a_refusal_is_not() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert!(Error::from(AmqpError::from(io)).is_transient());
        let closed = |code: u16| AmqpError::ConnectionClosed {
            code,
            text: "x".into(),
        };
        assert!(Error::from(closed(320)).is_transient(), "CONNECTION_FORCED");
        assert!(Error::from(AmqpError::MissingHeartbeat(120)).is_transient());
        assert!(!Error::from(closed(403)).is_transient(), "a refused login");
        let not_found = AmqpError::ChannelClosed {
            code: 404,
            text: "NOT_FOUND".into(),
        };
        assert!(!Error::from(not_found).is_transient());
    }

    #[test]
    fn a_dropped_or_silent_redis_is_transient_and_a_bad_command_is_not() {
        let io = std::io::Error::new(std::io::ErrorKind::BrokenPipe, "gone");
        assert!(Error::from(redis::RedisError::from(io)).is_transient());
        let timeout = std::io::Error::new(std::io::ErrorKind::TimedOut, "slow");
        assert!(Error::from(redis::RedisError::from(timeout)).is_transient());
        let wrong = redis::RedisError::from((redis::ErrorKind::Client, "bad command"));
        assert!(!Error::from(wrong).is_transient());
        let demoted = redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly),
            "You can't write against a read only replica.",
        ));
        assert!(Error::from(demoted).is_transient());
    }

    /// What a Cluster node that a failover made a replica answers a `WAIT` routed to it by a
    /// slot map from before the failover (seen in CI: the replay ended Failed).
    #[test]
    fn a_wait_refused_by_a_replica_is_transient_and_another_err_is_not() {
        let answer = |line: &[u8]| match redis::parse_redis_value(line) {
            Ok(redis::Value::ServerError(e)) => redis::RedisError::from(e),
            other => panic!("not an error reply: {other:?}"),
        };
        let replica = answer(b"-ERR WAIT cannot be used with replica instances. Please also note that since Redis 4.0 if a replica is configured to be writable (which is not the default) writes to replicas are just local and are not propagated.\r\n");
        assert!(Error::from(replica).is_transient());
        let other = answer(b"-ERR wrong number of arguments for 'wait' command\r\n");
        assert!(!Error::from(other).is_transient());
    }
}
