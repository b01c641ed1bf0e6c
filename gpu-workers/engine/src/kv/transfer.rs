//! Moving a prompt's KV cache between workers (prefill/decode disaggregation): the blocks a
//! prefill computed are exported by their block hashes, with a checksum each, and imported
//! by another engine of the same model and KV layout into its prefix cache. A request for
//! the same prompt there then reuses them as it would reuse its own cached prefix: only the
//! prompt's last (partial) block and last token are computed again, and decoding continues
//! exactly as on the prefill side.
//!
//! Imported blocks are ordinary cached blocks: unreferenced, evictable (least recently used
//! first), announced in the engine's KV events. The checksum catches damage in transit, not
//! a lying peer: only workers holding the shared worker token may export or pull (the
//! worker API checks it). An import stops at the first block it cannot write (bad checksum,
//! wrong size, no block free even by eviction): the request computes it and what follows.
//! A pull guarantees nothing about later: its blocks may be evicted before a request comes.

use std::collections::VecDeque;

use bytes::Bytes;
use hearth_protocol::{BlockHash, GenerateRequest};
use serde::Deserialize;

use crate::kv::block::{BlockData, ImportError, ImportReport, KvBlock, KvLayout, PullReport};

/// Most pieces a received block is kept in (see [`FrameReader`]): reads from a socket are
/// 4–400 KiB, so a 360 KiB block comes in 1–90 pieces; 1,024 bounds what tiny chunks can
/// cost (32 bytes each) without ever joining ordinary ones.
const MAX_PIECES: usize = 1024;

/// Longest block a peer may announce (a guard against hostile lengths).
const MAX_BLOCK_BYTES: usize = 64 << 20;
const MAGIC: &[u8; 4] = b"HKV1";

/// The wire format, a framed byte stream (little-endian):
///
/// | frame | bytes |
/// |---|---|
/// | header | `HKV1`, u32 n, n bytes of JSON `{"layout": KvLayout, "count": blocks}` |
/// | block (× count) | u64 hash, u64 XXH3 of the data, u32 length (`u32::MAX`: not held), the data |
///
/// Each block is checked on import by its checksum, so a corrupted frame costs a recompute,
/// not a wrong answer.
pub fn encode_header(layout: KvLayout, count: usize) -> Vec<u8> {
    let json = serde_json::to_vec(&serde_json::json!({"layout": layout, "count": count})).unwrap_or_default();
    let mut out = MAGIC.to_vec();
    out.extend((json.len() as u32).to_le_bytes());
    out.extend(json);
    out
}

/// One block frame (`None`: the sender does not hold that hash), as one buffer.
pub fn encode_block(hash: BlockHash, block: Option<&KvBlock>) -> Vec<u8> {
    let mut out = Vec::with_capacity(20 + block.map_or(0, |b| b.data.len()));
    for part in block_frame(hash, block) {
        out.extend_from_slice(&part);
    }
    out
}

/// One block frame as pieces to send: its 20-byte head, then the block's own buffers (not
/// copied).
pub fn block_frame(hash: BlockHash, block: Option<&KvBlock>) -> impl Iterator<Item = Bytes> {
    let mut head = Vec::with_capacity(20);
    head.extend(hash.0.to_le_bytes());
    match block {
        Some(b) => {
            head.extend(b.checksum.to_le_bytes());
            head.extend((b.data.len() as u32).to_le_bytes());
        }
        None => {
            head.extend(0u64.to_le_bytes());
            head.extend(u32::MAX.to_le_bytes());
        }
    }
    let data = block.map_or(&[][..], |b| b.data.parts()).to_vec();
    std::iter::once(Bytes::from(head)).chain(data)
}

/// What a frame decodes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Header {
        layout: KvLayout,
        count: usize,
    },
    /// A block, or a hash the sender does not hold.
    Block(BlockHash, Option<KvBlock>),
}

/// Why a transfer failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    #[error("cannot reach {peer}: {detail}")]
    Unreachable { peer: String, detail: String },
    #[error("{peer} sent a malformed stream: {detail}")]
    Malformed { peer: String, detail: String },
    #[error("{peer} stopped sending for {secs} s")]
    Timeout { peer: String, secs: u64 },
    #[error("the stream from {peer} ended after {got} of {want} blocks")]
    Truncated { peer: String, got: usize, want: usize },
}

