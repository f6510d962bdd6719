//! The connection's opening: protocol header, start/start-ok (the login), tune/tune-ok,
//! open/open-ok.

use amq_protocol::auth::Credentials;
use amq_protocol::frame::{AMQPFrame, ProtocolVersion};
use amq_protocol::protocol::{connection, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use amq_protocol::uri::{AMQPUri, SASLMechanism};
use futures::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::wire::{self, ReadBuf};
use super::AmqpError;

/// Heartbeat we ask for when the URL does not say (RabbitMQ's default).
const HEARTBEAT: u16 = 60;

pub(super) struct Tuned {
    pub(super) channel_max: u16,
    pub(super) frame_max: u32,
    pub(super) heartbeat: u16,
}

/// Protocol header, start/start-ok, tune/tune-ok, open/open-ok.
pub(super) async fn handshake<R, W>(
    uri: &AMQPUri,
    name: &str,
    r: &mut R,
    w: &mut W,
    rb: &mut ReadBuf,
) -> Result<Tuned, AmqpError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut out = Vec::new();
    wire::frame(
        &mut out,
        &AMQPFrame::ProtocolHeader(ProtocolVersion::amqp_0_9_1()),
    )?;
    w.write_all(&out).await?;
    let start = match expect_method(r, rb).await? {
        AMQPClass::Connection(connection::AMQPMethod::Start(s)) => s,
        other => return Err(unexpected("connection.start", &other)),
    };
    let mechanism = uri.query.auth_mechanism.unwrap_or_default();
    let offered = start.mechanisms.to_string();
    if !offered.split_whitespace().any(|m| m == mechanism.name()) {
        return Err(AmqpError::Refused {
            code: 403,
            text: format!(
                "the broker does not offer the {} login (it offers {offered})",
                mechanism.name()
            ),
        });
    }
    let creds = Credentials::new(
        uri.authority.userinfo.username.clone().into(),
        uri.authority.userinfo.password.clone().into(),
    );
    send_method(
        w,
        0,
        AMQPClass::Connection(connection::AMQPMethod::StartOk(connection::StartOk {
            client_properties: client_properties(name),
            mechanism: mechanism.name().into(),
            response: creds.sasl_auth_string(mechanism),
            locale: "en_US".into(),
        })),
    )
    .await?;
    let tune = match expect_method(r, rb).await? {
        AMQPClass::Connection(connection::AMQPMethod::Tune(t)) => t,
        AMQPClass::Connection(connection::AMQPMethod::Secure(_))
            if mechanism == SASLMechanism::RabbitCrDemo =>
        {
            return Err(AmqpError::Protocol(
                "the RABBIT-CR-DEMO login is not supported".into(),
            ))
        }
        other => return Err(unexpected("connection.tune", &other)),
    };
    let tuned = Tuned {
        channel_max: lowest(uri.query.channel_max.unwrap_or(0), tune.channel_max),
        frame_max: lowest(uri.query.frame_max.unwrap_or(0), tune.frame_max),
        heartbeat: match uri.query.heartbeat {
            Some(h) => h,
            None if tune.heartbeat == 0 => HEARTBEAT,
            None => tune.heartbeat,
        },
    };
    send_method(
        w,
        0,
        AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: tuned.channel_max,
            frame_max: tuned.frame_max,
            heartbeat: tuned.heartbeat,
        })),
    )
    .await?;
    send_method(
        w,
        0,
        AMQPClass::Connection(connection::AMQPMethod::Open(connection::Open {
            virtual_host: uri.vhost.as_str().into(),
        })),
    )
    .await?;
    match expect_method(r, rb).await? {
        AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)) => Ok(tuned),
        other => Err(unexpected("connection.open-ok", &other)),
    }
}

/// The smaller of two limits where 0 means none.
fn lowest<T: Ord + Default + Copy>(ours: T, theirs: T) -> T {
    let none = T::default();
    match (ours == none, theirs == none) {
        (true, _) => theirs,
        (_, true) => ours,
        _ => ours.min(theirs),
    }
}

fn client_properties(name: &str) -> FieldTable {
    let mut caps = FieldTable::default();
    for cap in [
        "publisher_confirms",
        "basic.nack",
        "consumer_cancel_notify",
        "connection.blocked",
        "authentication_failure_close",
        "per_consumer_qos",
        "exchange_exchange_bindings",
    ] {
        caps.insert(cap.into(), AMQPValue::Boolean(true));
    }
    let mut props = FieldTable::default();
    props.insert("product".into(), long("dlq-replay"));
    props.insert("version".into(), long(env!("CARGO_PKG_VERSION")));
    props.insert("platform".into(), long("Rust"));
    props.insert("capabilities".into(), AMQPValue::FieldTable(caps));
    props.insert("connection_name".into(), long(name));
    props
}

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

async fn send_method<W: AsyncWrite + Unpin>(
    w: &mut W,
    channel: u16,
    class: AMQPClass,
) -> Result<(), AmqpError> {
    let mut out = Vec::new();
    wire::method(&mut out, channel, class)?;
    w.write_all(&out).await?;
    w.flush().await?;
    Ok(())
}

/// The next method frame of the handshake; a `connection.close` (a refused login, a missing
/// vhost) is a refusal.
async fn expect_method<R: AsyncRead + Unpin>(
    r: &mut R,
    rb: &mut ReadBuf,
) -> Result<AMQPClass, AmqpError> {
    loop {
        match wire::read_frame(r, rb).await? {
            AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(c))) => {
                return Err(AmqpError::Refused {
                    code: c.reply_code,
                    text: c.reply_text.to_string(),
                })
            }
            AMQPFrame::Method(_, m) => return Ok(m),
            AMQPFrame::Heartbeat => continue,
            other => {
                return Err(AmqpError::Protocol(format!(
                    "unexpected frame during the handshake: {other:?}"
                )))
            }
        }
    }
}

pub(super) fn unexpected(wanted: &str, got: &AMQPClass) -> AmqpError {
    AmqpError::Protocol(format!("expected {wanted}, got {got:?}"))
}
