//! Accepts the HTTP/2 `:authority` the kubelet's plugin watcher sends.
//!
//! The kubelet dials a plugin's registration socket with grpc-go, giving the bare socket path as
//! the gRPC target, so every request it sends there carries `:authority` =
//! `/var/lib/kubelet/plugins_registry/gpupool.dev-reg.sock`. That is not a valid URI authority,
//! and h2 (under hyper and tonic) answers such a request with `RST_STREAM(PROTOCOL_ERROR)`
//! before any service sees it; the kubelet then never registers the plugin. h2 has no setting
//! to accept it (its pull request for Unix sockets has stayed open for years), so this module
//! sits between the socket and h2 and rewrites, on the bytes the client sends, every request
//! header block whose `:authority` h2 would refuse (a path, an empty value) into one whose
//! `:authority` is `localhost`, which is what grpc-go sends on the DRA socket and what tonic's own
//! client sends. Nothing is interpreted from the authority on a Unix socket, so nothing is lost.
//!
//! How: HTTP/2 frames are parsed only as far as needed. Every header block (HEADERS plus
//! CONTINUATION frames) is decoded with a full HPACK decoder that mirrors the client's dynamic
//! table. Blocks pass through byte for byte until the first one that needs the repair; from then
//! on every block of that connection is re-encoded as plain literals that never touch h2's
//! dynamic table (h2's table and the client's have diverged once one block was changed, so no
//! later block may be passed on as it was). All other frames pass through unchanged, DATA
//! frames without being buffered. A header block that cannot be decoded, or is larger than
//! [`MAX_HEADER_BLOCK`], ends the connection: h2 treats a bad header block as a connection
//! error too.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

/// The connection preface every HTTP/2 client sends first.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER_LEN: usize = 9;
const FRAME_HEADERS: u8 = 0x1;
const FRAME_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// The smallest SETTINGS_MAX_FRAME_SIZE a peer may announce: rewritten blocks are cut into
/// frames no larger, so they fit whatever h2 announced.
const MAX_FRAME_PAYLOAD: usize = 16_384;
/// A request's headers are far smaller (hyper refuses header lists above 16 KiB); a larger block
/// is an attack on our buffer, not a request.
pub const MAX_HEADER_BLOCK: usize = 64 * 1024;
/// h2's SETTINGS_HEADER_TABLE_SIZE (its default, which tonic does not change): the client's
/// encoder may use at most this much dynamic table.
const CLIENT_TABLE_LIMIT: usize = 4096;
/// What a refused authority is replaced with.
const REPLACEMENT_AUTHORITY: &[u8] = b"localhost";

/// Whether h2 accepts `value` as a request's `:authority` (it parses it as a URI authority).
fn authority_is_valid(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

/// Where the parser is in the client's byte stream.
#[derive(Debug)]
enum Position {
    /// Checking the connection preface; `usize` bytes of it seen so far.
    Preface(usize),
    /// At a frame boundary.
    FrameStart,
    /// Inside a frame that passes through: this many payload bytes still to copy.
    PassThrough(usize),
    /// Not HTTP/2 with prior knowledge: everything passes through and h2 decides.
    Opaque,
}

/// A header block being collected across its HEADERS and CONTINUATION frames.
struct PendingBlock {
    stream_id: u32,
    end_stream: bool,
    fragment: Vec<u8>,
    /// The frames as received, to pass on unchanged when the block needs no repair.
    raw: Vec<u8>,
}

/// The pure part: turns the client's bytes into the bytes h2 reads.
pub struct FrameRewriter {
    position: Position,
    decoder: loona_hpack::Decoder<'static>,
    pending: Option<PendingBlock>,
    /// Set once a block was changed: from then on every block is re-encoded.
    reencoding: bool,
    repaired_blocks: u64,
}

impl Default for FrameRewriter {
    fn default() -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(CLIENT_TABLE_LIMIT);
        Self {
            position: Position::Preface(0),
            decoder,
            pending: None,
            reencoding: false,
            repaired_blocks: 0,
        }
    }
}

fn invalid(message: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.into())
}

impl FrameRewriter {
    /// How many header blocks had their `:authority` replaced.
    pub fn repaired_blocks(&self) -> u64 {
        self.repaired_blocks
    }