/// Splits bytes as they arrive into frames. A block's bytes are handed on as the pieces
/// they arrived in (no copy); only frame heads are copied out. After the header, every
/// block frame must have the header's layout's block size.
#[derive(Debug, Default)]
pub struct FrameReader {
    /// Received, not yet framed: the first piece's leading bytes may already be consumed.
    pieces: VecDeque<Bytes>,
    buffered: usize,
    header_seen: bool,
    block_bytes: usize,
}

impl FrameReader {
    /// Appends a copy of `bytes`.
    pub fn push(&mut self, bytes: &[u8]) {
        self.push_bytes(Bytes::copy_from_slice(bytes));
    }

    /// Appends `bytes` as they are (a network chunk: kept, not copied).
    pub fn push_bytes(&mut self, bytes: Bytes) {
        if !bytes.is_empty() {
            self.buffered += bytes.len();
            self.pieces.push_back(bytes);
        }
    }

    /// Copies the first `out.len()` buffered bytes into `out` (the caller checked there are
    /// that many).
    fn peek(&self, out: &mut [u8]) {
        let mut at = 0;
        for p in &self.pieces {
            let n = p.len().min(out.len() - at);
            out[at..at + n].copy_from_slice(&p[..n]);
            at += n;
            if at == out.len() {
                break;
            }
        }
    }

    /// Removes the first `n` buffered bytes (the caller checked there are that many), as
    /// pieces — joined into one buffer if they are more than [`MAX_PIECES`] (a peer sending
    /// tiny chunks costs it a copy, not the receiver memory per piece).
    fn take(&mut self, n: usize) -> BlockData {
        let out = self.take_pieces(n);
        if out.0.len() > MAX_PIECES {
            return BlockData::from(out.to_vec());
        }
        out
    }

    fn take_pieces(&mut self, mut n: usize) -> BlockData {
        self.buffered -= n;
        let mut out = BlockData::default();
        while n > 0 {
            let Some(front) = self.pieces.front_mut() else { break };
            if front.len() <= n {
                n -= front.len();
                if let Some(p) = self.pieces.pop_front() {
                    out.push(p);
                }
            } else {
                out.push(front.split_to(n));
                n = 0;
            }
        }
        out
    }

    /// The next complete frame, if the buffer holds one; an error for malformed bytes.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, String> {
        if !self.header_seen {
            if self.buffered < 8 {
                return Ok(None);
            }
            let mut head = [0u8; 8];
            self.peek(&mut head);
            if &head[..4] != MAGIC {
                return Err("not a Hearth KV stream (bad magic)".into());
            }
            let n = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
            if n > 1 << 20 {
                return Err(format!("header of {n} bytes"));
            }
            if self.buffered < 8 + n {
                return Ok(None);
            }
            self.take(8);
            let json = self.take(n).to_vec();
            #[derive(Deserialize)]
            struct Header {
                layout: KvLayout,
                count: usize,
            }
            let h: Header = serde_json::from_slice(&json).map_err(|e| format!("header: {e}"))?;
            self.header_seen = true;
            self.block_bytes = h.layout.block_bytes();
            if self.block_bytes == 0 || self.block_bytes > MAX_BLOCK_BYTES {
                return Err(format!("a layout of {} bytes per block", self.block_bytes));
            }
            return Ok(Some(Frame::Header {
                layout: h.layout,
                count: h.count,
            }));
        }
        if self.buffered < 20 {
            return Ok(None);
        }
        let mut head = [0u8; 20];
        self.peek(&mut head);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&head[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let hash = BlockHash(u64_at(0));
        let checksum = u64_at(8);
        let len = u32::from_le_bytes([head[16], head[17], head[18], head[19]]);
        if len == u32::MAX {
            self.take(20);
            return Ok(Some(Frame::Block(hash, None)));
        }
        let len = len as usize;
        if len != self.block_bytes {
            return Err(format!("a block of {len} bytes in a layout of {}", self.block_bytes));
        }
        if self.buffered < 20 + len {
            return Ok(None);
        }
        self.take(20);
        let data = self.take(len);
        Ok(Some(Frame::Block(hash, Some(KvBlock { hash, checksum, data }))))
    }
}

/// A stream of frames from a peer, ending with the last block (or an error).
pub type FrameStream = futures_util::stream::BoxStream<'static, Result<Frame, TransferError>>;

