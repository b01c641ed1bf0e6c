//! The activation channel's frames: a fixed header (magic, kind, sequence number, payload
//! length, the payload's XXH3) and the payload. Control frames carry JSON; a step carries
//! its rows, block tables and hidden states in binary, little-endian, the hidden states as
//! exact `f32` (a stage's output is bit for bit what one process computes).
//!
//! A frame that is cut short, too long, of an unknown kind or whose checksum fails ends the
//! connection with a [`WireError`]; nothing of it is used.

use std::io::{Read, Write};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

pub const MAGIC: [u8; 4] = *b"HPS1";
/// magic, kind, 3 reserved bytes, sequence number, payload length, checksum.
pub const HEADER_BYTES: usize = 4 + 1 + 3 + 8 + 4 + 8;
/// The largest payload accepted: a prefill step of 8,192 rows at d = 7,168 is 235 MiB.
pub const MAX_PAYLOAD: usize = 512 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Follower → connecting side: a fresh nonce to prove the token on.
    Challenge = 1,
    /// Connecting side → follower: who it is and what it computes with.
    Hello = 2,
    /// Follower → connecting side: the spans of this stage and those after it.
    Welcome = 3,
    /// Either way: the handshake refused, with why.
    Refuse = 4,
    /// Upstream → follower: the KV pool to hold.
    Setup = 5,
    /// Follower → upstream: the pool is held (every stage after it too).
    Ready = 6,
    /// Upstream → follower: one (micro-)step's rows and hidden states.
    Step = 7,
    /// The last stage → the leader (relayed): a step's logits.
    Result = 8,
    /// A stage → the leader (relayed): a step failed there.
    Failed = 9,
    /// Follower → connecting side: a stage after it is not up yet (try again).
    Unavailable = 10,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            1 => Kind::Challenge,
            2 => Kind::Hello,
            3 => Kind::Welcome,
            4 => Kind::Refuse,
            5 => Kind::Setup,
            6 => Kind::Ready,
            7 => Kind::Step,
            8 => Kind::Result,
            9 => Kind::Failed,
            10 => Kind::Unavailable,
            _ => return None,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("not a pipeline frame (bad magic {0:02x?}): is this a stage's port?")]
    Magic([u8; 4]),
    #[error("unknown frame kind {0}")]
    Kind(u8),
    #[error("a frame of {0} bytes is over the limit")]
    TooLong(usize),
    #[error("frame {seq}'s checksum does not match: damaged in transit")]
    Checksum { seq: u64 },
    #[error("malformed {kind:?} frame: {why}")]
    Malformed { kind: Kind, why: String },
    #[error("expected a {want:?} frame, got {got:?}")]
    Unexpected { want: Kind, got: Kind },
    #[error("refused: {0}")]
    Refused(String),
    #[error("not up yet: {0}")]
    Unavailable(String),
}

impl WireError {
    /// Whether trying again later may succeed (a stage not up yet, a connection lost), as
    /// opposed to a refusal (a wrong token, file or layers).
    pub fn transient(&self) -> bool {
        matches!(self, WireError::Io(_) | WireError::Unavailable(_))
    }
}

#[derive(Debug)]
pub struct Frame {
    pub kind: Kind,
    pub seq: u64,
    pub payload: Vec<u8>,
}

impl Frame {
    /// The payload as a control message of type `T`.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, WireError> {
        serde_json::from_slice(&self.payload).map_err(|e| WireError::Malformed {
            kind: self.kind,
            why: e.to_string(),
        })
    }

    /// The payload of a frame of kind `want`; a `Refuse` or `Failed` instead is its error.
    pub fn expect(self, want: Kind) -> Result<Self, WireError> {
        match self.kind {
            k if k == want => Ok(self),
            Kind::Refuse | Kind::Failed => Err(WireError::Refused(String::from_utf8_lossy(&self.payload).into())),
            Kind::Unavailable => Err(WireError::Unavailable(String::from_utf8_lossy(&self.payload).into())),
            got => Err(WireError::Unexpected { want, got }),
        }
    }
}

/// Writes one frame whose payload is `parts` joined (checksummed as one).
pub fn write_frame(w: &mut impl Write, kind: Kind, seq: u64, parts: &[&[u8]]) -> std::io::Result<()> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    if len > MAX_PAYLOAD {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!(
                "a frame of {len} bytes is over the limit of {MAX_PAYLOAD} (fewer rows per step: --max-batch-tokens)"
            ),
        ));
    }
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    parts.iter().for_each(|p| h.update(p));
    let mut header = [0u8; HEADER_BYTES];
    header[..4].copy_from_slice(&MAGIC);
    header[4] = kind as u8;
    header[8..16].copy_from_slice(&seq.to_le_bytes());
    header[16..20].copy_from_slice(&(len as u32).to_le_bytes());
    header[20..28].copy_from_slice(&h.digest().to_le_bytes());
    w.write_all(&header)?;
    for p in parts {
        w.write_all(p)?;
    }
    w.flush()
}

