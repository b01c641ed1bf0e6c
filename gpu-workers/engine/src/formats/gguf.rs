//! GGUF v3 reader (the llama.cpp model format) over a memory map.
//!
//! Owns: the header, metadata key/values, tensor infos, alignment and the location of each
//! tensor's bytes, and the tokenizer its metadata describes ([`tokenizer_spec`]). Tensor data
//! is never copied here: [`GgufFile::tensor_data`] borrows straight from the map. Every read
//! is bounds-checked, so a truncated or hostile file is an error, never a panic.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use hearth_protocol::TokenizerSpec;
use memmap2::Mmap;

const MAGIC: u32 = 0x4655_4747; // "GGUF" little-endian
const DEFAULT_ALIGNMENT: u64 = 32;
/// Refuse absurd counts before allocating for them.
const MAX_COUNT: u64 = 1 << 28;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot open model file {path}: {source}")]
    Open { path: String, source: std::io::Error },
    #[error("not a GGUF file (bad magic {0:#010x})")]
    BadMagic(u32),
    #[error("unsupported GGUF version {0} (Hearth reads v2 and v3)")]
    Version(u32),
    #[error("GGUF file is truncated or corrupt at byte {0}")]
    Truncated(usize),
    #[error("GGUF metadata value type {0} is unknown")]
    ValueType(u32),
    #[error("GGUF count {0} is implausibly large")]
    Count(u64),
    #[error("GGUF string is not UTF-8 at byte {0}")]
    Utf8(usize),
    #[error("tensor {name} lies outside the file")]
    TensorBounds { name: String },
    #[error("metadata key {0} is missing")]
    MissingKey(String),
    #[error("metadata key {key} has the wrong type (expected {expected})")]
    KeyType { key: String, expected: &'static str },
    #[error("tensor {0} is missing")]
    MissingTensor(String),
}

/// ggml tensor element types Hearth can compute with (others are reported by number, and
/// named by [`GgmlType::name`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    /// K-quants: super-blocks of 256 values with 6-bit (Q4_K, Q5_K) or 8-bit (Q6_K)
    /// sub-block scales.
    Q4_K,
    Q5_K,
    Q6_K,
    Other(u32),
}

/// Values per K-quant super-block.
pub const QK_K: usize = 256;

impl GgmlType {
    /// Every block-quantized type the engine computes with.
    pub const QUANTIZED: [GgmlType; 8] = [
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q4_K,
        Self::Q5_K,
        Self::Q6_K,
    ];

    /// The type of a GGUF type number.
    pub fn from_u32(v: u32) -> Self {
        match v {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            12 => Self::Q4_K,
            13 => Self::Q5_K,
            14 => Self::Q6_K,
            30 => Self::BF16,
            n => Self::Other(n),
        }
    }

    /// (elements per block, bytes per block); `None` for types Hearth cannot compute with.
    pub fn block_layout(self) -> Option<(usize, usize)> {
        match self {
            Self::F32 => Some((1, 4)),
            Self::F16 | Self::BF16 => Some((1, 2)),
            Self::Q4_0 => Some((32, 18)),
            Self::Q4_1 => Some((32, 20)),
            Self::Q5_0 => Some((32, 22)),
            Self::Q5_1 => Some((32, 24)),
            Self::Q8_0 => Some((32, 34)),
            Self::Q4_K => Some((QK_K, 144)),
            Self::Q5_K => Some((QK_K, 176)),
            Self::Q6_K => Some((QK_K, 210)),
            Self::Other(_) => None,
        }
    }

