//! A follower stage ([`serve`]): it listens for its upstream (the leader, or the stage
//! before it), checks who connects, connects on to the stages after it, holds a KV pool
//! for its layers and computes every step it is sent.
//!
//! One upstream at a time: a newcomer that proves the token replaces the current one (a
//! leader that restarted); one that does not is refused and changes nothing. A session's
//! end (its upstream or downstream gone) drops its pool: the next session starts empty.

use std::net::{Shutdown, TcpListener, TcpStream};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use crate::kv::pool::{default_kv_cache_mib, KvDtype, KvPool};
use crate::models::{Batch, ForwardScratch, Model, StageInput};

use super::wire::{self, Frame, Hello, Kind, Setup, Side, StepFrame, Welcome, WireError};
use super::HANDSHAKE_TIMEOUT;

/// Handshakes a follower runs at once; more connections are dropped unanswered.
const MAX_HANDSHAKES: usize = 8;

/// What a follower serves with.
pub struct StageOptions {
    /// [`crate::models::stage::fingerprint`] of its file.
    pub fingerprint: u64,
    /// The workers' token (None: an upstream without one is taken, with the right file
    /// and layers; for loopback groups only).
    pub token: Option<String>,
    /// The most KV cache this stage holds (None: a quarter of available memory).
    pub kv_cache_mib: Option<usize>,
    pub threads: usize,
}

/// Serves `model` (a stage after the first) on `listener` until the process ends.
pub fn serve(listener: TcpListener, model: Model, opts: StageOptions) -> std::io::Result<()> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.threads.max(1))
        .thread_name(|i| format!("hearth-stage-{i}"))
        .build()
        .map_err(std::io::Error::other)?;
    let opts = Arc::new(opts);
    let span = model.span();
    let n_layers = model.config.n_layers;
    let (tx, rx) = mpsc::channel::<(TcpStream, Hello)>();
    // The current session's upstream: shut down when a newcomer proves itself.
    let current: Arc<Mutex<Option<TcpStream>>> = Arc::default();
    // Handshakes under way (each its own thread, bounded in time): at most a few.
    let greeting = Arc::new(AtomicUsize::new(0));
    {
        let (opts, current) = (opts.clone(), current.clone());
        std::thread::Builder::new()
            .name("hearth-stage-accept".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    let Ok(conn) = conn else {
                        // Out of descriptors, say: do not spin.
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    };
                    if greeting.fetch_add(1, Ordering::AcqRel) >= MAX_HANDSHAKES {
                        greeting.fetch_sub(1, Ordering::AcqRel);
                        tracing::warn!("too many handshakes at once; connection dropped");
                        continue;
                    }
                    let (opts, current, tx, greeting) = (opts.clone(), current.clone(), tx.clone(), greeting.clone());
                    std::thread::spawn(move || {
                        let peer = conn.peer_addr().map_or_else(|_| "?".into(), |a| a.to_string());
                        let greeted = greet(conn, &opts, span.start, n_layers);
                        greeting.fetch_sub(1, Ordering::AcqRel);
                        match greeted {
                            Ok((conn, hello)) => {
                                if let Some(old) = current.lock().expect("not poisoned").take() {
                                    tracing::warn!(%peer, "a new upstream replaces the current one");
                                    let _ = old.shutdown(Shutdown::Both);
                                }
                                let _ = tx.send((conn, hello));
                            }
                            Err(e) => tracing::warn!(%peer, error = %e, "refused a connection to this stage"),
                        }
                    });
                }
            })?;
    }
    tracing::info!(%span, "pipeline stage ready for its upstream");
    for (conn, hello) in rx {
        if let Ok(c) = conn.try_clone() {
            *current.lock().expect("not poisoned") = Some(c);
        }
        let peer = conn.peer_addr().map_or_else(|_| "?".into(), |a| a.to_string());
        tracing::info!(%peer, "upstream connected");
        match session(conn, hello, &model, &opts, &pool) {
            Ok(()) => tracing::info!(%peer, "upstream closed the session"),
            Err(e) => tracing::warn!(%peer, error = %e, "session ended"),
        }
        // However it ended, the upstream sees it end (not a silence until its timeout).
        if let Some(up) = current.lock().expect("not poisoned").take() {
            let _ = up.shutdown(Shutdown::Both);
        }
    }
    Ok(())
}