/// A control frame with a JSON payload.
pub fn write_json(w: &mut impl Write, kind: Kind, msg: &impl Serialize) -> std::io::Result<()> {
    let body = serde_json::to_vec(msg).expect("control messages serialize");
    write_frame(w, kind, 0, &[&body])
}

/// Reads one whole frame, checked.
pub fn read_frame(r: &mut impl Read) -> Result<Frame, WireError> {
    read_frame_within(r, MAX_PAYLOAD)
}

/// The most a handshake's frame may hold (before its sender proved anything).
pub const MAX_HANDSHAKE_PAYLOAD: usize = 64 << 10;

/// [`read_frame`], refusing a payload over `max` bytes before allocating it.
pub fn read_frame_within(r: &mut impl Read, max: usize) -> Result<Frame, WireError> {
    let mut header = [0u8; HEADER_BYTES];
    r.read_exact(&mut header)?;
    let magic: [u8; 4] = header[..4].try_into().expect("4 bytes");
    if magic != MAGIC {
        return Err(WireError::Magic(magic));
    }
    let kind = Kind::from_u8(header[4]).ok_or(WireError::Kind(header[4]))?;
    let seq = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
    let len = u32::from_le_bytes(header[16..20].try_into().expect("4 bytes")) as usize;
    let sum = u64::from_le_bytes(header[20..28].try_into().expect("8 bytes"));
    if len > max {
        return Err(WireError::TooLong(len));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)?;
    if xxhash_rust::xxh3::xxh3_64(&payload) != sum {
        return Err(WireError::Checksum { seq });
    }
    Ok(Frame { kind, seq, payload })
}

/// The connecting side's introduction (proved on the follower's nonce).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hello {
    /// `proof(token, nonce)`, hex (empty when the group has no token).
    pub proof: String,
    /// The connecting side's nonce, for the follower's proof in its `Welcome`.
    pub nonce: String,
    /// [`crate::models::stage::fingerprint`] of the connecting side's file.
    pub fingerprint: u64,
    pub n_layers: usize,
    /// Where the connecting side's layers end: the follower's must start there.
    pub from_layer: usize,
    /// The stages after the follower, in order (it connects to the first).
    pub rest: Vec<String>,
}

impl Hello {
    /// What the proof vouches for.
    pub fn fields(&self) -> String {
        format!(
            "{}|{}|{}|{}|{}",
            self.nonce,
            self.fingerprint,
            self.n_layers,
            self.from_layer,
            self.rest.join(",")
        )
    }
}

/// A stage's answer: its span and those after it, in order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Welcome {
    pub proof: String,
    pub spans: Vec<(usize, usize)>,
}

impl Welcome {
    /// What the proof vouches for.
    pub fn fields(&self) -> String {
        format!("{:?}", self.spans)
    }
}

/// The KV pool every stage holds: the same block ids as the leader's.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Setup {
    pub num_blocks: usize,
    pub block_tokens: usize,
    pub kv_dtype: String,
}

/// A step's rows as the stages after the leader need them.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct StepFrame {
    /// Block copies (forks) to make before the step.
    pub copies: Vec<(u32, u32)>,
    /// Each sequence's block table (as far as the step reads it).
    pub tables: Vec<Vec<u32>>,
    /// Each row's sequence (an index into `tables`), position and token.
    pub rows: Vec<(u32, u32, u32)>,
    pub logit_rows: Vec<u32>,
    /// `rows · d_model` floats.
    pub hidden: Vec<f32>,
}

