//! Unary gRPC calls the way the kubelet's plugin watcher makes them: grpc-go dialled with the bare
//! socket path as its target, so every request carries `:authority` = that path.
//!
//! tonic's client cannot send that (a request URI must hold a valid authority, and it sends
//! `localhost`), and a test against a client that is kinder than the kubelet hid for a whole
//! release that the driver's server refused the real one. So this client writes its HTTP/2
//! frames itself, with HPACK as grpc-go's encoder uses it: static-table references where an
//! entry matches, everything else a literal *with incremental indexing*, and references to the
//! dynamic table for what an earlier request on the connection already sent (the path
//! authority, `content-type`, `te`). Strings are sent without Huffman coding; that changes
//! no header a server sees. One connection serves any number of calls, one at a time.

use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// HPACK's default dynamic table size, which the driver's server keeps.
const TABLE_SIZE: usize = 4096;

/// The entries of HPACK's static table a gRPC request uses (index, name, value).
const STATIC: &[(usize, &str, &str)] = &[
    (1, ":authority", ""),
    (2, ":method", "GET"),
    (3, ":method", "POST"),
    (4, ":path", "/"),
    (6, ":scheme", "http"),
    (31, "content-type", ""),
    (58, "user-agent", ""),
];

#[derive(Debug, thiserror::Error)]
pub enum PathAuthorityError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("stream terminated by RST_STREAM with error code: {}", reason_name(*.0))]
    Reset(u32),
    #[error("connection closed by GOAWAY with error code: {}", reason_name(*.0))]
    GoAway(u32),
    #[error("connection closed before the call finished")]
    Closed,
    #[error("rpc error: code = {code} desc = {message}")]
    Status { code: u32, message: String },
    #[error("malformed answer: {0}")]
    Malformed(String),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// HTTP/2 error code names, as grpc-go prints them.
fn reason_name(code: u32) -> String {
    match code {
        0x0 => "NO_ERROR".into(),
        0x1 => "PROTOCOL_ERROR".into(),
        0x2 => "INTERNAL_ERROR".into(),
        0x7 => "REFUSED_STREAM".into(),
        0x8 => "CANCEL".into(),
        0x9 => "COMPRESSION_ERROR".into(),
        other => format!("0x{other:x}"),
    }
}

/// grpc-go's HPACK encoding strategy, without Huffman coding.
#[derive(Default)]
struct Encoder {
    /// Newest first, as HPACK numbers them (index 62 is the first).
    dynamic: std::collections::VecDeque<(String, String)>,
}

impl Encoder {
    fn size(&self) -> usize {
        self.dynamic
            .iter()
            .map(|(n, v)| n.len() + v.len() + 32)
            .sum()
    }

    fn string(s: &str, out: &mut Vec<u8>) {
        loona_hpack::encoder::encode_integer_into(s.len(), 7, 0, out).expect("Vec write");
        out.extend_from_slice(s.as_bytes());
    }