/// The follower's side of the handshake's first half: a nonce out, a proved `Hello` in,
/// for the same file and the layers just before this stage's.
fn greet(
    mut conn: TcpStream,
    opts: &StageOptions,
    start: usize,
    n_layers: usize,
) -> Result<(TcpStream, Hello), WireError> {
    conn.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    conn.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    conn.set_nodelay(true)?;
    let nonce = wire::nonce();
    wire::write_json(&mut conn, Kind::Challenge, &serde_json::json!({ "nonce": nonce }))?;
    let hello: Hello = wire::read_frame_within(&mut conn, wire::MAX_HANDSHAKE_PAYLOAD)?
        .expect(Kind::Hello)?
        .json()?;
    let refusal = if !wire::proves(
        opts.token.as_deref(),
        Side::Hello,
        &nonce,
        &hello.fields(),
        &hello.proof,
    ) {
        Some("the workers' token was not proved".to_string())
    } else if hello.fingerprint != opts.fingerprint || hello.n_layers != n_layers {
        Some(format!(
            "a different model file (fingerprint {:016x}, {} layers; this stage has {:016x}, {n_layers} layers): every stage serves the same file",
            hello.fingerprint, hello.n_layers, opts.fingerprint
        ))
    } else if hello.from_layer != start {
        Some(format!(
            "the stage before this one ends at layer {}, this one starts at {start}: the group's stages must follow each other",
            hello.from_layer
        ))
    } else {
        None
    };
    if let Some(why) = refusal {
        let _ = wire::write_frame(&mut conn, Kind::Refuse, 0, &[why.as_bytes()]);
        return Err(WireError::Refused(why));
    }
    Ok((conn, hello))
}