    /// Consumes what it can of `input` (the bytes received and not consumed yet), appending the
    /// bytes for h2 to `out`; returns how many bytes of `input` were consumed. Bytes of an
    /// incomplete frame header or header-block frame stay unconsumed until more arrive.
    pub fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> io::Result<usize> {
        let mut at = 0;
        loop {
            let rest = &input[at..];
            match self.position {
                Position::Opaque => {
                    out.extend_from_slice(rest);
                    return Ok(input.len());
                }
                Position::Preface(seen) => {
                    let n = rest.len().min(PREFACE.len() - seen);
                    if rest[..n] != PREFACE[seen..seen + n] {
                        // Not a prior-knowledge HTTP/2 client; h2 will say what is wrong.
                        self.position = Position::Opaque;
                        continue;
                    }
                    out.extend_from_slice(&rest[..n]);
                    at += n;
                    if seen + n < PREFACE.len() {
                        self.position = Position::Preface(seen + n);
                        return Ok(at);
                    }
                    self.position = Position::FrameStart;
                }
                Position::PassThrough(left) => {
                    let n = rest.len().min(left);
                    out.extend_from_slice(&rest[..n]);
                    at += n;
                    if n < left {
                        self.position = Position::PassThrough(left - n);
                        return Ok(at);
                    }
                    self.position = Position::FrameStart;
                }
                Position::FrameStart => {
                    if rest.len() < FRAME_HEADER_LEN {
                        return Ok(at);
                    }
                    let len = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
                    let kind = rest[3];
                    let is_header_frame = kind == FRAME_HEADERS || kind == FRAME_CONTINUATION;
                    if self.pending.is_some() && kind != FRAME_CONTINUATION {
                        return Err(invalid("HTTP/2 header block interrupted by another frame"));
                    }
                    if !is_header_frame {
                        out.extend_from_slice(&rest[..FRAME_HEADER_LEN]);
                        at += FRAME_HEADER_LEN;
                        self.position = Position::PassThrough(len);
                        continue;
                    }
                    if len > MAX_HEADER_BLOCK {
                        return Err(invalid(format!(
                            "HTTP/2 header frame of {len} bytes (at most {MAX_HEADER_BLOCK})"
                        )));
                    }
                    let frame_len = FRAME_HEADER_LEN + len;
                    if rest.len() < frame_len {
                        return Ok(at);
                    }
                    self.header_frame(&rest[..frame_len], out)?;
                    at += frame_len;
                }
            }
        }
    }

    /// One complete HEADERS or CONTINUATION frame (header included).
    fn header_frame(&mut self, frame: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
        let (kind, flags) = (frame[3], frame[4]);
        let stream_id = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
        let payload = &frame[FRAME_HEADER_LEN..];
        let fragment = if kind == FRAME_HEADERS {
            if self.pending.is_some() {
                return Err(invalid("HTTP/2 HEADERS inside an unfinished header block"));
            }
            let (mut start, mut end) = (0, payload.len());
            if flags & FLAG_PADDED != 0 {
                let pad = *payload
                    .first()
                    .ok_or_else(|| invalid("padded HEADERS frame without a pad length"))?
                    as usize;
                start = 1;
                end = end
                    .checked_sub(pad)
                    .filter(|end| *end >= start)
                    .ok_or_else(|| invalid("HEADERS padding longer than the frame"))?;
            }
            if flags & FLAG_PRIORITY != 0 {
                start += 5;
                if start > end {
                    return Err(invalid("HEADERS priority fields longer than the frame"));
                }
            }
            self.pending = Some(PendingBlock {
                stream_id,
                end_stream: flags & FLAG_END_STREAM != 0,
                fragment: Vec::new(),
                raw: Vec::new(),
            });
            &payload[start..end]
        } else {
            match &self.pending {
                Some(block) if block.stream_id == stream_id => payload,
                _ => return Err(invalid("HTTP/2 CONTINUATION without its HEADERS")),
            }
        };
        let block = self.pending.as_mut().expect("set above");
        if block.fragment.len() + fragment.len() > MAX_HEADER_BLOCK {
            return Err(invalid(format!(
                "HTTP/2 header block larger than {MAX_HEADER_BLOCK} bytes"
            )));
        }
        block.fragment.extend_from_slice(fragment);
        block.raw.extend_from_slice(frame);
        if flags & FLAG_END_HEADERS != 0 {
            let block = self.pending.take().expect("set above");
            self.finish_block(block, out)?;
        }
        Ok(())
    }

