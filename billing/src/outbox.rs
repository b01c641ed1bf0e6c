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
//! **Admission marks.** When a request is dispatched, a provisional line (`{"admitted":
//! record}`) goes into the outbox first, with what is known then (the prompt's tokens). It
//! holds its segment until the request's final record is appended (anywhere). Replaying a
//! dead process's segments, a request with a mark and no final record is recorded as
//! `interrupted` (the gateway died while serving it: the client got part of an answer, and
//! the prompt is billed) — so a gateway killed mid-stream leaves no request unbilled. A live
//! process never replays its own marks (their requests may still be running).
//!
//! Durability ([`Durability`]): by default a record is appended with one `write` before the
//! client receives the end of its response, so a crash of the process (SIGKILL, panic, OOM)
//! loses nothing. `fsync` also flushes it to disk before the response ends, group-committed
//! (one `fdatasync` covers every record appended while the previous one ran), so a power cut
//! loses nothing either.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use hearth_tenants::now_ms;

use crate::UsageRecord;

/// How far a record is made durable before its response ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// Written to the file (survives a crash of the process).
    #[default]
    Write,
    /// Written and flushed to disk (survives a power cut), group-committed.
    Fsync,
}

impl Durability {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "write" => Ok(Self::Write),
            "fsync" => Ok(Self::Fsync),
            other => Err(format!("unknown usage durability {other:?} (write or fsync)")),
        }
    }
}

/// One outbox line: a request's final record, or its admission mark.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
enum Line {
    Admitted { admitted: UsageRecord },
    Record(UsageRecord),
}

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
    /// A write failed part-way (the disk filled up): the next line starts on a new line.
    torn: bool,
}

struct State {
    seq: u64,
    lines: usize,
    segments: HashMap<u64, Segment>,
    /// Lines appended by this process (a ticket for [`Outbox::sync_to`]).
    appended: u64,
    /// Segments written since the last fsync.
    dirty: Vec<u64>,
}

/// Group commit: how far the outbox is flushed to disk.
#[derive(Default)]
struct Synced {
    upto: u64,
    running: bool,
}

