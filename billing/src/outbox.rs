//! The usage outbox: an append-only local log of usage records, written before a response
//! ends and emptied into the database by the ledger's writer.
//!
//! Each process appends to its own segment files, `usage-outbox-<pid>-<start ms>-<seq>.jsonl`,
//! one JSON record per line, and holds an exclusive lock on every segment it has open. A
//! segment is deleted once all its records are committed to the database. Segments left
//! by a process that died (their lock is free) are replayed — idempotently, records are
//! keyed by request id — by the next process that opens the same directory, and records a
//! live process could not commit (the database was down) are replayed by that process once
//! the database is back.
//!
//! Durability: a record is appended with one `write` before the client receives the end of
//! its response, so a crash of the process (SIGKILL, panic, OOM) loses nothing. Surviving a
//! power cut would need an fsync per append, which this does not do.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use hearth_tenants::now_ms;

use crate::UsageRecord;

const PREFIX: &str = "usage-outbox-";
const SUFFIX: &str = ".jsonl";
/// Records per segment before a new one is started.
const SEGMENT_RECORDS: usize = 20_000;

struct Segment {
    file: File,
    path: PathBuf,
    /// Appended and not yet committed.
    outstanding: usize,
    /// Some record in it could not be committed: it must be replayed from the file.
    deferred: bool,
}

struct State {
    seq: u64,
    lines: usize,
    segments: HashMap<u64, Segment>,
}

pub struct Outbox {
    dir: PathBuf,
    tag: String,
    state: Mutex<State>,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox").field("dir", &self.dir).finish_non_exhaustive()
    }
}

fn open_segment(path: &Path) -> std::io::Result<File> {
    let f = OpenOptions::new().create(true).append(true).open(path)?;
    f.try_lock()
        .map_err(|e| std::io::Error::other(format!("locking {}: {e}", path.display())))?;
    Ok(f)
}

/// Records of a segment file (unreadable lines are logged and skipped).
pub(crate) fn read_segment(path: &Path) -> std::io::Result<Vec<UsageRecord>> {
    let text = std::fs::read_to_string(path)?;
    Ok(text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .filter_map(|l| match serde_json::from_str(l) {
            Ok(r) => Some(r),
            Err(e) => {
                // A torn last line from a crash mid-write: the client never got its answer.
                tracing::warn!(error = %e, file = %path.display(), "unreadable outbox line skipped");
                None
            }
        })
        .collect())
}

impl Outbox {
    pub fn open(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let tag = format!("{}-{}", std::process::id(), now_ms());
        let o = Self {
            dir: dir.to_path_buf(),
            tag,
            state: Mutex::new(State {
                seq: 0,
                lines: 0,
                segments: HashMap::new(),
            }),
        };
        {
            let mut st = o.lock();
            let seg = o.new_segment(0)?;
            st.segments.insert(0, seg);
        }
        Ok(o)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn new_segment(&self, seq: u64) -> std::io::Result<Segment> {
        let path = self.dir.join(format!("{PREFIX}{}-{seq:06}{SUFFIX}", self.tag));
        Ok(Segment {
            file: open_segment(&path)?,
            path,
            outstanding: 0,
            deferred: false,
        })
    }

    /// Appends a record; returns its segment. Durable against a process crash on return.
    pub fn append(&self, rec: &UsageRecord) -> std::io::Result<u64> {
        let mut line = serde_json::to_vec(rec)?;
        line.push(b'\n');
        let mut st = self.lock();
        if st.lines >= SEGMENT_RECORDS {
            self.rotate(&mut st)?;
        }
        let seq = st.seq;
        let seg = st
            .segments
            .get_mut(&seq)
            .ok_or_else(|| std::io::Error::other("no current outbox segment"))?;
        seg.file.write_all(&line)?;
        seg.outstanding += 1;
        st.lines += 1;
        Ok(seq)
    }

    fn rotate(&self, st: &mut State) -> std::io::Result<()> {
        let next = st.seq + 1;
        let seg = self.new_segment(next)?;
        st.segments.insert(next, seg);
        let old = st.seq;
        st.seq = next;
        st.lines = 0;
        Self::retire_if_done(st, old);
        Ok(())
    }

    fn retire_if_done(st: &mut State, seq: u64) {
        if seq == st.seq {
            return;
        }
        if let Some(s) = st.segments.get(&seq) {
            if s.outstanding == 0 && !s.deferred {
                if let Some(s) = st.segments.remove(&seq) {
                    let _ = std::fs::remove_file(&s.path);
                }
            }
        }
    }

    /// A record of `seq` is in the database.
    pub fn committed(&self, seq: u64) {
        let mut st = self.lock();
        if let Some(s) = st.segments.get_mut(&seq) {
            s.outstanding = s.outstanding.saturating_sub(1);
        }
        Self::retire_if_done(&mut st, seq);
    }

    /// A record of `seq` could not be committed; it stays in the file for a later replay.
    pub fn defer(&self, seq: u64) {
        let mut st = self.lock();
        if let Some(s) = st.segments.get_mut(&seq) {
            s.outstanding = s.outstanding.saturating_sub(1);
            s.deferred = true;
        }
    }

    /// This process's segments with deferred records, made non-current first (so nothing is
    /// appended to them while they are replayed).
    pub fn deferred_segments(&self) -> std::io::Result<Vec<(u64, PathBuf)>> {
        let mut st = self.lock();
        let cur = st.seq;
        if st.segments.get(&cur).is_some_and(|s| s.deferred) {
            self.rotate(&mut st)?;
        }
        Ok(st
            .segments
            .iter()
            .filter(|(_, s)| s.deferred)
            .map(|(k, s)| (*k, s.path.clone()))
            .collect())
    }

    /// A deferred segment was replayed into the database: its remaining records there are
    /// either committed already or will be (and are idempotent); drop the file once no
    /// append is outstanding.
    pub fn replayed(&self, seq: u64) {
        let mut st = self.lock();
        if let Some(s) = st.segments.get_mut(&seq) {
            s.deferred = false;
        }
        Self::retire_if_done(&mut st, seq);
    }

    /// Segment files of other processes that are gone (their lock is free), each locked.
    pub fn abandoned(&self) -> Vec<(PathBuf, File)> {
        abandoned_in(&self.dir, Some(&self.tag))
    }
}

/// Outbox segments in `dir` whose owner is gone, locked by the caller; `skip` is the
/// caller's own tag.
pub fn abandoned_in(dir: &Path, skip: Option<&str>) -> Vec<(PathBuf, File)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if !name.starts_with(PREFIX) || !name.ends_with(SUFFIX) {
            continue;
        }
        if skip.is_some_and(|t| name.starts_with(&format!("{PREFIX}{t}-"))) {
            continue;
        }
        let path = e.path();
        let Ok(f) = OpenOptions::new().read(true).append(true).open(&path) else {
            continue;
        };
        if f.try_lock().is_ok() {
            out.push((path, f));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}