    fn finish_block(&mut self, block: PendingBlock, out: &mut Vec<u8>) -> io::Result<()> {
        let mut headers: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut refused = false;
        self.decoder
            .decode_with_cb(&block.fragment, |name, value| {
                if &*name == b":authority" && !authority_is_valid(&value) {
                    refused = true;
                    headers.push((name.into_owned(), REPLACEMENT_AUTHORITY.to_vec()));
                } else {
                    headers.push((name.into_owned(), value.into_owned()));
                }
            })
            .map_err(|e| invalid(format!("HTTP/2 header block: HPACK: {e}")))?;
        if refused {
            self.repaired_blocks += 1;
            if !self.reencoding {
                tracing::debug!(
                    "HTTP/2 client sent an :authority that is no URI authority (a socket path?); \
                     reading it as localhost from now on"
                );
            }
            self.reencoding = true;
        }
        if !self.reencoding {
            out.extend_from_slice(&block.raw);
            return Ok(());
        }
        let mut encoded = Vec::with_capacity(block.fragment.len() + 16);
        for (name, value) in &headers {
            encode_plain_literal(name, value, &mut encoded);
        }
        write_header_frames(block.stream_id, block.end_stream, &encoded, out);
        Ok(())
    }
}

/// HPACK "literal header field without indexing, new name": h2 keeps no state for it.
fn encode_plain_literal(name: &[u8], value: &[u8], out: &mut Vec<u8>) {
    out.push(0x00);
    for s in [name, value] {
        // A string literal: the H bit (Huffman) clear, then a 7-bit-prefix length.
        loona_hpack::encoder::encode_integer_into(s.len(), 7, 0, out)
            .expect("writing to a Vec cannot fail");
        out.extend_from_slice(s);
    }
}

/// A HEADERS frame and as many CONTINUATION frames as `block` needs.
fn write_header_frames(stream_id: u32, end_stream: bool, block: &[u8], out: &mut Vec<u8>) {
    let mut chunks = block.chunks(MAX_FRAME_PAYLOAD).peekable();
    let mut kind = FRAME_HEADERS;
    let mut flags = if end_stream { FLAG_END_STREAM } else { 0 };
    // An empty block still needs its HEADERS frame.
    let empty: &[u8] = &[];
    let first = chunks.next().unwrap_or(empty);
    let mut chunk = Some(first);
    while let Some(payload) = chunk {
        chunk = chunks.next();
        if chunk.is_none() {
            flags |= FLAG_END_HEADERS;
        }
        let len = payload.len() as u32;
        out.extend_from_slice(&len.to_be_bytes()[1..]);
        out.push(kind);
        out.push(flags);
        out.extend_from_slice(&stream_id.to_be_bytes());
        out.extend_from_slice(payload);
        kind = FRAME_CONTINUATION;
        flags = 0;
    }
}

/// A server-side connection whose reads go through a [`FrameRewriter`]; writes are untouched.
pub struct AuthorityRepair<IO> {
    io: IO,
    rewriter: FrameRewriter,
    /// Received, not consumed by the rewriter yet.
    received: Vec<u8>,
    /// Ready for h2, from `ready_at` on.
    ready: Vec<u8>,
    ready_at: usize,
    eof: bool,
}

impl<IO> AuthorityRepair<IO> {
    pub fn new(io: IO) -> Self {
        Self {
            io,
            rewriter: FrameRewriter::default(),
            received: Vec::new(),
            ready: Vec::new(),
            ready_at: 0,
            eof: false,
        }
    }
}

const READ_CHUNK: usize = 16 * 1024;

