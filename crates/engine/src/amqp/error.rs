//! What the client reports: the broker's reply codes kept, so callers tell a refused request
//! (404 NOT_FOUND, 406 PRECONDITION_FAILED, 403 ACCESS_REFUSED) from a lost connection.

/// An AMQP failure.
#[derive(Clone, Debug, thiserror::Error)]
pub enum AmqpError {
    /// The socket failed or closed.
    #[error("I/O error: {0}")]
    Io(String),
    /// Nothing came from the broker for two heartbeat intervals.
    #[error("missing heartbeat: nothing from the broker for {0}s")]
    MissingHeartbeat(u64),
    /// The broker closed the connection.
    #[error("connection closed by the broker: {code} {text}")]
    ConnectionClosed {
        /// The reply code (e.g. 320 CONNECTION_FORCED).
        code: u16,
        /// The reply text.
        text: String,
    },
    /// The broker refused the connection during the login (403 ACCESS_REFUSED, 530 NOT_ALLOWED
    /// for a vhost that does not exist or the user may not use, a login mechanism it does not
    /// offer): asking again will not help.
    #[error("connection refused by the broker: {code} {text}")]
    Refused {
        /// The reply code.
        code: u16,
        /// The reply text.
        text: String,
    },
    /// The broker closed the channel (e.g. 404 NOT_FOUND for a missing exchange or queue).
    #[error("channel closed by the broker: {code} {text}")]
    ChannelClosed {
        /// The reply code.
        code: u16,
        /// The reply text.
        text: String,
    },
    /// The connection or channel was closed by us, or had already failed.
    #[error("{0}")]
    Closed(String),
    /// The broker said something this client does not expect.
    #[error("protocol error: {0}")]
    Protocol(String),
}

impl AmqpError {
    pub(crate) fn closed() -> Self {
        AmqpError::Closed("the connection or channel is closed".into())
    }

    /// The broker's reply code, when the broker closed a channel or the connection.
    pub fn reply_code(&self) -> Option<u16> {
        match self {
            AmqpError::ConnectionClosed { code, .. }
            | AmqpError::ChannelClosed { code, .. }
            | AmqpError::Refused { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// Whether the connection is gone (refused, reset, silent, closed by the broker with a hard
    /// error such as CONNECTION_FORCED), rather than a request refused on a live connection.
    pub fn is_connection_lost(&self) -> bool {
        match self {
            AmqpError::Io(_) | AmqpError::MissingHeartbeat(_) | AmqpError::Closed(_) => true,
            // Soft codes (311-313, 403-406) refuse a request; hard ones (320
            // CONNECTION_FORCED, 541 INTERNAL_ERROR...) end the connection.
            AmqpError::ConnectionClosed { code, .. } => !is_soft(*code),
            AmqpError::ChannelClosed { .. }
            | AmqpError::Refused { .. }
            | AmqpError::Protocol(_) => false,
        }
    }

    /// Whether the broker answered 404 NOT_FOUND.
    pub fn is_not_found(&self) -> bool {
        self.reply_code() == Some(404)
    }
}

/// AMQP 0-9-1's soft error codes: the request was refused, the connection is fine.
fn is_soft(code: u16) -> bool {
    matches!(code, 311..=313 | 403..=406)
}

impl From<std::io::Error> for AmqpError {
    fn from(e: std::io::Error) -> Self {
        AmqpError::Io(e.to_string())
    }
}