/// How a worker fetches KV blocks from another worker. The HTTP implementation
/// ([`HttpKvTransport`]) streams frames over a plain connection; an RDMA/NVLink-class
/// transport (Mooncake's Transfer Engine, NIXL) would implement the same call, moving the
/// bytes between the two pools directly and yielding the same frames (or importing in
/// place).
pub trait KvTransport: Send + Sync + 'static {
    /// The blocks with these hashes from the worker at `peer` serving `model`, as frames:
    /// a header, then one block frame per hash, in order. `release`: the hold (a
    /// prefill-only request's id) the peer releases once the stream ends.
    fn fetch(
        &self,
        peer: &str,
        model: &str,
        hashes: Vec<BlockHash>,
        release: Option<String>,
    ) -> futures_util::future::BoxFuture<'static, Result<FrameStream, TransferError>>;

    /// Makes `peer` release `hold` without fetching anything (the decode side gave up on the
    /// blocks, or the fetch failed before the peer's stream began). Best effort.
    fn release(&self, peer: &str, model: &str, hold: String) -> futures_util::future::BoxFuture<'static, ()>;
}

/// KV blocks between engines of one process (`hearth serve --prefill-workers N
/// --decode-workers M`): `peer` is the exporting engine's name; blocks are copied out of
/// one pool and into the other a batch at a time, with the same frames and checks as
/// over HTTP.
#[derive(Default)]
pub struct LocalKvTransport {
    peers: std::sync::RwLock<std::collections::HashMap<String, crate::engine::EngineHandle>>,
}

impl LocalKvTransport {
    /// Makes `engine` reachable as `name`.
    pub fn add(&self, name: &str, engine: crate::engine::EngineHandle) {
        self.peers
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), engine);
    }
}

/// Releases a hold when dropped: at the end of an export's stream, or when the peer goes
/// away midway.
pub struct HoldRelease(Option<(crate::engine::EngineHandle, String)>);

impl HoldRelease {
    /// Releases `hold` (if any) on `engine` when dropped.
    pub fn new(engine: &crate::engine::EngineHandle, hold: Option<String>) -> Self {
        Self(hold.map(|h| (engine.clone(), h)))
    }
}

impl Drop for HoldRelease {
    fn drop(&mut self) {
        if let Some((engine, hold)) = self.0.take() {
            engine.release_hold(&hold);
        }
    }
}

impl KvTransport for LocalKvTransport {
    fn fetch(
        &self,
        peer: &str,
        _model: &str,
        hashes: Vec<BlockHash>,
        release: Option<String>,
    ) -> futures_util::future::BoxFuture<'static, Result<FrameStream, TransferError>> {
        use futures_util::{FutureExt, StreamExt};
        let engine = self.peers.read().unwrap_or_else(|e| e.into_inner()).get(peer).cloned();
        let peer = peer.to_string();
        async move {
            let engine = engine.ok_or_else(|| TransferError::Unreachable {
                peer: peer.clone(),
                detail: "no such local worker".into(),
            })?;
            let header = Frame::Header {
                layout: engine.kv_layout(),
                count: hashes.len(),
            };
            let guard = HoldRelease::new(&engine, release);
            let batches: Vec<Vec<BlockHash>> = hashes.chunks(TRANSFER_BATCH).map(<[BlockHash]>::to_vec).collect();
            let blocks = futures_util::stream::iter(batches)
                .then(move |batch| {
                    let (engine, peer) = (engine.clone(), peer.clone());
                    async move {
                        match engine.export_blocks(batch.clone()).await {
                            Ok(blocks) => batch
                                .into_iter()
                                .zip(blocks)
                                .map(|(h, b)| Ok(Frame::Block(h, b)))
                                .collect::<Vec<_>>(),
                            Err(e) => vec![Err(TransferError::Unreachable {
                                peer,
                                detail: e.to_string(),
                            })],
                        }
                    }
                })
                .flat_map(futures_util::stream::iter)
                .inspect(move |_| {
                    let _held = &guard;
                });
            Ok(futures_util::stream::once(async move { Ok(header) })
                .chain(blocks)
                .boxed())
        }
        .boxed()
    }

    fn release(&self, peer: &str, _model: &str, hold: String) -> futures_util::future::BoxFuture<'static, ()> {
        use futures_util::FutureExt;
        if let Some(e) = self.peers.read().unwrap_or_else(|e| e.into_inner()).get(peer) {
            e.release_hold(&hold);
        }
        async {}.boxed()
    }
}