    /// ggml's name of the type (`Q4_K`, `IQ2_XS`, …), also for the types Hearth refuses.
    pub fn name(self) -> String {
        let s = match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q4_K => "Q4_K",
            Self::Q5_K => "Q5_K",
            Self::Q6_K => "Q6_K",
            Self::Other(n) => {
                let known = match n {
                    4 => "Q4_2 (removed from ggml)",
                    5 => "Q4_3 (removed from ggml)",
                    9 => "Q8_1",
                    10 => "Q2_K",
                    11 => "Q3_K",
                    15 => "Q8_K",
                    16 => "IQ2_XXS",
                    17 => "IQ2_XS",
                    18 => "IQ3_XXS",
                    19 => "IQ1_S",
                    20 => "IQ4_NL",
                    21 => "IQ3_S",
                    22 => "IQ2_S",
                    23 => "IQ4_XS",
                    24 => "I8",
                    25 => "I16",
                    26 => "I32",
                    27 => "I64",
                    28 => "F64",
                    29 => "IQ1_M",
                    34 => "TQ1_0",
                    35 => "TQ2_0",
                    39 => "MXFP4",
                    _ => return format!("type {n}"),
                };
                return known.to_string();
            }
        };
        s.to_string()
    }

    /// Whether the type is one of the block-quantized types the integer kernels take.
    pub fn is_quantized(self) -> bool {
        matches!(self.block_layout(), Some((per, _)) if per > 1)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetaValue {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v.into()),
            Self::U16(v) => Some(v.into()),
            Self::U32(v) => Some(v.into()),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v.into()),
            Self::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Self::I8(v) => Some(v.into()),
            Self::I16(v) => Some(v.into()),
            Self::I32(v) => Some(v.into()),
            Self::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }
}

/// Where one tensor lives and what it is.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF order: `dims[0]` is the innermost (row length).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset in the file.
    pub offset: usize,
    /// Byte length (0 when the type is unsupported and so the size is unknown).
    pub len: usize,
    /// Which mapped file holds it: always 0 for GGUF; a Hugging Face directory's
    /// safetensors shards are numbered in the order they were opened ([`crate::formats::hf`]).
    pub shard: usize,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// An open, parsed GGUF file: metadata under GGUF's key names and tensors under GGUF's
/// names, over one memory map. A Hugging Face model directory opens as the same view
/// ([`crate::formats::hf::open`]): its `config.json` and tokenizer files become the same metadata keys
/// and its safetensors shards the maps, so the model code reads one format.
pub struct GgufFile {
    maps: Vec<Mmap>,
    /// Where it was opened from (a directory for a Hugging Face model).
    pub path: std::path::PathBuf,
    pub version: u32,
    pub metadata: HashMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    pub alignment: u64,
    /// Shards from this index on are anonymous memory (tensors a Hugging Face directory
    /// stores in another shape, rearranged at open): never released, as they have no file
    /// to be read back from.
    memory_from: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("tensors", &self.tensors.len())
            .field("bytes", &self.file_len())
            .finish()
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], GgufError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or(GgufError::Truncated(self.pos))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
    fn count(&mut self) -> Result<u64, GgufError> {
        let n = self.u64()?;
        if n > MAX_COUNT {
            return Err(GgufError::Count(n));
        }
        Ok(n)
    }
    fn string(&mut self) -> Result<String, GgufError> {
        let at = self.pos;
        let n = self.count()? as usize;
        let bytes = self.take(n)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::Utf8(at))
    }
    fn value(&mut self, ty: u32, depth: u32) -> Result<MetaValue, GgufError> {
        Ok(match ty {
            0 => MetaValue::U8(self.arr::<1>()?[0]),
            1 => MetaValue::I8(self.arr::<1>()?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.arr()?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.arr()?)),
            4 => MetaValue::U32(self.u32()?),
            5 => MetaValue::I32(i32::from_le_bytes(self.arr()?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.arr()?)),
            7 => MetaValue::Bool(self.arr::<1>()?[0] != 0),
            8 => MetaValue::String(self.string()?),
            9 if depth < 4 => {
                let ety = self.u32()?;
                let n = self.count()?;
                // Each element takes at least one byte: a cheap guard against huge allocations.
                if n as usize > self.buf.len() - self.pos {
                    return Err(GgufError::Truncated(self.pos));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(ety, depth + 1)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::U64(self.u64()?),
            11 => MetaValue::I64(i64::from_le_bytes(self.arr()?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.arr()?)),
            other => return Err(GgufError::ValueType(other)),
        })
    }
}

impl GgufFile {
    /// Whether the model has layers of routed experts (a mixture's `*_exps` tensors): what
    /// decides `--float-weights auto` for the loader, the read-ahead and `hearth model inspect`.
    pub fn has_routed_experts(&self) -> bool {
        self.tensors.iter().any(|t| t.name.contains("_exps"))
    }

