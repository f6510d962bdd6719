//! Frames on the wire: amq-protocol's generator and parser, a body frame written in place (no
//! copy of the body into a frame value), and a read buffer that parses as many frames as a read
//! brought.

use amq_protocol::frame::{gen_frame, parse_frame, AMQPFrame};
use amq_protocol::protocol::AMQPClass;
use futures::io::{AsyncRead, AsyncReadExt};

use super::props::{self, Properties, Publishable};
use super::AmqpError;

/// A frame as the reader routes it: a content header parsed by [`props::parse_header`] (the
/// headers kept as bytes), any other by amq-protocol.
#[derive(Debug)]
pub(crate) enum Frame {
    Amqp(AMQPFrame),
    /// A content header: channel, body size, properties.
    Header(u16, u64, Properties),
}

/// Frame end octet.
const FRAME_END: u8 = 0xCE;
/// Frame header (type, channel, size) and end octet: what a frame adds to its payload.
pub(crate) const FRAME_OVERHEAD: usize = 8;

/// Append a method frame.
pub(crate) fn method(out: &mut Vec<u8>, channel: u16, class: AMQPClass) -> Result<(), AmqpError> {
    frame(out, &AMQPFrame::Method(channel, class))
}

/// Append a frame.
pub(crate) fn frame(out: &mut Vec<u8>, f: &AMQPFrame) -> Result<(), AmqpError> {
    let buf = std::mem::take(out);
    *out = cookie_factory::gen_simple(gen_frame(f), buf)
        .map_err(|e| AmqpError::Protocol(format!("cannot encode a frame: {e:?}")))?;
    Ok(())
}

/// Append a `basic.publish` method frame, encoded in place (the names are not copied into
/// short strings first). Names are short strings: the engine's are at most 255 bytes
/// (`classify::destination` checks), longer ones are cut.
pub(crate) fn publish(
    out: &mut Vec<u8>,
    channel: u16,
    exchange: &str,
    routing_key: &str,
    mandatory: bool,
) {
    let start = begin(out, 1, channel);
    out.extend_from_slice(&60u16.to_be_bytes());
    out.extend_from_slice(&40u16.to_be_bytes());
    out.extend_from_slice(&0u16.to_be_bytes());
    props::short_string(out, exchange);
    props::short_string(out, routing_key);
    out.push(u8::from(mandatory));
    end(out, start);
}

/// Start a frame of `kind` on `channel`, its size to be filled in by [`end`]: where its
/// payload starts.
fn begin(out: &mut Vec<u8>, kind: u8, channel: u16) -> usize {
    out.push(kind);
    out.extend_from_slice(&channel.to_be_bytes());
    out.extend_from_slice(&[0; 4]);
    out.len()
}

/// End the frame whose payload started at `start`: its size, then the end octet.
fn end(out: &mut Vec<u8>, start: usize) {
    let size = (out.len() - start) as u32;
    out[start - 4..start].copy_from_slice(&size.to_be_bytes());
    out.push(FRAME_END);
}

/// Append a content header and the body frames (each at most `frame_max`).
pub(crate) fn content(
    out: &mut Vec<u8>,
    channel: u16,
    properties: &impl Publishable,
    body: &[u8],
    frame_max: usize,
) -> Result<(), AmqpError> {
    let start = begin(out, 2, channel);
    properties.write_header(out, body.len() as u64);
    end(out, start);
    let chunk = frame_max.saturating_sub(FRAME_OVERHEAD).max(1);
    out.reserve(body.len() + body.len().div_ceil(chunk) * FRAME_OVERHEAD);
    for part in body.chunks(chunk) {
        let start = begin(out, 3, channel);
        out.extend_from_slice(part);
        end(out, start);
    }
    Ok(())
}

/// A heartbeat frame.
pub(crate) fn heartbeat() -> [u8; 8] {
    [8, 0, 0, 0, 0, 0, 0, FRAME_END]
}

/// Bytes read from the socket and not parsed yet.
pub(crate) struct ReadBuf {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl ReadBuf {
    pub(crate) fn new() -> Self {
        Self {
            buf: vec![0; 128 * 1024],
            start: 0,
            end: 0,
        }
    }

    /// The next whole frame in the buffer, if there is one.
    pub(crate) fn next_frame(&mut self) -> Result<Option<Frame>, AmqpError> {
        if self.start == self.end {
            return Ok(None);
        }
        let input = &self.buf[self.start..self.end];
        if input[0] == 2 {
            return self.next_header();
        }
        match parse_frame(input) {
            Ok((rest, frame)) => {
                self.start = self.end - rest.len();
                Ok(Some(Frame::Amqp(frame)))
            }
            Err(e) if e.is_incomplete() => Ok(None),
            Err(e) => Err(AmqpError::Protocol(format!("cannot parse a frame: {e:?}"))),
        }
    }

    /// The content header frame at the start of the buffer, if it is all there.
    fn next_header(&mut self) -> Result<Option<Frame>, AmqpError> {
        let input = &self.buf[self.start..self.end];
        let Some(head) = input.get(..7) else {
            return Ok(None);
        };
        let channel = u16::from_be_bytes([head[1], head[2]]);
        let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
        let Some(&last) = input.get(7 + size) else {
            return Ok(None);
        };
        if last != FRAME_END {
            return Err(AmqpError::Protocol(
                "cannot parse a frame: a content header does not end with the frame end".into(),
            ));
        }
        let (body_size, properties) = props::parse_header(&input[7..7 + size])?;
        self.start += 7 + size + 1;
        Ok(Some(Frame::Header(channel, body_size, properties)))
    }

    /// Read more from `r` (at least one byte, or an error: end of stream is one).
    pub(crate) async fn fill<R: AsyncRead + Unpin>(&mut self, r: &mut R) -> Result<(), AmqpError> {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.end == self.buf.len() {
            // A frame larger than the buffer (frame_max above 128 KiB): grow.
            self.buf.resize(self.buf.len() * 2, 0);
        }
        let n = r.read(&mut self.buf[self.end..]).await?;
        if n == 0 {
            return Err(AmqpError::Io("the broker closed the connection".into()));
        }
        self.end += n;
        Ok(())
    }
}

/// The next frame from `r`, reading as needed (the handshake's reads, before the tasks run).
pub(crate) async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    rb: &mut ReadBuf,
) -> Result<AMQPFrame, AmqpError> {
    loop {
        match rb.next_frame()? {
            Some(Frame::Amqp(f)) => return Ok(f),
            Some(Frame::Header(..)) => {
                return Err(AmqpError::Protocol(
                    "a content header before the connection was open".into(),
                ))
            }
            None => {}
        }
        rb.fill(r).await?;
    }
}