pub struct Outbox {
    dir: PathBuf,
    tag: String,
    state: Mutex<State>,
    pub durability: Durability,
    synced: Mutex<Synced>,
    synced_cv: std::sync::Condvar,
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

/// What replaying some segments records.
#[derive(Debug, Default)]
pub(crate) struct Replay {
    /// Final records.
    pub records: Vec<UsageRecord>,
    /// Admission marks without a final record among the segments read.
    pub unfinished: Vec<UsageRecord>,
}

impl Replay {
    /// The records to write: the final ones, and — when the marks' process is gone — each
    /// unfinished request as `interrupted`.
    pub fn into_records(self, with_unfinished: bool) -> Vec<UsageRecord> {
        let mut out = self.records;
        if with_unfinished {
            out.extend(self.unfinished.into_iter().map(|mut r| {
                r.status = crate::UsageStatus::Interrupted.as_str().into();
                r.error_code = Some("gateway_interrupted".into());
                r.completion_tokens = 0;
                r
            }));
        }
        out
    }
}

/// The lines of segment files, in order (unreadable lines are logged and skipped).
pub(crate) fn read_segments(paths: &[PathBuf]) -> std::io::Result<Replay> {
    let mut records = Vec::new();
    let mut marks: Vec<UsageRecord> = Vec::new();
    for path in paths {
        let text = String::from_utf8_lossy(&std::fs::read(path)?).into_owned();
        for l in text.lines().filter(|l| !l.trim().is_empty()) {
            match serde_json::from_str::<Line>(l) {
                Ok(Line::Record(r)) => records.push(r),
                Ok(Line::Admitted { admitted }) => marks.push(admitted),
                Err(e) => {
                    // A torn line from a crash (or a full disk) mid-write: the client never
                    // got its answer.
                    tracing::warn!(error = %e, file = %path.display(), "unreadable outbox line skipped");
                }
            }
        }
    }
    let finished: std::collections::HashSet<&str> = records.iter().map(|r| r.request_id.as_str()).collect();
    let mut seen = std::collections::HashSet::new();
    let unfinished: Vec<UsageRecord> = marks
        .into_iter()
        .filter(|m| !finished.contains(m.request_id.as_str()) && seen.insert(m.request_id.clone()))
        .collect();
    Ok(Replay { records, unfinished })
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
                appended: 0,
                dirty: Vec::new(),
            }),
            durability: Durability::Write,
            synced: Mutex::new(Synced::default()),
            synced_cv: std::sync::Condvar::new(),
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

    /// Flushes the directory, so that a new segment's name survives a power cut.
    pub fn sync_dir(&self) -> std::io::Result<()> {
        File::open(&self.dir)?.sync_all()
    }

    fn new_segment(&self, seq: u64) -> std::io::Result<Segment> {
        let path = self.dir.join(format!("{PREFIX}{}-{seq:06}{SUFFIX}", self.tag));
        let file = open_segment(&path)?;
        if self.durability == Durability::Fsync {
            self.sync_dir()?;
        }
        Ok(Segment {
            file,
            path,
            outstanding: 0,
            deferred: false,
            torn: false,
        })
    }

    /// Appends a record; returns its segment and its ticket for [`Outbox::sync_to`].
    /// Durable against a process crash on return.
    pub fn append(&self, rec: &UsageRecord) -> std::io::Result<(u64, u64)> {
        self.append_line(&Line::Record(rec.clone()))
    }

    /// Appends a request's admission mark (see the module's docs); returns its segment,
    /// which it holds until [`Outbox::resolved`].
    pub fn admit(&self, rec: &UsageRecord) -> std::io::Result<(u64, u64)> {
        self.append_line(&Line::Admitted { admitted: rec.clone() })
    }

    /// The request marked in `seg` has its final record appended: the mark no longer
    /// holds the segment.
    pub fn resolved(&self, seq: u64) {
        self.committed(seq);
    }

    fn append_line(&self, line: &Line) -> std::io::Result<(u64, u64)> {
        let mut bytes = serde_json::to_vec(line)?;
        bytes.push(b'\n');
        let mut st = self.lock();
        if st.lines >= SEGMENT_RECORDS {
            self.rotate(&mut st)?;
        }
        let seq = st.seq;
        let seg = st
            .segments
            .get_mut(&seq)
            .ok_or_else(|| std::io::Error::other("no current outbox segment"))?;
        if seg.torn {
            bytes.insert(0, b'\n');
        }
        if let Err(e) = seg.file.write_all(&bytes) {
            // A short write (the disk filled up mid-line) leaves a torn line, which a
            // replay skips; the next line must start on a line of its own.
            seg.torn = true;
            return Err(e);
        }
        seg.torn = false;
        seg.outstanding += 1;
        st.lines += 1;
        st.appended += 1;
        if st.dirty.last() != Some(&seq) {
            st.dirty.push(seq);
        }
        Ok((seq, st.appended))
    }

    /// Blocks until every line up to `ticket` is flushed to disk. Group commit: one caller
    /// flushes for everyone waiting, and the lines appended meanwhile ride on the next.
    pub fn sync_to(&self, ticket: u64) -> std::io::Result<()> {
        let mut sy = self.synced.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if sy.upto >= ticket {
                return Ok(());
            }
            if !sy.running {
                break;
            }
            sy = self.synced_cv.wait(sy).unwrap_or_else(|e| e.into_inner());
        }
        sy.running = true;
        drop(sy);
        // Everything appended so far is covered by this flush.
        let (target, dirty, files) = {
            let mut st = self.lock();
            let dirty = std::mem::take(&mut st.dirty);
            let files: Vec<std::io::Result<File>> = dirty
                .iter()
                .filter_map(|seq| st.segments.get(seq))
                .map(|s| s.file.try_clone())
                .collect();
            (st.appended, dirty, files)
        };
        let result = files.into_iter().try_for_each(|f| f.and_then(|f| f.sync_data()));
        if result.is_err() {
            // Not flushed: the next flush must cover these segments again.
            let mut st = self.lock();
            for seq in dirty {
                if !st.dirty.contains(&seq) {
                    st.dirty.push(seq);
                }
            }
        }
        let mut sy = self.synced.lock().unwrap_or_else(|e| e.into_inner());
        sy.running = false;
        if result.is_ok() {
            sy.upto = sy.upto.max(target);
        }
        self.synced_cv.notify_all();
        result
    }

    /// Makes the current segment unwritable, as a full or failed disk would (tests).
    #[cfg(test)]
    pub(crate) fn break_for_tests(&self) {
        let mut st = self.lock();
        let seq = st.seq;
        if let Some(seg) = st.segments.get_mut(&seq) {
            seg.file = File::open(&seg.path).expect("reopen read-only");
        }
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