    /// Maps and parses a file. The tensor bytes stay on disk until touched.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let open_err = |source| GgufError::Open {
            path: path.display().to_string(),
            source,
        };
        let file = File::open(path).map_err(open_err)?;
        // SAFETY: the map is read-only; model files are not modified while served (a
        // concurrent writer could change weights under us, but not memory safety of the
        // parser, which copies everything it interprets and bounds-checks all offsets).
        let map = unsafe { Mmap::map(&file) }.map_err(open_err)?;
        Self::parse(map, path.to_path_buf())
    }

    fn parse(map: Mmap, path: std::path::PathBuf) -> Result<Self, GgufError> {
        let (version, metadata, mut tensors, header_end) = {
            let mut c = Cursor { buf: &map, pos: 0 };
            let magic = c.u32()?;
            if magic != MAGIC {
                return Err(GgufError::BadMagic(magic));
            }
            let version = c.u32()?;
            if !(2..=3).contains(&version) {
                return Err(GgufError::Version(version));
            }
            let n_tensors = c.count()?;
            let n_kv = c.count()?;
            let mut metadata = HashMap::new();
            for _ in 0..n_kv {
                let key = c.string()?;
                let ty = c.u32()?;
                let v = c.value(ty, 0)?;
                metadata.insert(key, v);
            }
            let mut tensors = Vec::new();
            for _ in 0..n_tensors {
                let name = c.string()?;
                let n_dims = c.u32()?;
                if n_dims > 4 {
                    return Err(GgufError::Count(n_dims.into()));
                }
                let dims = (0..n_dims).map(|_| c.u64()).collect::<Result<Vec<_>, _>>()?;
                let ty = GgmlType::from_u32(c.u32()?);
                let offset = c.u64()?;
                tensors.push(TensorInfo {
                    name,
                    dims,
                    ty,
                    offset: offset as usize,
                    len: 0,
                    shard: 0,
                });
            }
            (version, metadata, tensors, c.pos)
        };
        let alignment = metadata
            .get("general.alignment")
            .and_then(MetaValue::as_u64)
            .filter(|a| *a > 0 && a.is_power_of_two())
            .unwrap_or(DEFAULT_ALIGNMENT);
        let data_start = (header_end as u64).div_ceil(alignment) * alignment;
        let mut by_name = HashMap::new();
        for (i, t) in tensors.iter_mut().enumerate() {
            let bounds = || GgufError::TensorBounds { name: t.name.clone() };
            let n = t
                .dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(bounds)?;
            let len = match t.ty.block_layout() {
                Some((per_block, bytes)) => {
                    if n % per_block as u64 != 0 {
                        return Err(bounds());
                    }
                    (n / per_block as u64).checked_mul(bytes as u64).ok_or_else(bounds)?
                }
                None => 0,
            };
            let start = data_start.checked_add(t.offset as u64).ok_or_else(bounds)?;
            let end = start.checked_add(len).ok_or_else(bounds)?;
            if end > map.len() as u64 {
                return Err(bounds());
            }
            t.offset = start as usize;
            t.len = len as usize;
            by_name.insert(t.name.clone(), i);
        }
        Ok(Self {
            maps: vec![map],
            path,
            version,
            metadata,
            tensors,
            by_name,
            alignment,
            memory_from: 1,
        })
    }

    /// Assembles the view from already-checked parts: every tensor lies within its shard.
    /// The last `memory_shards` maps are anonymous memory, not files.
    pub(crate) fn from_parts(
        path: std::path::PathBuf,
        maps: Vec<Mmap>,
        memory_shards: usize,
        metadata: HashMap<String, MetaValue>,
        tensors: Vec<TensorInfo>,
    ) -> Self {
        debug_assert!(tensors.iter().all(|t| t.offset + t.len <= maps[t.shard].len()));
        let by_name = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Self {
            memory_from: maps.len().saturating_sub(memory_shards),
            maps,
            path,
            version: 3,
            metadata,
            tensors,
            by_name,
            alignment: DEFAULT_ALIGNMENT,
        }
    }

    /// Bytes mapped, over every shard.
    pub fn file_len(&self) -> usize {
        self.maps.iter().map(|m| m.len()).sum()
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of a tensor, borrowed from the map.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        &self.maps[t.shard][t.offset..t.offset + t.len]
    }

    /// Tells the OS that bytes `offset..offset + len` will not be read again soon (a tensor
    /// whose repacked copy is used instead): their pages leave this process's resident set
    /// and stay in the page cache; a later read faults them back in from the file.
    pub fn release(&self, shard: usize, offset: usize, len: usize) {
        const PAGE: usize = 4096;
        if shard >= self.memory_from {
            return;
        }
        let map = &self.maps[shard];
        let start = offset.div_ceil(PAGE) * PAGE;
        let end = ((offset + len) / PAGE * PAGE).min(map.len());
        #[cfg(unix)]
        if end > start {
            // SAFETY: the map is a read-only file mapping, so dropping its pages loses
            // nothing: the next access reads the file again.
            let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start) };
        }
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.get(key).ok_or_else(|| GgufError::MissingKey(key.to_string()))?;
        v.as_u64().ok_or(GgufError::KeyType {
            key: key.to_string(),
            expected: "an unsigned integer",
        })
    }

    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        let v = self.get(key).ok_or_else(|| GgufError::MissingKey(key.to_string()))?;
        v.as_f64().ok_or(GgufError::KeyType {
            key: key.to_string(),
            expected: "a number",
        })
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.get(key).ok_or_else(|| GgufError::MissingKey(key.to_string()))?;
        v.as_str().ok_or(GgufError::KeyType {
            key: key.to_string(),
            expected: "a string",
        })
    }

    /// A string array (vocabularies, merges).
    pub fn get_str_array(&self, key: &str) -> Result<Vec<String>, GgufError> {
        let bad = || GgufError::KeyType {
            key: key.to_string(),
            expected: "an array of strings",
        };
        match self.get(key).ok_or_else(|| GgufError::MissingKey(key.to_string()))? {
            MetaValue::Array(a) => a
                .iter()
                .map(|v| v.as_str().map(str::to_string).ok_or_else(bad))
                .collect(),
            _ => Err(bad()),
        }
    }

    /// A number array (SentencePiece scores).
    pub fn get_f64_array(&self, key: &str) -> Result<Vec<f64>, GgufError> {
        let bad = || GgufError::KeyType {
            key: key.to_string(),
            expected: "an array of numbers",
        };
        match self.get(key).ok_or_else(|| GgufError::MissingKey(key.to_string()))? {
            MetaValue::Array(a) => a.iter().map(|v| v.as_f64().ok_or_else(bad)).collect(),
            _ => Err(bad()),
        }
    }

    /// An integer array (token types).
    pub fn get_i64_array(&self, key: &str) -> Result<Vec<i64>, GgufError> {
        let bad = || GgufError::KeyType {
            key: key.to_string(),
            expected: "an array of integers",
        };
        match self.get(key).ok_or_else(|| GgufError::MissingKey(key.to_string()))? {
            MetaValue::Array(a) => a.iter().map(|v| v.as_i64().ok_or_else(bad)).collect(),
            _ => Err(bad()),
        }
    }
}

