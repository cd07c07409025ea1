//! The kubelet's plugin watcher dials a registration socket with its file path as the gRPC target,
//! so grpc-go sends that path as the HTTP/2 `:authority`
//! (`/var/lib/kubelet/plugins_registry/gpu.tessera.dev-reg.sock`). That is not a valid authority,
//! and the `h2` crate under tonic resets every such request with `PROTOCOL_ERROR` (kubelet:
//! "failed to get plugin info using RPC GetInfo ... PROTOCOL_ERROR"; Kubernetes issue 109081,
//! h2 pull request 487, open). Go servers accept it, so the kubelet never changed.
//!
//! This relay sits between the kubelet and the registration server: bytes from the server pass
//! through untouched; from the kubelet, every frame passes through except header blocks, which are
//! decoded (HPACK, with the connection's own table), given `:authority: localhost` when theirs is
//! not a valid authority, and encoded again for the server. Only the registration socket needs it:
//! the kubelet dials the DRA socket as `unix:` URL, with authority `localhost`.

use std::io;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The client connection preface of HTTP/2.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The largest frame a peer may send before SETTINGS say otherwise (RFC 9113, section 4.2); every frame
/// the relay writes stays within it.
const MAX_FRAME: usize = 16_384;
/// The largest frame the relay accepts from the kubelet (its own SETTINGS are h2's defaults, so
/// anything larger is a protocol error anyway).
const MAX_READ_FRAME: usize = 1 << 20;
/// The largest header block it assembles from CONTINUATION frames.
const MAX_HEADER_BLOCK: usize = 1 << 20;
/// What replaces an authority that is not one.
const LOCALHOST: &[u8] = b"localhost";

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_owned())
}

/// A valid `:authority`: what `h2` accepts (`http::uri::Authority`).
fn valid_authority(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

/// The header block with `:authority` made valid, re-encoded with `encoder`.
fn rewrite_block(
    decoder: &mut hpack::Decoder<'static>,
    encoder: &mut hpack::Encoder<'static>,
    block: &[u8],
) -> io::Result<Vec<u8>> {
    // The HPACK crate unwraps inside its decoder on some malformed input; the connection is
    // closed then, never the plugin.
    let decoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| decoder.decode(block)))
        .map_err(|_| invalid("undecodable header block"))?;
    let headers = decoded.map_err(|e| invalid(&format!("undecodable header block: {e:?}")))?;
    let fixed: Vec<(Vec<u8>, Vec<u8>)> = headers
        .into_iter()
        .map(|(name, value)| {
            if name == b":authority" && !valid_authority(&value) {
                (name, LOCALHOST.to_vec())
            } else {
                (name, value)
            }
        })
        .collect();
    Ok(encoder.encode(fixed.iter().map(|(n, v)| (n.as_slice(), v.as_slice()))))
}

fn frame_header(len: usize, kind: u8, flags: u8, stream: u32) -> [u8; 9] {
    let l = (len as u32).to_be_bytes();
    let s = stream.to_be_bytes();
    [l[1], l[2], l[3], kind, flags, s[0], s[1], s[2], s[3]]
}

async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> io::Result<Option<([u8; 9], Vec<u8>)>> {
    let mut head = [0u8; 9];
    match r.read_exact(&mut head).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    if len > MAX_READ_FRAME {
        return Err(invalid("frame larger than the relay accepts"));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload).await?;
    Ok(Some((head, payload)))
}