/// KV blocks over HTTP: `POST {peer}/v1/worker/m/{model}/kv/export` with the hashes and
/// the worker token, the framed stream back. A peer that stops sending for `idle_timeout`
/// fails the transfer; redirects are not followed.
#[derive(Debug, Clone)]
pub struct HttpKvTransport {
    client: reqwest::Client,
    token: Option<String>,
    pub idle_timeout: std::time::Duration,
}

impl HttpKvTransport {
    /// A transport presenting `token` (the workers' shared token) to peers.
    pub fn new(token: Option<String>) -> Self {
        Self {
            client: reqwest::Client::builder()
                .connect_timeout(std::time::Duration::from_secs(5))
                .redirect(reqwest::redirect::Policy::none())
                .tcp_nodelay(true)
                .build()
                .unwrap_or_default(),
            token: token.filter(|t| !t.is_empty()),
            idle_timeout: std::time::Duration::from_secs(10),
        }
    }

    /// `{peer}/v1/worker/m/{model}/kv/{route}`, the model escaped as a path segment.
    fn url(peer: &str, model: &str, route: &str) -> Option<reqwest::Url> {
        reqwest::Url::parse(peer.trim_end_matches('/')).ok().and_then(|mut u| {
            u.path_segments_mut()
                .ok()?
                .pop_if_empty()
                .extend(["v1", "worker", "m", model, "kv", route]);
            Some(u)
        })
    }
}

impl KvTransport for HttpKvTransport {
    fn release(&self, peer: &str, model: &str, hold: String) -> futures_util::future::BoxFuture<'static, ()> {
        use futures_util::FutureExt;
        let url = Self::url(peer, model, "release");
        let (client, idle, token) = (self.client.clone(), self.idle_timeout, self.token.clone());
        async move {
            let Some(url) = url else { return };
            let mut post = client.post(url).json(&serde_json::json!({ "hold": hold }));
            if let Some(t) = &token {
                post = post.bearer_auth(t);
            }
            match tokio::time::timeout(idle, post.send()).await {
                Ok(Ok(r)) if r.status().is_success() => {}
                other => {
                    let outcome = other.map(|r| r.map(|r| r.status()));
                    tracing::debug!(?outcome, "releasing a KV hold failed (it expires)");
                }
            }
        }
        .boxed()
    }

    fn fetch(
        &self,
        peer: &str,
        model: &str,
        hashes: Vec<BlockHash>,
        release: Option<String>,
    ) -> futures_util::future::BoxFuture<'static, Result<FrameStream, TransferError>> {
        use futures_util::{FutureExt, StreamExt};
        let peer = peer.trim_end_matches('/').to_string();
        let url = Self::url(&peer, model, "export");
        let (client, idle, token) = (self.client.clone(), self.idle_timeout, self.token.clone());
        async move {
            let unreachable = |detail: String| TransferError::Unreachable {
                peer: peer.clone(),
                detail,
            };
            let url = url.ok_or_else(|| unreachable("not a base URL".into()))?;
            let body = serde_json::json!({
                "hashes": hashes.iter().map(|h| h.0).collect::<Vec<_>>(),
                "release": release,
            });
            let mut post = client.post(url).json(&body);
            if let Some(t) = &token {
                post = post.bearer_auth(t);
            }
            let resp = tokio::time::timeout(idle, post.send())
                .await
                .map_err(|_| unreachable("no answer".into()))?
                .map_err(|e| unreachable(e.to_string()))?;
            if !resp.status().is_success() {
                return Err(unreachable(format!("export answered {}", resp.status())));
            }
            let want = hashes.len();
            let bytes = resp.bytes_stream();
            let stream = futures_util::stream::unfold(
                (bytes, FrameReader::default(), 0usize, false, peer),
                move |(mut bytes, mut reader, mut got, mut done, peer)| async move {
                    loop {
                        if done {
                            return None;
                        }
                        match reader.next_frame() {
                            Ok(Some(f)) => {
                                // The header comes first: nothing asked, nothing follows it.
                                if matches!(f, Frame::Block(..)) {
                                    got += 1;
                                }
                                done = got == want;
                                return Some((Ok(f), (bytes, reader, got, done, peer)));
                            }
                            Ok(None) => {}
                            Err(detail) => {
                                let e = TransferError::Malformed {
                                    peer: peer.clone(),
                                    detail,
                                };
                                return Some((Err(e), (bytes, reader, got, true, peer)));
                            }
                        }
                        match tokio::time::timeout(idle, bytes.next()).await {
                            Ok(Some(Ok(chunk))) => reader.push_bytes(chunk),
                            Ok(Some(Err(e))) => {
                                let e = TransferError::Unreachable {
                                    peer: peer.clone(),
                                    detail: e.to_string(),
                                };
                                return Some((Err(e), (bytes, reader, got, true, peer)));
                            }
                            Ok(None) => {
                                let e = TransferError::Truncated {
                                    peer: peer.clone(),
                                    got,
                                    want,
                                };
                                return Some((Err(e), (bytes, reader, got, true, peer)));
                            }
                            Err(_) => {
                                let e = TransferError::Timeout {
                                    peer: peer.clone(),
                                    secs: idle.as_secs(),
                                };
                                return Some((Err(e), (bytes, reader, got, true, peer)));
                            }
                        }
                    }
                },
            );
            Ok(stream.boxed())
        }
        .boxed()
    }
}