impl<IO: AsyncRead + Unpin> AsyncRead for AuthorityRepair<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.ready_at < this.ready.len() {
                let n = buf.remaining().min(this.ready.len() - this.ready_at);
                buf.put_slice(&this.ready[this.ready_at..this.ready_at + n]);
                this.ready_at += n;
                if this.ready_at == this.ready.len() {
                    this.ready.clear();
                    this.ready_at = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                // A frame cut off by the end of the connection is never complete: h2 sees the
                // end as it would have.
                return Poll::Ready(Ok(()));
            }
            // Read into the spare capacity: zero-filling a chunk on every poll (most of which find
            // nothing to read) cost more than the rewriting itself.
            let start = this.received.len();
            this.received.reserve(READ_CHUNK);
            let mut read_buf = ReadBuf::uninit(this.received.spare_capacity_mut());
            let polled = Pin::new(&mut this.io).poll_read(cx, &mut read_buf);
            let filled = read_buf.filled().len();
            // SAFETY: `ReadBuf` guarantees that its first `filled` bytes were initialised by the
            // read, and they lie within the spare capacity just after `start`.
            unsafe { this.received.set_len(start + filled) };
            ready!(polled)?;
            if filled == 0 {
                this.eof = true;
                continue;
            }
            let consumed = this.rewriter.feed(&this.received, &mut this.ready)?;
            this.received.drain(..consumed);
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for AuthorityRepair<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<IO: Connected> Connected for AuthorityRepair<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const REG_SOCKET: &[u8] = b"/var/lib/kubelet/plugins_registry/gpupool.dev-reg.sock";
    const GET_INFO: &[u8] = b"/pluginregistration.Registration/GetInfo";
    const NOTIFY: &[u8] = b"/pluginregistration.Registration/NotifyRegistrationStatus";

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend([kind, flags]);
        f.extend(stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn string(s: &[u8]) -> Vec<u8> {
        assert!(s.len() < 127, "test strings fit a one-byte length");
        let mut out = vec![s.len() as u8];
        out.extend_from_slice(s);
        out
    }

    /// A request's header block as grpc-go's HPACK encoder writes it on a fresh connection:
    /// static entries indexed, everything else a literal *with incremental indexing*, so the
    /// socket path lands in the dynamic table (entries 62.. after this block: te, content-type,
    /// :authority, :path).
    fn first_request_block(authority: &[u8]) -> Vec<u8> {
        let mut b = vec![0x83, 0x86]; // :method POST, :scheme http
        b.push(0x44); // :path, name from the static table, value literal, indexed
        b.extend(string(GET_INFO));
        b.push(0x41); // :authority likewise
        b.extend(string(authority));
        b.push(0x40 | 31); // content-type
        b.extend(string(b"application/grpc"));
        b.push(0x40); // te, a new name
        b.extend(string(b"te"));
        b.extend(string(b"trailers"));
        b
    }

    /// The second request on that connection: only the path is new (it becomes entry 62 and
    /// pushes the others down by one), the authority is a reference to the dynamic table.
    fn second_request_block() -> Vec<u8> {
        let mut b = vec![0x83, 0x86, 0x44];
        b.extend(string(NOTIFY));
        b.push(0x80 | 65); // :authority: <socket path>, now entry 65
        b.push(0x80 | 64); // content-type
        b.push(0x80 | 63); // te
        b
    }

    fn grpc_message(body: &[u8]) -> Vec<u8> {
        let mut m = vec![0];
        m.extend((body.len() as u32).to_be_bytes());
        m.extend_from_slice(body);
        m
    }

    /// What a kubelet sends on the registration socket: two calls on one connection.
    fn kubelet_registration_bytes(authority: &[u8]) -> Vec<u8> {
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(0x4, 0, 0, &[])); // SETTINGS
        bytes.extend(frame(
            FRAME_HEADERS,
            FLAG_END_HEADERS,
            1,
            &first_request_block(authority),
        ));
        bytes.extend(frame(0x0, FLAG_END_STREAM, 1, &grpc_message(&[])));
        bytes.extend(frame(
            FRAME_HEADERS,
            FLAG_END_HEADERS,
            3,
            &second_request_block(),
        ));
        bytes.extend(frame(0x0, FLAG_END_STREAM, 3, &grpc_message(&[0x08, 0x01])));
        bytes
    }

    fn decode_all(bytes: &[u8]) -> Vec<Vec<(Vec<u8>, Vec<u8>)>> {
        // Walk the frames of a rewritten stream and decode its header blocks with a fresh
        // decoder, as h2 would.
        let mut decoder = loona_hpack::Decoder::new();
        let mut blocks = Vec::new();
        let mut fragment = Vec::new();
        let mut at = PREFACE.len();
        while at < bytes.len() {
            let len = u32::from_be_bytes([0, bytes[at], bytes[at + 1], bytes[at + 2]]) as usize;
            let (kind, flags) = (bytes[at + 3], bytes[at + 4]);
            let payload = &bytes[at + FRAME_HEADER_LEN..at + FRAME_HEADER_LEN + len];
            if kind == FRAME_HEADERS || kind == FRAME_CONTINUATION {
                fragment.extend_from_slice(payload);
                if flags & FLAG_END_HEADERS != 0 {
                    blocks.push(decoder.decode(&fragment).unwrap());
                    fragment.clear();
                }
            }
            at += FRAME_HEADER_LEN + len;
        }
        blocks
    }

