//! Frames on the wire: amq-protocol's generator and parser, a body frame written in place (no
//! copy of the body into a frame value), and a read buffer that parses as many frames as a read
//! brought.

use amq_protocol::frame::{gen_frame, parse_frame, AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{AMQPClass, BasicProperties};
use futures::io::{AsyncRead, AsyncReadExt};

use super::AmqpError;

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

/// Append a content header and the body frames (each at most `frame_max`).
pub(crate) fn content(
    out: &mut Vec<u8>,
    channel: u16,
    properties: BasicProperties,
    body: &[u8],
    frame_max: usize,
) -> Result<(), AmqpError> {
    let header = AMQPContentHeader {
        class_id: 60,
        body_size: body.len() as u64,
        properties,
    };
    frame(out, &AMQPFrame::Header(channel, header))?;
    let chunk = frame_max.saturating_sub(FRAME_OVERHEAD).max(1);
    out.reserve(body.len() + body.len().div_ceil(chunk) * FRAME_OVERHEAD);
    for part in body.chunks(chunk) {
        out.push(3);
        out.extend_from_slice(&channel.to_be_bytes());
        out.extend_from_slice(&(part.len() as u32).to_be_bytes());
        out.extend_from_slice(part);
        out.push(FRAME_END);
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
    pub(crate) fn next_frame(&mut self) -> Result<Option<AMQPFrame>, AmqpError> {
        if self.start == self.end {
            return Ok(None);
        }
        let input = &self.buf[self.start..self.end];
        match parse_frame(input) {
            Ok((rest, frame)) => {
                self.start = self.end - rest.len();
                Ok(Some(frame))
            }
            Err(e) if e.is_incomplete() => Ok(None),
            Err(e) => Err(AmqpError::Protocol(format!("cannot parse a frame: {e:?}"))),
        }
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
        if let Some(f) = rb.next_frame()? {
            return Ok(f);
        }
        rb.fill(r).await?;
    }
}