fn put(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

impl StepFrame {
    /// The step's metadata (everything but the hidden states, sent as their own part).
    pub fn encode_head(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + 8 * self.copies.len() + 12 * self.rows.len());
        for n in [
            self.copies.len(),
            self.tables.len(),
            self.rows.len(),
            self.logit_rows.len(),
        ] {
            put(&mut out, n as u32);
        }
        for &(a, b) in &self.copies {
            put(&mut out, a);
            put(&mut out, b);
        }
        for t in &self.tables {
            put(&mut out, t.len() as u32);
            t.iter().for_each(|&b| put(&mut out, b));
        }
        for &(s, p, t) in &self.rows {
            [s, p, t].into_iter().for_each(|v| put(&mut out, v));
        }
        self.logit_rows.iter().for_each(|&r| put(&mut out, r));
        out
    }

    /// Reads a step of rows `d` wide, checking every index against what it names.
    pub fn decode(payload: &[u8], d: usize) -> Result<Self, WireError> {
        let bad = |why: String| WireError::Malformed { kind: Kind::Step, why };
        let mut at = 0usize;
        let mut next = || -> Result<u32, WireError> {
            let b = payload.get(at..at + 4).ok_or_else(|| bad("cut short".into()))?;
            at += 4;
            Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")))
        };
        let (nc, nt, nr, nl) = (next()? as usize, next()? as usize, next()? as usize, next()? as usize);
        if [nc, nt, nr, nl].iter().any(|&n| n > payload.len() / 4) {
            return Err(bad("counts larger than the frame".into()));
        }
        let mut f = StepFrame::default();
        for _ in 0..nc {
            f.copies.push((next()?, next()?));
        }
        for _ in 0..nt {
            let n = next()? as usize;
            if n > payload.len() / 4 {
                return Err(bad("a block table larger than the frame".into()));
            }
            f.tables.push((0..n).map(|_| next()).collect::<Result<_, _>>()?);
        }
        for _ in 0..nr {
            let (s, p, t) = (next()?, next()?, next()?);
            if s as usize >= nt {
                return Err(bad(format!("row of sequence {s} of {nt}")));
            }
            f.rows.push((s, p, t));
        }
        for _ in 0..nl {
            let r = next()?;
            if r as usize >= nr {
                return Err(bad(format!("logits of row {r} of {nr}")));
            }
            f.logit_rows.push(r);
        }
        let rest = &payload[at..];
        if rest.len() != nr * d * 4 {
            return Err(bad(format!(
                "{} bytes of hidden states for {nr} rows of {d}",
                rest.len()
            )));
        }
        f.hidden = floats(rest);
        Ok(f)
    }
}

/// Little-endian `f32`s as bytes (a copy-free view on little-endian machines).
pub fn float_bytes(v: &[f32]) -> &[u8] {
    crate::kv::pool::as_bytes(v)
}

/// Bytes as little-endian `f32`s.
pub fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

/// Which way a proof goes: a connecting side's `Hello` or a follower's `Welcome` (a proof
/// made for one is never valid as the other).
#[derive(Debug, Clone, Copy)]
pub enum Side {
    Hello,
    Welcome,
}