/// Copies the kubelet's side of one connection to the server, fixing header blocks.
pub async fn relay_client_to_server<R, W>(mut from: R, mut to: W) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut preface = [0u8; 24];
    from.read_exact(&mut preface).await?;
    if &preface != PREFACE {
        return Err(invalid("not an HTTP/2 connection preface"));
    }
    to.write_all(&preface).await?;
    let mut decoder = hpack::Decoder::new();
    let mut encoder = hpack::Encoder::new();
    while let Some((head, payload)) = read_frame(&mut from).await? {
        let (kind, flags) = (head[3], head[4]);
        if kind != HEADERS {
            to.write_all(&head).await?;
            to.write_all(&payload).await?;
            to.flush().await?;
            continue;
        }
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut rest: &[u8] = &payload;
        if flags & PADDED != 0 {
            let (&pad, tail) = rest
                .split_first()
                .ok_or_else(|| invalid("empty padded frame"))?;
            rest = tail
                .get(..tail.len().saturating_sub(pad as usize))
                .filter(|_| (pad as usize) <= tail.len())
                .ok_or_else(|| invalid("padding longer than the frame"))?;
        }
        let priority = if flags & PRIORITY != 0 {
            let (p, tail) = rest
                .split_at_checked(5)
                .ok_or_else(|| invalid("short priority fields"))?;
            rest = tail;
            p.to_vec()
        } else {
            Vec::new()
        };
        let mut block = rest.to_vec();
        let mut done = flags & END_HEADERS != 0;
        while !done {
            let (h, p) = read_frame(&mut from)
                .await?
                .ok_or_else(|| invalid("connection closed inside a header block"))?;
            if h[3] != CONTINUATION {
                return Err(invalid("a header block interrupted by another frame"));
            }
            block.extend_from_slice(&p);
            if block.len() > MAX_HEADER_BLOCK {
                return Err(invalid("header block too large"));
            }
            done = h[4] & END_HEADERS != 0;
        }
        let fixed = rewrite_block(&mut decoder, &mut encoder, &block)?;
        // One HEADERS frame, then CONTINUATION frames if the block is larger than a frame.
        let room = MAX_FRAME - priority.len();
        let (first, mut tail) = fixed.split_at(fixed.len().min(room));
        let end = if tail.is_empty() { END_HEADERS } else { 0 };
        let first_flags = (flags & (END_STREAM | PRIORITY)) | end;
        to.write_all(&frame_header(
            priority.len() + first.len(),
            HEADERS,
            first_flags,
            stream,
        ))
        .await?;
        to.write_all(&priority).await?;
        to.write_all(first).await?;
        while !tail.is_empty() {
            let (chunk, next) = tail.split_at(tail.len().min(MAX_FRAME));
            let end = if next.is_empty() { END_HEADERS } else { 0 };
            to.write_all(&frame_header(chunk.len(), CONTINUATION, end, stream))
                .await?;
            to.write_all(chunk).await?;
            tail = next;
        }
        to.flush().await?;
    }
    to.shutdown().await
}