/// Writes a GGUF v3 file; used by tests to build small models and malformed inputs.
#[cfg(test)]
pub(crate) mod writer {
    use super::*;

    pub struct Writer {
        pub kv: Vec<(String, u32, Vec<u8>)>,
        pub tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
    }

    pub fn str_bytes(s: &str) -> Vec<u8> {
        let mut v = (s.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(s.as_bytes());
        v
    }

    impl Writer {
        pub fn new() -> Self {
            Self {
                kv: Vec::new(),
                tensors: Vec::new(),
            }
        }
        pub fn u32(&mut self, k: &str, v: u32) {
            self.kv.push((k.into(), 4, v.to_le_bytes().to_vec()));
        }
        pub fn f32(&mut self, k: &str, v: f32) {
            self.kv.push((k.into(), 6, v.to_le_bytes().to_vec()));
        }
        pub fn str(&mut self, k: &str, v: &str) {
            self.kv.push((k.into(), 8, str_bytes(v)));
        }
        pub fn str_array(&mut self, k: &str, v: &[String]) {
            let mut b = 8u32.to_le_bytes().to_vec();
            b.extend((v.len() as u64).to_le_bytes());
            for s in v {
                b.extend(str_bytes(s));
            }
            self.kv.push((k.into(), 9, b));
        }
        pub fn i32_array(&mut self, k: &str, v: &[i32]) {
            let mut b = 5u32.to_le_bytes().to_vec();
            b.extend((v.len() as u64).to_le_bytes());
            for x in v {
                b.extend(x.to_le_bytes());
            }
            self.kv.push((k.into(), 9, b));
        }
        pub fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) {
            self.tensors.push((name.into(), dims.to_vec(), ty, data));
        }
        pub fn bytes(&self) -> Vec<u8> {
            let mut out = MAGIC.to_le_bytes().to_vec();
            out.extend(3u32.to_le_bytes());
            out.extend((self.tensors.len() as u64).to_le_bytes());
            out.extend((self.kv.len() as u64).to_le_bytes());
            for (k, ty, v) in &self.kv {
                out.extend(str_bytes(k));
                out.extend(ty.to_le_bytes());
                out.extend(v);
            }
            let mut off = 0u64;
            let mut offsets = Vec::new();
            for (_, _, _, data) in &self.tensors {
                offsets.push(off);
                off = (off + data.len() as u64).div_ceil(32) * 32;
            }
            for ((name, dims, ty, _), o) in self.tensors.iter().zip(&offsets) {
                out.extend(str_bytes(name));
                out.extend((dims.len() as u32).to_le_bytes());
                for d in dims {
                    out.extend(d.to_le_bytes());
                }
                out.extend(ty.to_le_bytes());
                out.extend(o.to_le_bytes());
            }
            while !out.len().is_multiple_of(32) {
                out.push(0);
            }
            for (_, _, _, data) in &self.tensors {
                out.extend(data);
                while !out.len().is_multiple_of(32) {
                    out.push(0);
                }
            }
            out
        }
    }
}