/// Blocks per batch, on both sides: bounds the memory a transfer holds — two batches on
/// each side (one being read or imported, one being sent or gathered), about 23 MiB for the
/// default model, plus on the receiving side the socket buffers its pieces keep alive
/// (each at most ~400 KiB) — and lets the engine run steps between batches.
pub const TRANSFER_BATCH: usize = 32;

/// How long a decode half (holding the prefill's blocks) waits for them, in ms: a base plus
/// a share per block. They are its quickest way on.
const HANDOFF_DEADLINE_MS: (u64, u64) = (30_000, 50);

/// How long a peer fetch (no hold) waits, in ms: it only saves a recompute, so a slow
/// holder is given up on sooner and the request computes the rest.
const FETCH_DEADLINE_MS: (u64, u64) = (2_000, 10);

/// Fetches the blocks of `prompt` this engine lacks from `peer` and imports them; then
/// the peer releases `hold` (if any), even when nothing was missing.
pub async fn pull(
    engine: &crate::engine::EngineHandle,
    transport: &dyn KvTransport,
    peer: &str,
    prompt: &[u32],
    cache_namespace: &str,
    hold: Option<&str>,
) -> PullReport {
    use futures_util::StreamExt;
    let started = std::time::Instant::now();
    let hashes = engine.prompt_block_hashes(prompt, cache_namespace);
    let mut report = PullReport {
        blocks: hashes.len(),
        ..Default::default()
    };
    let missing = match engine.missing_blocks(hashes).await {
        Ok(m) => m,
        Err(e) => {
            report.error = Some(e.to_string());
            return report;
        }
    };
    report.missing = missing.len();
    if missing.is_empty() && hold.is_none() {
        return report;
    }
    let model = engine.info().model.clone();
    // The whole transfer is bounded too, not only each pause.
    let (base, per_block) = match hold {
        Some(_) => HANDOFF_DEADLINE_MS,
        None => FETCH_DEADLINE_MS,
    };
    let deadline =
        tokio::time::Instant::now() + std::time::Duration::from_millis(base + per_block * missing.len() as u64);
    let fetch = transport.fetch(peer, &model, missing.clone(), hold.map(str::to_string));
    let mut frames = match tokio::time::timeout_at(deadline, fetch).await {
        Ok(Ok(f)) => f,
        Ok(Err(e)) => {
            report.error = Some(e.to_string());
            return report;
        }
        Err(_) => {
            report.error = Some(format!("{peer} did not answer in time"));
            return report;
        }
    };
    let mut import = Importer::new(engine);
    let mut fail = None;
    let mut next = 0usize;
    loop {
        let frame = match tokio::time::timeout_at(deadline, frames.next()).await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(_) => {
                fail = Some(format!("the transfer from {peer} did not finish in time"));
                break;
            }
        };
        let malformed = |what: String| Some(format!("{peer} sent {what}"));
        match frame {
            Ok(Frame::Header { layout: l, count }) => {
                if l != engine.kv_layout() {
                    fail = malformed(format!("another KV layout ({l:?})"));
                    break;
                }
                if count != missing.len() {
                    fail = malformed(format!("{count} blocks for {} asked", missing.len()));
                    break;
                }
                import.layout = Some(l);
            }
            // Frames answer the hashes asked, in order; anything else ends the transfer.
            Ok(Frame::Block(h, block)) => {
                if missing.get(next) != Some(&h) {
                    fail = malformed("a block that was not asked for".into());
                    break;
                }
                next += 1;
                let Some(b) = block else {
                    // Not held there: what follows cannot be reused here.
                    report.not_held += 1;
                    break;
                };
                match import.push(b).await {
                    Ok(true) => {}
                    Ok(false) => break, // a block could not be imported: stop there
                    Err(e) => {
                        fail = Some(e);
                        break;
                    }
                }
            }
            Err(e) => {
                fail = Some(e.to_string());
                break;
            }
        }
    }
    // What arrived intact before a failure is still good (each block is checked on its own).
    let (imported, e) = import.finish().await;
    report.import = imported;
    if let Some(e) = e {
        fail.get_or_insert(e);
    }
    report.error = fail;
    report.seconds = started.elapsed().as_secs_f64();
    report
}