/// One upstream's session: the rest of the handshake, then every step it sends.
fn session(
    mut up: TcpStream,
    hello: Hello,
    model: &Model,
    opts: &StageOptions,
    threads: &rayon::ThreadPool,
) -> Result<(), WireError> {
    let span = model.span();
    let refuse = |up: &mut TcpStream, why: String| -> WireError {
        let _ = wire::write_frame(up, Kind::Refuse, 0, &[why.as_bytes()]);
        WireError::Refused(why)
    };
    // The stages after this one.
    let mut down = None;
    let mut spans = vec![(span.start, span.end)];
    if let Some(next) = hello.rest.first() {
        match connect_next(next, model, opts, span.end, &hello.rest[1..]) {
            Ok((s, more)) => {
                spans.extend(more);
                down = Some(s);
            }
            Err(e) if e.transient() => {
                let why = format!("the stage after this one ({next}): {e}");
                let _ = wire::write_frame(&mut up, Kind::Unavailable, 0, &[why.as_bytes()]);
                return Err(WireError::Unavailable(why));
            }
            Err(e) => return Err(refuse(&mut up, format!("the stage after this one ({next}): {e}"))),
        }
    } else if !span.last() {
        return Err(refuse(
            &mut up,
            format!("this stage ({span}) is not the last, and no stage after it was named"),
        ));
    }
    let mut welcome = Welcome {
        proof: String::new(),
        spans,
    };
    welcome.proof = wire::proof(opts.token.as_deref(), Side::Welcome, &hello.nonce, &welcome.fields());
    wire::write_json(&mut up, Kind::Welcome, &welcome)?;
    let setup: Setup = wire::read_frame_within(&mut up, wire::MAX_HANDSHAKE_PAYLOAD)?
        .expect(Kind::Setup)?
        .json()?;
    let dtype = KvDtype::parse(&setup.kv_dtype).map_err(|e| refuse(&mut up, e))?;
    if setup.block_tokens == 0 || setup.block_tokens > 1 << 16 || setup.num_blocks == 0 {
        return Err(refuse(
            &mut up,
            format!("a pool of {} blocks of {} tokens", setup.num_blocks, setup.block_tokens),
        ));
    }
    let shape = model.kv_shape(setup.block_tokens);
    let budget = opts.kv_cache_mib.unwrap_or_else(default_kv_cache_mib);
    let mib = KvPool::block_bytes(shape, dtype)
        .checked_mul(setup.num_blocks)
        .map_or(usize::MAX, |b| b.div_ceil(1 << 20));
    if mib > budget {
        return Err(refuse(
            &mut up,
            format!(
                "the leader's {} KV blocks need {mib} MiB for this stage's {} layers, over its KV budget of {budget} MiB: raise --kv-cache-mib on this stage or lower it on the leader",
                setup.num_blocks,
                span.len()
            ),
        ));
    }
    let mut pool = KvPool::new(shape, dtype, setup.num_blocks);
    if let Some(d) = down.as_mut() {
        if let Err(e) = wire::set_up(d, &setup) {
            return Err(refuse(&mut up, format!("the stage after this one: {e}")));
        }
    }
    wire::write_frame(&mut up, Kind::Ready, 0, &[])?;
    tracing::info!(%span, blocks = setup.num_blocks, kv_cache_mib = mib, "pipeline session set up");
    up.set_read_timeout(None)?;
    up.set_write_timeout(None)?;
    // What this stage writes upstream (results it relays, failures of its own) goes through
    // one lock, frame by frame.
    let up_writer = Arc::new(Mutex::new(up.try_clone()?));
    let relay = match &down {
        Some(d) => {
            let (mut from, to) = (d.try_clone()?, up_writer.clone());
            let up_close = up.try_clone()?;
            Some(std::thread::spawn(move || {
                let end = relay_results(&mut from, &to);
                // The stages after this one are gone: so is this session.
                let _ = up_close.shutdown(Shutdown::Both);
                end
            }))
        }
        None => None,
    };
    let mut scratch = ForwardScratch::default();
    let d = model.config.d_model;
    let end = loop {
        let frame = match wire::read_frame(&mut up) {
            Ok(f) => f,
            Err(WireError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => break Ok(()),
            Err(e) => break Err(e),
        };
        if frame.kind != Kind::Step {
            break Err(WireError::Unexpected {
                want: Kind::Step,
                got: frame.kind,
            });
        }
        let step = match StepFrame::decode(&frame.payload, d) {
            Ok(s) => s,
            Err(e) => break Err(e),
        };
        if let Some(bad) = step
            .copies
            .iter()
            .flat_map(|&(a, b)| [a, b])
            .chain(step.tables.iter().flatten().copied())
            .find(|&b| b as usize >= pool.num_blocks())
        {
            break Err(WireError::Malformed {
                kind: Kind::Step,
                why: format!("block {bad} of a pool of {}", pool.num_blocks()),
            });
        }
        let head_len = frame.payload.len() - step.hidden.len() * 4;
        let out = threads
            .install(|| std::panic::catch_unwind(AssertUnwindSafe(|| compute(model, &mut pool, &mut scratch, step))));
        let out = match out {
            Ok(r) => r,
            Err(_) => Err("the stage panicked computing the step".to_string()),
        };
        let sent = match (out, down.as_mut()) {
            (Ok(hidden), Some(d)) => wire::write_frame(
                d,
                Kind::Step,
                frame.seq,
                &[&frame.payload[..head_len], wire::float_bytes(&hidden)],
            ),
            (Ok(logits), None) => {
                let mut w = up_writer.lock().expect("not poisoned");
                wire::write_frame(&mut *w, Kind::Result, frame.seq, &[wire::float_bytes(&logits)])
            }
            (Err(why), _) => {
                tracing::error!(%span, error = %why, "a step failed on this stage");
                let why = format!("stage {span}: {why}");
                let mut w = up_writer.lock().expect("not poisoned");
                wire::write_frame(&mut *w, Kind::Failed, frame.seq, &[why.as_bytes()])
            }
        };
        if let Err(e) = sent {
            break Err(e.into());
        }
    };
    if let Some(d) = &down {
        let _ = d.shutdown(Shutdown::Both);
    }
    if let Some(r) = relay {
        let _ = r.join();
    }
    end
}

/// One step on this stage: its copies made, its layers computed over the hidden states;
/// the hidden states out, or (the last stage) the logits.
fn compute(
    model: &Model,
    pool: &mut KvPool,
    scratch: &mut ForwardScratch,
    step: StepFrame,
) -> Result<Vec<f32>, String> {
    let bt = pool.block_tokens();
    for &(from, to) in &step.copies {
        pool.copy_block(from, to);
    }
    let mut tokens = Vec::with_capacity(step.rows.len());
    let mut positions = Vec::with_capacity(step.rows.len());
    let mut tables: Vec<&[u32]> = Vec::with_capacity(step.rows.len());
    for &(seq, pos, tok) in &step.rows {
        let table = &step.tables[seq as usize][..];
        if pos as usize / bt >= table.len() {
            return Err(format!("position {pos} past its block table of {}", table.len()));
        }
        tokens.push(tok);
        positions.push(pos as usize);
        tables.push(table);
    }
    let logit_rows: Vec<usize> = step.logit_rows.iter().map(|&r| r as usize).collect();
    let batch = Batch {
        tokens: &tokens,
        positions: &positions,
        tables: &tables,
        logit_rows: &logit_rows,
        adapters: &[],
    };
    Ok(model
        .forward_stage(&batch, StageInput::Hidden(step.hidden), pool, scratch, &mut |_| false)
        .expect("a step that is never stopped completes"))
}

/// Connects to the stage after this one and introduces this stage to it.
fn connect_next(
    addr: &str,
    model: &Model,
    opts: &StageOptions,
    end: usize,
    rest: &[String],
) -> Result<(TcpStream, Vec<(usize, usize)>), WireError> {
    let mut s = wire::connect(addr, HANDSHAKE_TIMEOUT)?;
    let spans = wire::introduce(
        &mut s,
        opts.token.as_deref(),
        opts.fingerprint,
        model.config.n_layers,
        end,
        rest,
    )?;
    Ok((s, spans))
}

/// Passes results and failures from the stages after this one to the one before it.
fn relay_results(from: &mut TcpStream, to: &Mutex<TcpStream>) -> Result<(), WireError> {
    loop {
        let f: Frame = wire::read_frame(from)?;
        if !matches!(f.kind, Kind::Result | Kind::Failed) {
            return Err(WireError::Unexpected {
                want: Kind::Result,
                got: f.kind,
            });
        }
        let mut w = to.lock().expect("not poisoned");
        wire::write_frame(&mut *w, f.kind, f.seq, &[&f.payload])?;
    }
}
