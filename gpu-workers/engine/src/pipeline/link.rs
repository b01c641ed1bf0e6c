//! The leader's end of the activation channel ([`StageLink`]): it connects the group,
//! sends each step's rows to stage 2 (cut into micro-batches, so that the stages compute
//! at once) and takes the logits back from the last stage.

use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::kv::pool::KvPool;
use crate::models::stage::StageSpan;
use crate::models::{Batch, ForwardScratch, Model, StageInput};

use super::wire::{self, connect, Frame, Kind, Setup, StepFrame, WireError};
use super::{PipelineConfig, AUTO_MICROBATCH_ROWS, MIN_MICROBATCH_ROWS, STEP_TIMEOUT};

/// A connected group.
struct Conn {
    stream: TcpStream,
    results: mpsc::Receiver<Result<Frame, WireError>>,
    /// Set by the reader when the connection ends.
    broken: Arc<AtomicBool>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

/// A group joined: the connection to stage 2 and every stage's layers, the leader's first.
type Joined = (TcpStream, Vec<(usize, usize)>);

/// A launched step: each micro-batch's frame number and its rows of logits.
#[derive(Debug)]
pub struct Ticket(Vec<(u64, usize)>);

/// The leader's link to the stages after it.
pub struct StageLink {
    cfg: PipelineConfig,
    fingerprint: u64,
    span: StageSpan,
    conn: Option<Conn>,
    /// A connection whose stages wait for their pool (at start).
    pending: Option<TcpStream>,
    /// A reconnection under way on its own thread.
    rejoining: Option<mpsc::Receiver<Result<Joined, WireError>>>,
    /// The pool every stage holds (fixed at start).
    setup: Option<Setup>,
    /// Every stage's layers, the leader's first (from the last handshake).
    spans: Vec<(usize, usize)>,
    last_try: Instant,
    /// The group was lost since [`StageLink::take_lost`] was last asked.
    lost: bool,
    /// Block copies made on the leader since the last step, for the other stages.
    copies: Vec<(u32, u32)>,
    seq: u64,
}

impl StageLink {
    /// Connects to the group (retrying until `cfg.connect_timeout`): returns the link and
    /// the most layers any stage holds (what sizes the KV pools).
    pub fn connect(cfg: PipelineConfig, model: &Model, fingerprint: u64) -> Result<(Self, usize), String> {
        let mut link = Self {
            cfg,
            fingerprint,
            span: model.span(),
            conn: None,
            pending: None,
            rejoining: None,
            setup: None,
            spans: Vec::new(),
            last_try: Instant::now(),
            lost: false,
            copies: Vec::new(),
            seq: 0,
        };
        let deadline = Instant::now() + link.cfg.connect_timeout;
        loop {
            match link.handshake() {
                Ok(()) => break,
                // A refusal is final: the group is misconfigured.
                Err(e) if !e.transient() || Instant::now() >= deadline => return Err(link.described(e)),
                Err(e) => {
                    tracing::debug!(error = %e, "pipeline stages not up yet");
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
        let most = link.spans.iter().map(|(a, b)| b.saturating_sub(*a)).max().unwrap_or(0);
        Ok((link, most))
    }

    fn described(&self, e: WireError) -> String {
        format!(
            "pipeline stage 2 at {}: {e}",
            self.cfg.next.first().map_or("?", |s| s.as_str())
        )
    }

    /// Introduces the leader to stage 2 (here, on the engine thread: at start) and sets
    /// the pools up when their size is known.
    fn handshake(&mut self) -> Result<(), WireError> {
        let (s, spans) = join(&self.cfg, self.fingerprint, self.span, self.setup.as_ref())?;
        self.spans = spans;
        match self.setup {
            Some(_) => self.attach(s)?,
            // Set up by `set_up` once the leader has sized its pool.
            None => self.pending = Some(s),
        }
        Ok(())
    }

    /// Sets every stage's pool up (the leader's block count) and starts taking results.
    pub fn set_up(&mut self, setup: Setup) -> Result<(), String> {
        let mut s = self.pending.take().ok_or("the pipeline is not connected")?;
        wire::set_up(&mut s, &setup).map_err(|e| self.described(e))?;
        self.setup = Some(setup);
        self.attach(s).map_err(|e| e.to_string())
    }

    /// Starts the reader of results on a set-up connection.
    fn attach(&mut self, s: TcpStream) -> Result<(), WireError> {
        s.set_read_timeout(None)?;
        s.set_write_timeout(Some(STEP_TIMEOUT))?;
        let (tx, rx) = mpsc::channel();
        let broken = Arc::new(AtomicBool::new(false));
        let mut reader = s.try_clone()?;
        let flag = broken.clone();
        std::thread::Builder::new()
            .name("hearth-pipeline-rx".into())
            .spawn(move || loop {
                let f = wire::read_frame(&mut reader);
                let end = f.is_err();
                if tx.send(f).is_err() || end {
                    flag.store(true, Ordering::Release);
                    return;
                }
            })?;
        self.conn = Some(Conn {
            stream: s,
            results: rx,
            broken,
        });
        tracing::info!(stages = ?self.spans, "pipeline group connected");
        Ok(())
    }

    /// Whether the group is whole.
    pub fn connected(&self) -> bool {
        self.conn.as_ref().is_some_and(|c| !c.broken.load(Ordering::Acquire))
    }

    /// Notices a lost group, and reconnects one (at most a try a second).
    pub fn upkeep(&mut self) {
        if self.conn.as_ref().is_some_and(|c| c.broken.load(Ordering::Acquire)) {
            self.lose("the connection to stage 2 ended");
        }
        if self.conn.is_some() {
            return;
        }
        // A reconnection runs on its own thread (a stage that hangs in the handshake holds
        // it, not the engine); its result is taken here.
        if let Some(rx) = &self.rejoining {
            match rx.try_recv() {
                Err(mpsc::TryRecvError::Empty) => return,
                Ok(Ok((s, spans))) => {
                    self.rejoining = None;
                    self.spans = spans;
                    match self.attach(s) {
                        Ok(()) => tracing::info!("pipeline group whole again"),
                        Err(e) => tracing::warn!(error = %e, "pipeline group rejoined but lost again"),
                    }
                    return;
                }
                Ok(Err(e)) => tracing::debug!(error = %e, "pipeline group still incomplete"),
                Err(mpsc::TryRecvError::Disconnected) => {}
            }
            self.rejoining = None;
        }
        if self.last_try.elapsed() < Duration::from_secs(1) {
            return;
        }
        self.last_try = Instant::now();
        let (tx, rx) = mpsc::channel();
        let (cfg, fingerprint, span, setup) = (self.cfg.clone(), self.fingerprint, self.span, self.setup.clone());
        let spawned = std::thread::Builder::new()
            .name("hearth-pipeline-join".into())
            .spawn(move || {
                let _ = tx.send(join(&cfg, fingerprint, span, setup.as_ref()));
            });
        if spawned.is_ok() {
            self.rejoining = Some(rx);
        }
    }

    /// Whether the group was lost since last asked (every stage's KV is then to be
    /// forgotten).
    pub fn take_lost(&mut self) -> bool {
        std::mem::take(&mut self.lost)
    }

    /// Gives the group up: the connection is closed, the loss reported once to
    /// [`Self::take_lost`], and the group set up afresh when it reconnects.
    pub fn lose(&mut self, why: &str) {
        if self.conn.take().is_some() {
            tracing::error!(
                error = why,
                "pipeline group lost: failing its requests until it is whole"
            );
            self.lost = true;
            self.copies.clear();
        }
    }

    /// A block copy on the leader's pool, made on every stage before the next step.
    pub fn copy_block(&mut self, from: u32, to: u32) {
        self.copies.push((from, to));
    }

    /// How many stages the group has: the steps a leader keeps in flight.
    pub fn depth(&self) -> usize {
        self.cfg.next.len() + 1
    }

    /// One step: [`Self::launch`] then [`Self::finish`].
    pub fn forward(
        &mut self,
        model: &Model,
        pool: &mut KvPool,
        scratch: &mut ForwardScratch,
        b: &Batch<'_>,
    ) -> Result<Vec<f32>, String> {
        let ticket = self.launch(model, pool, scratch, b)?;
        self.finish(&ticket, model.config.vocab_size)
    }

    /// Micro-batches for a step of `t` rows: configured, else one per 64 rows (at most 8),
    /// so that a long prefill flows through the stages while a decode step stays whole
    /// (its rows share each weight read; decode steps overlap across lanes instead).
    fn microbatches(&self, t: usize) -> usize {
        match self.cfg.microbatches {
            0 => (t / AUTO_MICROBATCH_ROWS).clamp(1, 8),
            m if t >= 2 * MIN_MICROBATCH_ROWS => m.clamp(1, t / MIN_MICROBATCH_ROWS),
            _ => 1,
        }
    }

    /// Starts a step: the leader's layers, micro-batch by micro-batch, each sent on as it
    /// is done. Its logits are [`Self::finish`]'s, in launch order.
    pub fn launch(
        &mut self,
        model: &Model,
        pool: &mut KvPool,
        scratch: &mut ForwardScratch,
        b: &Batch<'_>,
    ) -> Result<Ticket, String> {
        if !self.connected() {
            self.lose("the connection to stage 2 ended");
            return Err("the pipeline group is incomplete".into());
        }
        let t = b.tokens.len();
        let m = self.microbatches(t);
        let bt = pool.block_tokens();
        let mut sent = Vec::with_capacity(m);
        for i in 0..m {
            let rows = i * t / m..(i + 1) * t / m;
            let logit_rows: Vec<usize> = b
                .logit_rows
                .iter()
                .filter(|&&r| rows.contains(&r))
                .map(|&r| r - rows.start)
                .collect();
            let sub = Batch {
                tokens: &b.tokens[rows.clone()],
                positions: &b.positions[rows.clone()],
                tables: &b.tables[rows.clone()],
                logit_rows: &logit_rows,
                adapters: &[],
            };
            let hidden = model
                .forward_stage(&sub, StageInput::Tokens, pool, scratch, &mut |_| false)
                .expect("a step that is never stopped completes");
            let mut frame = StepFrame {
                copies: if i == 0 {
                    std::mem::take(&mut self.copies)
                } else {
                    Vec::new()
                },
                logit_rows: logit_rows.iter().map(|&r| r as u32).collect(),
                ..StepFrame::default()
            };
            for r in 0..sub.tokens.len() {
                let same = r > 0 && std::ptr::eq(sub.tables[r], sub.tables[r - 1]);
                if !same {
                    // As much of the table as the step reads (its rows are in order).
                    let last = (r..sub.tokens.len())
                        .take_while(|&z| z == r || std::ptr::eq(sub.tables[z], sub.tables[r]))
                        .map(|z| sub.positions[z])
                        .max()
                        .unwrap_or(0);
                    let table = sub.tables[r];
                    frame.tables.push(table[..(last / bt + 1).min(table.len())].to_vec());
                }
                // (The tokens stay with the leader: later stages compute on hidden states.)
                frame
                    .rows
                    .push(((frame.tables.len() - 1) as u32, sub.positions[r] as u32, 0));
            }
            self.seq += 1;
            let head = frame.encode_head();
            let conn = self.conn.as_mut().expect("connected");
            let bytes = wire::float_bytes(&hidden);
            if let Err(e) = wire::write_frame(&mut conn.stream, Kind::Step, self.seq, &[&head, bytes]) {
                self.lose(&e.to_string());
                return Err(format!("sending a step to stage 2: {e}"));
            }
            sent.push((self.seq, logit_rows.len()));
        }
        Ok(Ticket(sent))
    }

    /// A launched step's logits (every micro-batch's, in order).
    pub fn finish(&mut self, ticket: &Ticket, vocab: usize) -> Result<Vec<f32>, String> {
        if self.conn.is_none() {
            return Err("the pipeline group was lost with this step in flight".into());
        }
        let n_logits: usize = ticket.0.iter().map(|(_, n)| n).sum();
        let mut logits = Vec::with_capacity(n_logits * vocab);
        for &(seq, n) in &ticket.0 {
            let conn = self.conn.as_mut().expect("connected");
            let frame = match conn.results.recv_timeout(STEP_TIMEOUT) {
                Ok(Ok(f)) => f,
                Ok(Err(e)) => {
                    self.lose(&e.to_string());
                    return Err(format!("the pipeline's stages: {e}"));
                }
                Err(_) => {
                    self.lose("no result in time");
                    return Err(format!("no logits from the last stage in {STEP_TIMEOUT:?}"));
                }
            };
            match frame.kind {
                Kind::Result if frame.seq == seq && frame.payload.len() == n * vocab * 4 => {
                    logits.extend(wire::floats(&frame.payload));
                }
                Kind::Failed => {
                    // A stage could not compute the step: its KV (and what is in flight
                    // after it) is in doubt, so the group is dropped and set up afresh.
                    let why = String::from_utf8_lossy(&frame.payload).into_owned();
                    self.lose(&why);
                    return Err(why);
                }
                _ => {
                    let why = format!(
                        "frame {} ({:?}, {} bytes) where step {seq}'s logits were due",
                        frame.seq,
                        frame.kind,
                        frame.payload.len()
                    );
                    self.lose(&why);
                    return Err(why);
                }
            }
        }
        Ok(logits)
    }
}

/// Introduces a leader of layers `span` to its stage 2 (which connects on), checks that the
/// stages cover every layer once, in order, and sets their pools up if `setup` is given.
/// Returns the connection and every stage's layers, the leader's first.
fn join(cfg: &PipelineConfig, fingerprint: u64, span: StageSpan, setup: Option<&Setup>) -> Result<Joined, WireError> {
    let first = cfg
        .next
        .first()
        .ok_or_else(|| WireError::Refused("a pipeline needs the addresses of its other stages".into()))?;
    let mut s = connect(first, Duration::from_secs(2))?;
    let n = span.n_layers;
    let spans = wire::introduce(&mut s, cfg.token.as_deref(), fingerprint, n, span.end, &cfg.next[1..])?;
    let mut all = vec![(span.start, span.end)];
    all.extend(spans);
    let covered = all.iter().all(|(a, b)| a < b)
        && all.windows(2).all(|w| w[0].1 == w[1].0)
        && all.last().is_some_and(|l| l.1 == n);
    if !covered || all.len() != cfg.next.len() + 1 {
        return Err(WireError::Refused(format!(
            "the stages' layers {all:?} do not cover the model's {n} layers once, in order"
        )));
    }
    if let Some(setup) = setup {
        wire::set_up(&mut s, setup)?;
    }
    Ok((s, all))
}
