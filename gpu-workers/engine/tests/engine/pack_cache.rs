//! The on-disk cache of repacked weights: written by the first load, mapped by the next
//! (same logits, bit for bit), refused when stale (the load repacks and rewrites it); a
//! corrupt matrix is found before its first use, repacked, and the cache deleted.

use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

use hearth_engine::formats::gguf::GgufFile;
use hearth_engine::kernels::pack_cache;
use hearth_engine::kernels::{set_isa, Isa};
use hearth_engine::models::{FloatWeights, ForwardScratch, LoadOptions, Model, Session};

/// A load that writes the pack after a repack (`--pack-cache write`).
fn logits(path: &Path) -> (Vec<f32>, bool) {
    let model = Model::load_with(GgufFile::open(path).unwrap(), true).unwrap();
    let out = Session::new(&model, 64, ForwardScratch::default()).feed(&[1, 9690, 198, 2683, 359, 253, 5356]);
    (out, model.packed_from_cache())
}

#[test]
fn the_pack_cache_is_written_mapped_and_refused_when_bad() {
    set_isa(Isa::best()).unwrap();
    if !Isa::best().is_simd() {
        eprintln!("no SIMD path on this CPU: nothing is packed");
        return;
    }
    let src = crate::harness::default_model();
    let dir = std::env::temp_dir().join(format!("hearth-pack-cache-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("model.gguf");
    std::fs::copy(&src, &model).unwrap();
    let cache = pack_cache::path_for(&model);

    assert!(
        pack_cache::cached_tensors(&model, &pack_cache::PackCache::writing()).is_none(),
        "no cache yet"
    );
    let (first, from_cache) = logits(&model);
    assert!(!from_cache, "no cache yet: repacked");
    assert!(cache.exists(), "the first load wrote {}", cache.display());
    // What a cold load reads ahead from the model file: every tensor the cache does not
    // hold. The cache holds every layer's matrices (7 per layer) and the (tied) output,
    // none of the vectors.
    let gguf = GgufFile::open(&model).unwrap();
    let held = pack_cache::cached_tensors(&model, &pack_cache::PackCache::writing()).expect("a current cache");
    let layers = gguf
        .tensors
        .iter()
        .filter(|t| t.name.ends_with(".attn_q.weight"))
        .count();
    assert_eq!(held.len(), 7 * layers + 1, "{held:?}");
    for t in &gguf.tensors {
        assert_eq!(
            held.contains(&(t.offset as u64)),
            t.dims.len() == 2,
            "{}: held by the cache only if a matrix",
            t.name
        );
    }
    let (second, from_cache) = logits(&model);
    assert!(from_cache, "the second load maps the cache");
    assert_eq!(first, second, "mapped and repacked weights give the same logits");

    // One flipped byte in a matrix: the cache is mapped, but that matrix's check (before its
    // first use) fails, so it is repacked from the model (the same logits) and the cache
    // deleted; the next load repacks and rewrites it. The byte is inside the middle
    // matrix's bytes (its entry: 56 bytes from offset 48, its position at +32, its length
    // at +40), not in the padding between matrices.
    let mut head = vec![0u8; 48];
    let mut f = std::fs::File::open(&cache).unwrap();
    std::io::Read::read_exact(&mut f, &mut head).unwrap();
    let n = u32::from_le_bytes(head[12..16].try_into().unwrap()) as usize;
    head.resize(48 + n * 56, 0);
    std::io::Read::read_exact(&mut f, &mut head[48..]).unwrap();
    let entry = 48 + n / 2 * 56;
    let field = |at: usize| u64::from_le_bytes(head[entry + at..entry + at + 8].try_into().unwrap());
    let at = field(32) + field(40) / 2;
    let mut f = std::fs::OpenOptions::new().read(true).write(true).open(&cache).unwrap();
    f.seek(SeekFrom::Start(at)).unwrap();
    let mut byte = [0u8];
    std::io::Read::read_exact(&mut f, &mut byte).unwrap();
    f.seek(SeekFrom::Start(at)).unwrap();
    f.write_all(&[byte[0] ^ 0x5A]).unwrap();
    drop(f);
    let (third, from_cache) = logits(&model);
    assert!(from_cache, "the header is sound: the cache is mapped");
    assert_eq!(first, third, "the corrupt matrix was not computed with");
    assert!(!cache.exists(), "the corrupt cache is deleted");
    let (fourth, from_cache) = logits(&model);
    assert!(!from_cache, "the next load repacks");
    assert_eq!(first, fourth);
    assert!(cache.exists(), "and rewrites the cache");
    assert!(logits(&model).1, "the rewritten cache is used again");

    // The model file changed (its time): the cache is stale.
    let f = std::fs::OpenOptions::new().write(true).open(&model).unwrap();
    f.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(5))
        .unwrap();
    drop(f);
    assert!(
        pack_cache::cached_tensors(&model, &pack_cache::PackCache::writing()).is_none(),
        "a stale cache holds nothing"
    );
    assert!(!logits(&model).1, "a stale cache is not used");
    std::fs::remove_dir_all(&dir).ok();
}

/// A Hugging Face directory's float weights, quantized to Q8_0 at load, are cached inside
/// the directory, tied to its shards (one touched: stale), and a cache of an earlier layout
/// version is removed when the new one is written.
#[test]
fn a_safetensors_directory_is_cached_inside_it_and_tied_to_its_shards() {
    use hearth_engine::formats::hf::{self, export::ExportDtype};
    set_isa(Isa::best()).unwrap();
    if !Isa::best().is_simd() {
        return;
    }
    let src = crate::harness::default_model();
    let dir = std::env::temp_dir().join(format!("hearth-pack-cache-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    hf::export::export(&GgufFile::open(&src).unwrap(), &dir, ExportDtype::F16, 2).unwrap();
    let old = dir.join("hearth-pack-v1");
    std::fs::write(&old, b"an earlier layout").unwrap();
    let load = || {
        let model = Model::load_options(
            hf::open(&dir).unwrap(),
            LoadOptions {
                pack_cache: pack_cache::PackCache::writing(),
                float_weights: FloatWeights::Q8_0,
                ..Default::default()
            },
        )
        .unwrap();
        let out = Session::new(&model, 64, ForwardScratch::default()).feed(&[1, 9690, 198, 2683]);
        (out, model.packed_from_cache())
    };
    let (first, cached) = load();
    assert!(!cached);
    assert_eq!(
        pack_cache::path_for(&dir),
        dir.join(format!("hearth-pack-v{}", hearth_engine::kernels::packed::PACK_FORMAT))
    );
    assert!(pack_cache::path_for(&dir).exists());
    assert!(!old.exists(), "the earlier version's cache is removed");
    let (second, cached) = load();
    assert!(cached, "the second load maps the cache");
    assert_eq!(first, second);
    let shard = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&shard).unwrap();
    f.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(5))
        .unwrap();
    drop(f);
    assert!(!load().1, "a touched shard makes the cache stale");
    std::fs::remove_dir_all(&dir).ok();
}