    fn field(&mut self, name: &str, value: &str, out: &mut Vec<u8>) {
        let full = STATIC
            .iter()
            .find(|(_, n, v)| *n == name && *v == value && !v.is_empty())
            .map(|(i, _, _)| *i)
            .or_else(|| {
                self.dynamic
                    .iter()
                    .position(|(n, v)| n == name && v == value)
                    .map(|p| 62 + p)
            });
        if let Some(index) = full {
            loona_hpack::encoder::encode_integer_into(index, 7, 0x80, out).expect("Vec write");
            return;
        }
        let name_index = STATIC
            .iter()
            .find(|(_, n, _)| *n == name)
            .map(|(i, _, _)| *i)
            .or_else(|| {
                self.dynamic
                    .iter()
                    .position(|(n, _)| n == name)
                    .map(|p| 62 + p)
            });
        match name_index {
            Some(index) => {
                loona_hpack::encoder::encode_integer_into(index, 6, 0x40, out).expect("Vec write")
            }
            None => {
                out.push(0x40);
                Self::string(name, out);
            }
        }
        Self::string(value, out);
        self.dynamic
            .push_front((name.to_string(), value.to_string()));
        while self.size() > TABLE_SIZE {
            self.dynamic.pop_back();
        }
    }
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.extend([kind, flags]);
    f.extend(stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// One HTTP/2 connection to a Unix socket, with `:authority` = the socket's path.
pub struct PathAuthorityConnection {
    stream: UnixStream,
    authority: String,
    encoder: Encoder,
    decoder: loona_hpack::Decoder<'static>,
    next_stream: u32,
    received: Vec<u8>,
}

/// What came back for one stream.
#[derive(Default)]
struct Answer {
    headers: Vec<(String, String)>,
    data: Vec<u8>,
    done: bool,
}

impl PathAuthorityConnection {
    /// Connects and sends the connection preface and an empty SETTINGS frame, as grpc-go does.
    pub async fn connect(path: &Path) -> Result<Self, PathAuthorityError> {
        Self::connect_with_authority(path, &path.to_string_lossy()).await
    }

    /// Like [`Self::connect`] with another `:authority`: grpc-go releases since mid-2023
    /// percent-encode the path (`%2Fvar%2Flib%2F...`), which h2 refuses as well.
    pub async fn connect_with_authority(
        path: &Path,
        authority: &str,
    ) -> Result<Self, PathAuthorityError> {
        let mut stream = UnixStream::connect(path).await?;
        let mut hello = PREFACE.to_vec();
        hello.extend(frame(SETTINGS, 0, 0, &[]));
        stream.write_all(&hello).await?;
        Ok(Self {
            stream,
            authority: authority.to_string(),
            encoder: Encoder::default(),
            decoder: loona_hpack::Decoder::new(),
            next_stream: 1,
            received: Vec::new(),
        })
    }

    /// Calls `method` (`/package.Service/Method`) with `request`, within `timeout`.
    pub async fn unary<Req, Resp>(
        &mut self,
        method: &str,
        request: &Req,
        timeout: Duration,
    ) -> Result<Resp, PathAuthorityError>
    where
        Req: prost::Message,
        Resp: prost::Message + Default,
    {
        tokio::time::timeout(timeout, self.call(method, request))
            .await
            .map_err(|_| PathAuthorityError::Timeout(timeout))?
    }

    async fn call<Req, Resp>(
        &mut self,
        method: &str,
        request: &Req,
    ) -> Result<Resp, PathAuthorityError>
    where
        Req: prost::Message,
        Resp: prost::Message + Default,
    {
        let id = self.next_stream;
        self.next_stream += 2;
        let mut block = Vec::new();
        let authority = self.authority.clone();
        for (name, value) in [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", method),
            (":authority", authority.as_str()),
            ("content-type", "application/grpc"),
            ("user-agent", "grpc-go/1.72.0"),
            ("te", "trailers"),
        ] {
            self.encoder.field(name, value, &mut block);
        }
        let body = request.encode_to_vec();
        let mut message = vec![0];
        message.extend((body.len() as u32).to_be_bytes());
        message.extend(body);
        let mut out = frame(HEADERS, END_HEADERS, id, &block);
        out.extend(frame(DATA, END_STREAM, id, &message));
        self.stream.write_all(&out).await?;

        let answer = self.read_answer(id).await?;
        let header = |name: &str| {
            answer
                .headers
                .iter()
                .rev()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
        };
        let status = header("grpc-status")
            .ok_or_else(|| PathAuthorityError::Malformed("no grpc-status".into()))?;
        let code: u32 = status
            .parse()
            .map_err(|_| PathAuthorityError::Malformed(format!("grpc-status {status:?}")))?;
        if code != 0 {
            return Err(PathAuthorityError::Status {
                code,
                message: header("grpc-message").unwrap_or_default(),
            });
        }
        if answer.data.len() < 5 {
            return Err(PathAuthorityError::Malformed("no response message".into()));
        }
        Resp::decode(&answer.data[5..])
            .map_err(|e| PathAuthorityError::Malformed(format!("response message: {e}")))
    }

    /// Reads frames until stream `id` ended, answering SETTINGS and PING as a client must.
    async fn read_answer(&mut self, id: u32) -> Result<Answer, PathAuthorityError> {
        let mut answer = Answer::default();
        let mut fragment: Vec<u8> = Vec::new();
        let mut end_stream_after_headers = false;
        while !answer.done {
            let (kind, flags, stream, payload) = self.next_frame().await?;
            match kind {
                SETTINGS if flags & ACK == 0 => {
                    self.stream.write_all(&frame(SETTINGS, ACK, 0, &[])).await?
                }
                PING if flags & ACK == 0 => {
                    self.stream
                        .write_all(&frame(PING, ACK, 0, &payload))
                        .await?
                }
                GOAWAY => {
                    let code = payload
                        .get(4..8)
                        .map_or(0, |c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]));
                    if code != 0 || stream_not_processed(&payload, id) {
                        return Err(PathAuthorityError::GoAway(code));
                    }
                }
                RST_STREAM if stream == id => {
                    let code = payload
                        .get(..4)
                        .map_or(0, |c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]));
                    return Err(PathAuthorityError::Reset(code));
                }
                HEADERS | CONTINUATION => {
                    let mut body = payload.as_slice();
                    if kind == HEADERS {
                        end_stream_after_headers = flags & END_STREAM != 0;
                        if flags & PADDED != 0 {
                            let pad = *body.first().unwrap_or(&0) as usize;
                            body = &body[1..body.len().saturating_sub(pad).max(1)];
                        }
                        if flags & PRIORITY != 0 {
                            body = body.get(5..).unwrap_or_default();
                        }
                    }
                    fragment.extend_from_slice(body);
                    if flags & END_HEADERS != 0 {
                        // Every block goes through the decoder, whatever its stream, to keep
                        // its table in step with the server's encoder.
                        let headers = self
                            .decoder
                            .decode(&fragment)
                            .map_err(|e| PathAuthorityError::Malformed(format!("HPACK: {e}")))?;
                        fragment.clear();
                        if stream == id {
                            answer.headers.extend(headers.into_iter().map(|(n, v)| {
                                (
                                    String::from_utf8_lossy(&n).into_owned(),
                                    String::from_utf8_lossy(&v).into_owned(),
                                )
                            }));
                            answer.done = end_stream_after_headers;
                        }
                    }
                }
                DATA => {
                    if !payload.is_empty() {
                        // Give the window back so later calls on this connection never stall.
                        let increment = (payload.len() as u32).to_be_bytes();
                        let mut out = frame(WINDOW_UPDATE, 0, 0, &increment);
                        out.extend(frame(WINDOW_UPDATE, 0, stream, &increment));
                        self.stream.write_all(&out).await?;
                    }
                    if stream == id {
                        answer.data.extend_from_slice(&payload);
                        answer.done = flags & END_STREAM != 0;
                    }
                }
                _ => {}
            }
        }
        Ok(answer)
    }

    async fn next_frame(&mut self) -> Result<(u8, u8, u32, Vec<u8>), PathAuthorityError> {
        loop {
            if self.received.len() >= 9 {
                let r = &self.received;
                let len = u32::from_be_bytes([0, r[0], r[1], r[2]]) as usize;
                if r.len() >= 9 + len {
                    let (kind, flags) = (r[3], r[4]);
                    let stream = u32::from_be_bytes([r[5], r[6], r[7], r[8]]) & 0x7fff_ffff;
                    let payload = r[9..9 + len].to_vec();
                    self.received.drain(..9 + len);
                    return Ok((kind, flags, stream, payload));
                }
            }
            let mut buf = [0u8; 16 * 1024];
            let n = self.stream.read(&mut buf).await?;
            if n == 0 {
                return Err(PathAuthorityError::Closed);
            }
            self.received.extend_from_slice(&buf[..n]);
        }
    }
}

/// GOAWAY names the last stream the server will process; a later one of ours is lost.
fn stream_not_processed(payload: &[u8], id: u32) -> bool {
    payload
        .get(..4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) & 0x7fff_ffff)
        .is_some_and(|last| last < id)
}