/// Reads the tokenizer description from GGUF metadata (the `tokenizer.ggml.*` keys llama.cpp
/// writes; token types, merges and scores are optional where the tokenizer kind allows).
pub fn tokenizer_spec(g: &GgufFile) -> Result<TokenizerSpec, GgufError> {
    let id = |k: &str| g.get_u64(k).ok().map(|v| v as u32);
    let flag = |k: &str| match g.get(k) {
        Some(MetaValue::Bool(b)) => Some(*b),
        _ => None,
    };
    let optional = |r: Result<Vec<String>, GgufError>| match r {
        Err(GgufError::MissingKey(_)) => Ok(Vec::new()),
        r => r,
    };
    let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
    let token_types = match g.get_i64_array("tokenizer.ggml.token_type") {
        Err(GgufError::MissingKey(_)) => vec![hearth_protocol::tokenizer::TOKEN_TYPE_NORMAL; tokens.len()],
        r => r?.into_iter().map(|t| t as i32).collect(),
    };
    let scores = match g.get_f64_array("tokenizer.ggml.scores") {
        Err(GgufError::MissingKey(_)) => Vec::new(),
        r => r?.into_iter().map(|s| s as f32).collect(),
    };
    // llama.cpp strips the whitespace after Phi-3's special tokens (as its tokenizer.json's
    // `rstrip` flags do), recognising the family by `general.name`.
    let name = g.get_str("general.name").unwrap_or("").to_lowercase();
    let rstrip = if name.contains("phi-3") || name.contains("phi3") {
        tokens
            .iter()
            .zip(&token_types)
            .enumerate()
            .filter(|(_, (t, &ty))| {
                let special = ty == hearth_protocol::tokenizer::TOKEN_TYPE_CONTROL
                    || ty == hearth_protocol::tokenizer::TOKEN_TYPE_USER_DEFINED
                    || ty == hearth_protocol::tokenizer::TOKEN_TYPE_UNKNOWN
                    || t.as_str() == "</s>";
                special && !matches!(t.as_str(), "<unk>" | "<s>" | "<|endoftext|>")
            })
            .map(|(i, _)| i as u32)
            .collect()
    } else {
        Vec::new()
    };
    Ok(TokenizerSpec {
        model: g.get_str("tokenizer.ggml.model")?.to_string(),
        pre: g.get_str("tokenizer.ggml.pre").unwrap_or("default").to_string(),
        tokens,
        token_types,
        scores,
        merges: optional(g.get_str_array("tokenizer.ggml.merges"))?,
        bos_id: id("tokenizer.ggml.bos_token_id"),
        eos_id: id("tokenizer.ggml.eos_token_id"),
        eot_id: id("tokenizer.ggml.eot_token_id"),
        eom_id: id("tokenizer.ggml.eom_token_id"),
        add_bos: flag("tokenizer.ggml.add_bos_token"),
        add_space_prefix: flag("tokenizer.ggml.add_space_prefix"),
        rstrip: [rstrip, ids(g, "tokenizer.hearth.rstrip")].concat(),
        lstrip: ids(g, "tokenizer.hearth.lstrip"),
        chat_template: g.get_str("tokenizer.chat_template").ok().map(str::to_string),
    })
}