/// Before a request with a `kv_source` starts on this engine (a disaggregated decode half,
/// or a peer fetch): fetches the blocks of its prompt this engine lacks from the source
/// and imports them, in the span
/// `kv_transfer`, counted in the engine's transfer metrics. Whatever does not arrive intact
/// is computed by the request itself, so a failure costs time, never correctness.
pub async fn prepare(
    engine: &crate::engine::EngineHandle,
    transport: &dyn KvTransport,
    req: &GenerateRequest,
    worker: &str,
    parent: &opentelemetry::Context,
) -> Option<PullReport> {
    let src = req.kv_source.as_ref()?;
    let started = std::time::SystemTime::now();
    // No hold: a peer fetch (the router found the prefix cached there), not a decode half.
    let hold = Some(src.hold.as_str()).filter(|h| !h.is_empty());
    // Only the blocks the holder has (a prompt's block covers tokens before its last one).
    let prompt = match src.tokens as usize {
        0 => &req.prompt[..],
        n => &req.prompt[..(n + 1).min(req.prompt.len())],
    };
    let report = pull(engine, transport, &src.worker, prompt, &req.kv_namespace(), hold).await;
    if report.error.is_some() && hold.is_some() {
        // The peer's export may never have begun (busy, unreachable): its hold ends now.
        transport.release(&src.worker, &req.model, src.hold.clone()).await;
    }
    crate::worker::telemetry::record_transfer(parent, worker, &req.request_id, started, &report);
    let m = engine.metrics();
    m.transfer.observe(report.seconds);
    m.transfer_bytes.inc_by(report.import.bytes);
    m.transfer_blocks.inc_by(report.import.imported as u64);
    let broken = report.error.is_some() || !report.import.rejected.is_empty() || report.not_held > 0;
    if broken {
        m.transfer_failures.inc();
        tracing::warn!(
            request_id = %req.request_id,
            source = %src.worker,
            error = report.error.as_deref().unwrap_or(""),
            rejected = report.import.rejected.len(),
            not_held = report.not_held,
            "KV transfer incomplete: this worker computes the rest"
        );
    } else {
        tracing::debug!(request_id = %req.request_id, blocks = report.import.imported, bytes = report.import.bytes, seconds = report.seconds, "KV blocks received");
    }
    Some(report)
}

/// A transfer's blocks imported a batch at a time, in chain order: one batch is in the
/// engine's hands (written into its pool) while the next arrives. A block refused in one
/// batch is seen when the next batch is full, so up to one batch more is received and
/// dropped. The chain check (`after`) is made when a batch starts: a batch that evicts
/// an earlier block of the same transfer (a pool smaller than the prompt) still leaves a
/// gap, as before pipelining; the request then computes from the gap on.
struct Importer<'a> {
    engine: &'a crate::engine::EngineHandle,
    /// The stream's layout, once its header came.
    layout: Option<KvLayout>,
    batch: Vec<KvBlock>,
    /// The last block handed to the engine: the next batch continues its chain.
    last: Option<BlockHash>,
    pending: Option<tokio::sync::oneshot::Receiver<ImportReport>>,
    total: ImportReport,
}

impl<'a> Importer<'a> {
    fn new(engine: &'a crate::engine::EngineHandle) -> Self {
        Self {
            engine,
            layout: None,
            batch: Vec::with_capacity(TRANSFER_BATCH),
            last: None,
            pending: None,
            total: ImportReport::default(),
        }
    }