    fn authority_of(block: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
        block
            .iter()
            .find(|(n, _)| n == b":authority")
            .map(|(_, v)| v.clone())
            .unwrap()
    }

    fn rewrite(input: &[u8], chunk: usize) -> Vec<u8> {
        let mut rewriter = FrameRewriter::default();
        let (mut pending, mut out) = (Vec::new(), Vec::new());
        for piece in input.chunks(chunk) {
            pending.extend_from_slice(piece);
            let consumed = rewriter.feed(&pending, &mut out).unwrap();
            pending.drain(..consumed);
        }
        assert!(
            pending.is_empty(),
            "every byte is consumed at a frame boundary"
        );
        out
    }

    #[test]
    fn a_socket_path_authority_reads_as_localhost_in_every_request_of_the_connection() {
        let out = rewrite(&kubelet_registration_bytes(REG_SOCKET), 1 << 20);
        let blocks = decode_all(&out);
        assert_eq!(blocks.len(), 2);
        for (block, path) in blocks.iter().zip([GET_INFO, NOTIFY]) {
            assert_eq!(authority_of(block), b"localhost");
            let find = |name: &[u8]| block.iter().find(|(n, _)| n == name).unwrap().1.clone();
            assert_eq!(find(b":path"), path);
            assert_eq!(find(b":method"), b"POST");
            assert_eq!(find(b"content-type"), b"application/grpc");
            assert_eq!(find(b"te"), b"trailers");
        }
        // The DATA frames arrive as sent.
        assert!(out.ends_with(&frame(
            0x0,
            FLAG_END_STREAM,
            3,
            &grpc_message(&[0x08, 0x01])
        )));
    }

    #[test]
    fn a_valid_authority_passes_byte_for_byte() {
        let input = kubelet_registration_bytes(b"localhost");
        assert_eq!(rewrite(&input, 1 << 20), input);
    }

    #[test]
    fn the_result_does_not_depend_on_how_the_bytes_arrive() {
        for input in [
            kubelet_registration_bytes(REG_SOCKET),
            kubelet_registration_bytes(b"localhost"),
        ] {
            let whole = rewrite(&input, 1 << 20);
            for chunk in [1, 2, 7, 9, 10, 100] {
                assert_eq!(rewrite(&input, chunk), whole, "chunks of {chunk}");
            }
        }
    }

    #[test]
    fn an_empty_authority_is_repaired_too() {
        let out = rewrite(&kubelet_registration_bytes(b""), 1 << 20);
        for block in decode_all(&out) {
            assert_eq!(authority_of(&block), b"localhost");
        }
    }

    #[test]
    fn padding_priority_and_continuation_frames_are_understood() {
        let block = first_request_block(REG_SOCKET);
        let (head, tail) = block.split_at(10);
        let mut payload = vec![3]; // pad length
        payload.extend([0x80, 0, 0, 0, 16]); // exclusive dependency on stream 0, weight 16
        payload.extend_from_slice(head);
        payload.extend([0, 0, 0]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(
            FRAME_HEADERS,
            FLAG_PADDED | FLAG_PRIORITY,
            1,
            &payload,
        ));
        input.extend(frame(FRAME_CONTINUATION, FLAG_END_HEADERS, 1, tail));
        let out = rewrite(&input, 5);
        let blocks = decode_all(&out);
        assert_eq!(blocks.len(), 1);
        assert_eq!(authority_of(&blocks[0]), b"localhost");
    }

    #[test]
    fn large_blocks_are_cut_into_frames_h2_accepts() {
        let mut block = first_request_block(REG_SOCKET);
        let big = vec![b'x'; 20_000];
        block.push(0x00);
        block.extend(string(b"x-big"));
        loona_hpack::encoder::encode_integer_into(big.len(), 7, 0, &mut block).unwrap();
        block.extend_from_slice(&big);
        let mut input = PREFACE.to_vec();
        input.extend(frame(FRAME_HEADERS, FLAG_END_HEADERS, 1, &block));
        let out = rewrite(&input, 4096);
        let blocks = decode_all(&out);
        assert_eq!(authority_of(&blocks[0]), b"localhost");
        let mut at = PREFACE.len();
        let mut frames = 0;
        while at < out.len() {
            let len = u32::from_be_bytes([0, out[at], out[at + 1], out[at + 2]]) as usize;
            assert!(len <= MAX_FRAME_PAYLOAD);
            frames += 1;
            at += FRAME_HEADER_LEN + len;
        }
        assert_eq!(frames, 2);
    }