/// Token ids under a Hearth key (strip flags read from a `tokenizer.json`; see `hf`).
fn ids(g: &GgufFile, key: &str) -> Vec<u32> {
    g.get_i64_array(key)
        .map(|v| v.into_iter().filter_map(|i| u32::try_from(i).ok()).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::writer::Writer;
    use super::*;
    use std::io::Write;

    fn write_tmp(bytes: &[u8], name: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("hearth-gguf-{}-{name}", std::process::id()));
        std::fs::File::create(&p).unwrap().write_all(bytes).unwrap();
        p
    }

    #[test]
    fn reads_metadata_and_tensors() {
        let mut w = Writer::new();
        w.str("general.architecture", "llama");
        w.u32("llama.block_count", 2);
        w.f32("llama.rope.freq_base", 10000.0);
        w.str_array("tokenizer.ggml.tokens", &["a".into(), "b".into()]);
        w.i32_array("tokenizer.ggml.token_type", &[1, 3]);
        let f32s: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|x| x.to_le_bytes()).collect();
        w.tensor("t0", &[2, 2], 0, f32s.clone());
        w.tensor("t1", &[32], 8, vec![0u8; 34]);
        let p = write_tmp(&w.bytes(), "ok");
        let g = GgufFile::open(&p).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
        assert_eq!(g.get_u64("llama.block_count").unwrap(), 2);
        assert_eq!(g.get_f64("llama.rope.freq_base").unwrap(), 10000.0);
        assert_eq!(g.get_str_array("tokenizer.ggml.tokens").unwrap(), ["a", "b"]);
        assert_eq!(g.get_i64_array("tokenizer.ggml.token_type").unwrap(), [1, 3]);
        let t0 = g.tensor("t0").unwrap();
        assert_eq!(t0.ty, GgmlType::F32);
        assert_eq!(g.tensor_data(t0), &f32s[..]);
        assert_eq!(t0.offset % 32, 0);
        let t1 = g.tensor("t1").unwrap();
        assert_eq!((t1.ty, t1.len), (GgmlType::Q8_0, 34));
        assert!(matches!(g.get_u64("nope"), Err(GgufError::MissingKey(_))));
        assert!(matches!(g.get_str("llama.block_count"), Err(GgufError::KeyType { .. })));
        std::fs::remove_file(p).ok();
    }

    #[test]
    fn rejects_bad_magic_and_truncation_without_panicking() {
        let p = write_tmp(b"NOPE\x03\0\0\0", "magic");
        assert!(matches!(GgufFile::open(&p), Err(GgufError::BadMagic(_))));
        let mut w = Writer::new();
        w.str("general.architecture", "llama");
        w.tensor("t0", &[4], 0, vec![0u8; 16]);
        let full = w.bytes();
        // Every truncation point is an error, never a panic.
        for cut in 0..full.len() - 16 {
            let p = write_tmp(&full[..cut], "cut");
            assert!(GgufFile::open(&p).is_err(), "cut at {cut} parsed");
        }
        // A tensor pointing past the end.
        let mut w = Writer::new();
        w.tensor("t0", &[1 << 20], 0, vec![0u8; 16]);
        let p = write_tmp(&w.bytes(), "oob");
        assert!(matches!(GgufFile::open(&p), Err(GgufError::TensorBounds { .. })));
    }
}