/// The token's proof on a nonce and the message it vouches for: SHA-256 over a label, the
/// side, the token, the nonce and `fields` (what the message says: file, layers, stages).
/// No token: the empty string.
pub fn proof(token: Option<&str>, side: Side, nonce: &str, fields: &str) -> String {
    use sha2::{Digest, Sha256};
    let Some(token) = token else { return String::new() };
    let mut h = Sha256::new();
    h.update(b"hearth-pipeline-v1\0");
    h.update(match side {
        Side::Hello => &b"hello"[..],
        Side::Welcome => &b"welcome"[..],
    });
    for part in [token, nonce, fields] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `got` is [`proof`]'s answer (compared in constant time). Without a token only
/// the empty proof is.
pub fn proves(token: Option<&str>, side: Side, nonce: &str, fields: &str, got: &str) -> bool {
    let want = proof(token, side, nonce, fields);
    want.len() == got.len() && want.bytes().zip(got.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// A fresh nonce (32 random bytes, hex).
pub fn nonce() -> String {
    let mut b = [0u8; 32];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_err()
    {
        // No urandom: the clock and the process, hashed (a nonce need not be secret).
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let h = xxhash_rust::xxh3::xxh3_128(&[t.to_le_bytes(), u128::from(std::process::id()).to_le_bytes()].concat());
        b[..16].copy_from_slice(&h.to_le_bytes());
    }
    b.iter().map(|b| format!("{b:02x}")).collect()
}

/// The connecting side of a handshake with the stage at the other end of `s`: proves the
/// token on its nonce, introduces the file and the layers before it, and checks the proof
/// it answers with. Returns the spans of that stage and those after it.
pub fn introduce(
    s: &mut std::net::TcpStream,
    token: Option<&str>,
    fingerprint: u64,
    n_layers: usize,
    from_layer: usize,
    rest: &[String],
) -> Result<Vec<(usize, usize)>, WireError> {
    #[derive(Deserialize)]
    struct Challenge {
        nonce: String,
    }
    let challenge: Challenge = read_frame_within(s, MAX_HANDSHAKE_PAYLOAD)?
        .expect(Kind::Challenge)?
        .json()?;
    let mine = nonce();
    let mut hello = Hello {
        proof: String::new(),
        nonce: mine.clone(),
        fingerprint,
        n_layers,
        from_layer,
        rest: rest.to_vec(),
    };
    hello.proof = proof(token, Side::Hello, &challenge.nonce, &hello.fields());
    write_json(s, Kind::Hello, &hello)?;
    let welcome: Welcome = read_frame_within(s, MAX_HANDSHAKE_PAYLOAD)?
        .expect(Kind::Welcome)?
        .json()?;
    if !proves(token, Side::Welcome, &mine, &welcome.fields(), &welcome.proof) {
        return Err(WireError::Refused("the stage did not prove the workers' token".into()));
    }
    Ok(welcome.spans)
}

/// A connection to `addr` (its first address that answers), with the handshake's timeouts.
pub fn connect(addr: &str, timeout: std::time::Duration) -> Result<std::net::TcpStream, WireError> {
    use std::net::ToSocketAddrs;
    let mut last = None;
    for a in addr.to_socket_addrs()? {
        match std::net::TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => {
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(super::HANDSHAKE_TIMEOUT))?;
                s.set_write_timeout(Some(super::HANDSHAKE_TIMEOUT))?;
                return Ok(s);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last
        .unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, format!("{addr} resolves to no address")))
        .into())
}

/// Sends the pool to hold down `s` and waits until every stage holds it.
pub fn set_up(s: &mut std::net::TcpStream, setup: &Setup) -> Result<(), WireError> {
    write_json(s, Kind::Setup, setup)?;
    read_frame_within(s, MAX_HANDSHAKE_PAYLOAD)?.expect(Kind::Ready)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> StepFrame {
        StepFrame {
            copies: vec![(3, 4)],
            tables: vec![vec![1, 2], vec![7]],
            rows: vec![(0, 17, 42), (1, 3, 9)],
            logit_rows: vec![1],
            hidden: (0..8).map(|i| i as f32 * 0.5).collect(),
        }
    }

    #[test]
    fn steps_round_trip_and_damage_is_refused() {
        let f = sample();
        let mut buf = Vec::new();
        write_frame(&mut buf, Kind::Step, 9, &[&f.encode_head(), float_bytes(&f.hidden)]).unwrap();
        let got = read_frame(&mut &buf[..]).unwrap();
        assert_eq!((got.kind, got.seq), (Kind::Step, 9));
        assert_eq!(StepFrame::decode(&got.payload, 4).unwrap(), f);
        // Every cut is an error, never a panic or a short frame.
        for cut in 0..buf.len() {
            assert!(read_frame(&mut &buf[..cut]).is_err(), "cut at {cut}");
        }
        // A flipped byte anywhere in the payload fails the checksum.
        let mut bad = buf.clone();
        bad[HEADER_BYTES + 5] ^= 1;
        assert!(matches!(read_frame(&mut &bad[..]), Err(WireError::Checksum { .. })));
        // Not a frame at all (an HTTP request on the stage port).
        assert!(matches!(
            read_frame(&mut &b"GET / HTTP/1.1\r\nHost: stage\r\n\r\n"[..]),
            Err(WireError::Magic(_))
        ));
        // A length over the limit is refused before anything is allocated.
        let mut long = buf.clone();
        long[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(read_frame(&mut &long[..]), Err(WireError::TooLong(_))));
        // Indices out of range and wrong widths are malformed, whatever the checksum.
        let mut p = got.payload.clone();
        assert!(StepFrame::decode(&p, 3).is_err());
        p[16 + 8 + 4 + 8 + 4 + 4 + 12] = 5; // the second row's sequence
        assert!(StepFrame::decode(&p, 4).is_err());
        for cut in 0..got.payload.len() {
            assert!(StepFrame::decode(&got.payload[..cut], 4).is_err());
        }
    }

    #[test]
    fn proofs_need_the_token_and_the_nonce() {
        let n = nonce();
        assert_eq!(n.len(), 64);
        assert_ne!(n, nonce());
        let p = proof(Some("secret"), Side::Hello, &n, "layers 0..8");
        assert!(proves(Some("secret"), Side::Hello, &n, "layers 0..8", &p));
        assert!(!proves(Some("other"), Side::Hello, &n, "layers 0..8", &p));
        assert!(!proves(Some("secret"), Side::Hello, &nonce(), "layers 0..8", &p));
        // Not valid the other way, nor for other fields.
        assert!(!proves(Some("secret"), Side::Welcome, &n, "layers 0..8", &p));
        assert!(!proves(Some("secret"), Side::Hello, &n, "layers 0..9", &p));
        assert!(!proves(Some("secret"), Side::Hello, &n, "layers 0..8", ""));
        assert!(proves(None, Side::Hello, &n, "layers 0..8", ""));
        assert!(!proves(None, Side::Hello, &n, "layers 0..8", &p));
    }
}