    #[test]
    fn oversized_or_broken_header_blocks_end_the_connection() {
        let mut rewriter = FrameRewriter::default();
        let mut input = PREFACE.to_vec();
        input.extend(frame(FRAME_HEADERS, FLAG_END_HEADERS, 1, &[0x80 | 70]));
        let err = rewriter.feed(&input, &mut Vec::new()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("HPACK"), "{err}");

        let mut rewriter = FrameRewriter::default();
        let mut input = PREFACE.to_vec();
        input.extend(&((MAX_HEADER_BLOCK + 1) as u32).to_be_bytes()[1..]);
        input.extend([FRAME_HEADERS, 0, 0, 0, 0, 1]);
        let err = rewriter.feed(&input, &mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("header frame"), "{err}");
    }

    #[test]
    fn a_client_without_the_preface_is_left_to_h2() {
        let input = b"GET / HTTP/1.1\r\nHost: /a/path\r\n\r\n".to_vec();
        assert_eq!(rewrite(&input, 3), input);
    }

    /// The kubelet's bytes through a real h2 server, with and without the repair.
    async fn serve_once(repair: bool) -> Result<Vec<(String, String, Vec<u8>)>, Vec<u8>> {
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let server = tokio::spawn(async move {
            let mut seen = Vec::new();
            let io: Pin<Box<dyn AsyncReadWrite>> = if repair {
                Box::pin(AuthorityRepair::new(server))
            } else {
                Box::pin(server)
            };
            let mut conn = h2::server::handshake(io).await.unwrap();
            while let Some(Ok((request, mut respond))) = conn.accept().await {
                let authority = request.uri().authority().unwrap().to_string();
                let path = request.uri().path().to_string();
                let mut body = request.into_body();
                let mut data = Vec::new();
                while let Some(chunk) = body.data().await {
                    data.extend_from_slice(&chunk.unwrap());
                }
                seen.push((authority, path, data));
                let response = http::Response::builder().status(200).body(()).unwrap();
                respond.send_response(response, true).unwrap();
                if seen.len() == 2 {
                    break;
                }
            }
            seen
        });
        client
            .write_all(&kubelet_registration_bytes(REG_SOCKET))
            .await
            .unwrap();
        // Read what the server sends back for a moment, to find a reset if there is one.
        let mut received = Vec::new();
        let _ = tokio::time::timeout(std::time::Duration::from_millis(300), async {
            let mut buf = [0u8; 4096];
            while let Ok(n) = client.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                received.extend_from_slice(&buf[..n]);
            }
        })
        .await;
        if server.is_finished() {
            Ok(server.await.unwrap())
        } else {
            server.abort();
            Err(received)
        }
    }

    trait AsyncReadWrite: AsyncRead + AsyncWrite + Send {}
    impl<T: AsyncRead + AsyncWrite + Send> AsyncReadWrite for T {}

    #[tokio::test]
    async fn h2_refuses_the_kubelets_registration_call_and_accepts_it_repaired() {
        // Without the repair: no request reaches the service and the client gets
        // RST_STREAM(PROTOCOL_ERROR), which is what the kubelet logged.
        let received = serve_once(false).await.unwrap_err();
        let mut at = 0;
        let mut resets = Vec::new();
        while at + FRAME_HEADER_LEN <= received.len() {
            let len =
                u32::from_be_bytes([0, received[at], received[at + 1], received[at + 2]]) as usize;
            if received[at + 3] == 0x3 {
                let p = &received[at + FRAME_HEADER_LEN..at + FRAME_HEADER_LEN + 4];
                resets.push(u32::from_be_bytes([p[0], p[1], p[2], p[3]]));
            }
            at += FRAME_HEADER_LEN + len;
        }
        assert!(resets.contains(&0x1), "PROTOCOL_ERROR resets: {resets:?}");

        let seen = serve_once(true).await.unwrap();
        assert_eq!(
            seen,
            vec![
                (
                    "localhost".to_string(),
                    String::from_utf8(GET_INFO.to_vec()).unwrap(),
                    grpc_message(&[])
                ),
                (
                    "localhost".to_string(),
                    String::from_utf8(NOTIFY.to_vec()).unwrap(),
                    grpc_message(&[0x08, 0x01])
                ),
            ]
        );
    }
}