    /// Adds a block, handing a full batch to the engine; Ok(false) once a block could not be
    /// imported (the chain is broken there: nothing after it is worth receiving).
    async fn push(&mut self, block: KvBlock) -> Result<bool, String> {
        self.batch.push(block);
        if self.batch.len() < TRANSFER_BATCH {
            return Ok(true);
        }
        self.hand_over().await
    }

    /// Waits for the batch in the engine's hands, then gives it the one gathered here.
    async fn hand_over(&mut self) -> Result<bool, String> {
        if !self.settle().await? {
            self.batch.clear();
            return Ok(false);
        }
        if self.batch.is_empty() {
            return Ok(true);
        }
        let layout = self.layout.ok_or("blocks before the header")?;
        let batch = std::mem::take(&mut self.batch);
        let last = batch.last().map(|b| b.hash);
        let pending = self
            .engine
            .start_import(layout, batch, self.last)
            .map_err(|e| e.to_string())?;
        self.pending = Some(pending);
        self.last = last;
        Ok(true)
    }

    /// The report of the batch in the engine's hands, added up; false if it stopped short.
    async fn settle(&mut self) -> Result<bool, String> {
        let Some(pending) = self.pending.take() else {
            return Ok(true);
        };
        let r = pending.await.map_err(|_| ImportError::Stopped.to_string())?;
        self.total.imported += r.imported;
        self.total.already_held += r.already_held;
        self.total.bytes += r.bytes;
        let whole = r.rejected.is_empty();
        self.total.rejected.extend(r.rejected);
        Ok(whole)
    }

    /// Imports what is left; the whole report, and an error if the engine refused.
    async fn finish(mut self) -> (ImportReport, Option<String>) {
        let mut error = self.hand_over().await.err();
        if let Err(e) = self.settle().await {
            error.get_or_insert(e);
        }
        (self.total, error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::block::KvDtypeName;
    use crate::models::Arch;

    #[test]
    fn frames_round_trip_in_any_chunking() {
        let layout = KvLayout {
            arch: Arch::Llama,
            rope: 1,
            n_layers: 2,
            kv_dim: 4,
            head_dim: 2,
            block_tokens: 16,
            dtype: KvDtypeName::F16,
            latent: false,
        };
        let a = KvBlock::new(
            BlockHash(7),
            (0..layout.block_bytes()).map(|i| i as u8).collect::<Vec<u8>>(),
        );
        let mut bytes = encode_header(layout, 2);
        bytes.extend(encode_block(BlockHash(7), Some(&a)));
        bytes.extend(encode_block(BlockHash(9), None));
        for chunk in [1, 3, 17, 1000] {
            let mut r = FrameReader::default();
            let mut frames = Vec::new();
            for c in bytes.chunks(chunk) {
                r.push(c);
                while let Some(f) = r.next_frame().unwrap() {
                    frames.push(f);
                }
            }
            // The block arrives in pieces (no copy), and its checksum holds across them.
            match &frames[1] {
                Frame::Block(_, Some(b)) => {
                    let parts = b.data.parts();
                    if layout.block_bytes().div_ceil(chunk) > MAX_PIECES {
                        assert_eq!(parts.len(), 1, "tiny pieces are joined");
                    } else {
                        assert!(parts.iter().all(|p| p.len() <= chunk), "never joined");
                    }
                    assert!(b.intact());
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(
                frames,
                [
                    Frame::Header { layout, count: 2 },
                    Frame::Block(BlockHash(7), Some(a.clone())),
                    Frame::Block(BlockHash(9), None)
                ]
            );
        }
        let mut bad = FrameReader::default();
        bad.push(b"GET / HTTP/1.1\r\n");
        assert!(bad.next_frame().is_err());
        let mut huge = FrameReader::default();
        huge.push(&encode_header(layout, 1));
        huge.next_frame().unwrap();
        let mut frame = 1u64.to_le_bytes().to_vec();
        frame.extend(0u64.to_le_bytes());
        frame.extend(((MAX_BLOCK_BYTES + 1) as u32).to_le_bytes());
        huge.push(&frame);
        assert!(
            huge.next_frame().is_err(),
            "a hostile length is refused before allocating"
        );
        let mut short = FrameReader::default();
        short.push(&encode_header(layout, 1));
        short.next_frame().unwrap();
        short.push(&encode_block(
            BlockHash(1),
            Some(&KvBlock::new(BlockHash(1), vec![0u8; 10])),
        ));
        assert!(short.next_frame().is_err(), "a block of another size than the layout's");
    }
}