/// Relays one connection both ways until either side closes.
pub async fn relay<C, S>(client: C, server: S) -> io::Result<()>
where
    C: AsyncRead + AsyncWrite + Unpin,
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (client_read, mut client_write) = tokio::io::split(client);
    let (mut server_read, server_write) = tokio::io::split(server);
    let up = relay_client_to_server(client_read, server_write);
    let down = async {
        tokio::io::copy(&mut server_read, &mut client_write).await?;
        client_write.shutdown().await
    };
    // Either direction ending ends the connection (gRPC closes both together).
    tokio::select! {
        r = up => r,
        r = down => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers_frame(block: &[u8], flags: u8, stream: u32) -> Vec<u8> {
        let mut f = frame_header(block.len(), HEADERS, flags, stream).to_vec();
        f.extend_from_slice(block);
        f
    }

    /// Runs the relay over `input` and returns what the server side received.
    async fn through(input: Vec<u8>) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        relay_client_to_server(input.as_slice(), &mut out).await?;
        Ok(out)
    }

    fn decoded_blocks(mut bytes: &[u8]) -> Vec<Vec<(Vec<u8>, Vec<u8>)>> {
        assert_eq!(&bytes[..24], PREFACE);
        bytes = &bytes[24..];
        let mut decoder = hpack::Decoder::new();
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let len = u32::from_be_bytes([0, bytes[0], bytes[1], bytes[2]]) as usize;
            let (kind, payload) = (bytes[3], &bytes[9..9 + len]);
            if kind == HEADERS {
                out.push(decoder.decode(payload).unwrap());
            }
            bytes = &bytes[9 + len..];
        }
        out
    }

    #[tokio::test]
    async fn a_socket_path_authority_becomes_localhost_and_indexed_repeats_do_too() {
        let mut client = hpack::Encoder::new();
        let request = |path: &[u8]| -> Vec<(Vec<u8>, Vec<u8>)> {
            vec![
                (b":method".to_vec(), b"POST".to_vec()),
                (b":scheme".to_vec(), b"http".to_vec()),
                (b":path".to_vec(), path.to_vec()),
                (
                    b":authority".to_vec(),
                    b"/var/lib/kubelet/plugins_registry/gpu.tessera.dev-reg.sock".to_vec(),
                ),
                (b"content-type".to_vec(), b"application/grpc".to_vec()),
            ]
        };
        let mut input = PREFACE.to_vec();
        // SETTINGS passes through untouched.
        input.extend_from_slice(&frame_header(0, 0x4, 0, 0));
        for (stream, path) in [
            (1, &b"/pluginregistration.Registration/GetInfo"[..]),
            (3, b"/x"),
        ] {
            let h = request(path);
            // The second block refers to the first's dynamic-table entries.
            let block = client.encode(h.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
            input.extend(headers_frame(&block, END_HEADERS, stream));
        }
        let out = through(input).await.unwrap();
        assert_eq!(&out[24..33], &frame_header(0, 0x4, 0, 0));
        let blocks = decoded_blocks(&out);
        assert_eq!(blocks.len(), 2);
        for b in &blocks {
            let authority = b.iter().find(|(n, _)| n == b":authority").unwrap();
            assert_eq!(authority.1, LOCALHOST);
            assert!(
                b.iter()
                    .any(|(n, v)| n == b"content-type" && v == b"application/grpc")
            );
        }
    }

    #[tokio::test]
    async fn a_valid_authority_padding_priority_and_continuations_are_handled() {
        let mut client = hpack::Encoder::new();
        let h: Vec<(&[u8], &[u8])> = vec![
            (b":method", b"POST"),
            (b":authority", b"localhost:50051"),
            (b"x-big", &[b'a'; 20_000]),
        ];
        let block = client.encode(h.iter().copied());
        let (one, two) = block.split_at(100);
        let mut input = PREFACE.to_vec();
        // HEADERS with padding and priority, continued.
        let mut payload = vec![3u8];
        payload.extend_from_slice(&[0, 0, 0, 0, 16]);
        payload.extend_from_slice(one);
        payload.extend_from_slice(&[0, 0, 0]);
        input.extend(frame_header(
            payload.len(),
            HEADERS,
            PADDED | PRIORITY | END_STREAM,
            1,
        ));
        input.extend(payload);
        input.extend(frame_header(two.len(), CONTINUATION, END_HEADERS, 1));
        input.extend_from_slice(two);
        let out = through(input).await.unwrap();
        // Re-framed: HEADERS (with priority) then CONTINUATIONs, none above 16 KiB.
        let mut bytes = &out[24..];
        let mut block = Vec::new();
        let mut frames = 0;
        while !bytes.is_empty() {
            let len = u32::from_be_bytes([0, bytes[0], bytes[1], bytes[2]]) as usize;
            assert!(len <= MAX_FRAME);
            let mut payload = &bytes[9..9 + len];
            if frames == 0 {
                assert_eq!(bytes[3], HEADERS);
                assert_eq!(bytes[4] & (END_STREAM | PRIORITY), END_STREAM | PRIORITY);
                payload = &payload[5..];
            } else {
                assert_eq!(bytes[3], CONTINUATION);
            }
            block.extend_from_slice(payload);
            frames += 1;
            bytes = &bytes[9 + len..];
        }
        assert!(frames >= 2);
        let decoded = hpack::Decoder::new().decode(&block).unwrap();
        assert_eq!(
            decoded[1],
            (b":authority".to_vec(), b"localhost:50051".to_vec())
        );
        assert_eq!(decoded[2].1.len(), 20_000);
    }

    #[tokio::test]
    async fn broken_input_ends_the_connection_without_a_panic() {
        for input in [
            b"GET / HTTP/1.1\r\n\r\n and more bytes".to_vec(),
            [
                PREFACE.to_vec(),
                headers_frame(&[0xff, 0xff, 0xff], END_HEADERS, 1),
            ]
            .concat(),
            [
                PREFACE.to_vec(),
                frame_header(1, HEADERS, PADDED | END_HEADERS, 1).to_vec(),
                vec![9],
            ]
            .concat(),
            [
                PREFACE.to_vec(),
                frame_header(0, HEADERS, 0, 1).to_vec(),
                frame_header(0, 0, 0, 1).to_vec(),
            ]
            .concat(),
        ] {
            assert!(through(input).await.is_err());
        }
        // A clean close after whole frames is not an error.
        assert!(through(PREFACE.to_vec()).await.is_ok());
    }
}
