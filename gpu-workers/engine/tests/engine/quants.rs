//! Hearth's reading of GGUF's quantized formats against an independent implementation: the
//! `gguf` package's NumPy dequantizers (installed by `scripts/reference-data`), on random
//! blocks of every type the engine computes with — every value bit-exact. Then the repacked
//! layout read back gives the same values, so every kernel over it multiplies the file's
//! numbers (the kernels themselves are checked against the scalar dot product on every ISA
//! in `kernels::tests`).

use std::path::{Path, PathBuf};
use std::process::Command;

use hearth_engine::formats::gguf::GgmlType;
use hearth_engine::kernels::{blocks, dequantize_row, PackedMatrix, WeightView};

const TYPES: [GgmlType; 8] = GgmlType::QUANTIZED;

fn reference_python() -> PathBuf {
    crate::harness::reference().join("venv/bin/python")
}

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 11
    }
    fn byte(&mut self) -> u8 {
        (self.next() >> 40) as u8
    }
    /// A float in ±`scale`.
    fn f(&mut self, scale: f32) -> f32 {
        ((self.next() >> 29) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }
}

/// Where a block's f16 fields are (d, m / dmin), so random bytes get finite scales there.
fn f16_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q6_K => &[208],
        _ => &[0, 2],
    }
}

/// `blocks` random blocks of `ty`: random quants and sub-scales, f16 scales of both signs
/// (Q8_0's quants kept off −128, which ggml's quantizer never writes).
fn random_blocks(ty: GgmlType, n: usize, rng: &mut Lcg) -> Vec<u8> {
    let (_, bytes) = ty.block_layout().unwrap();
    let mut out = Vec::with_capacity(n * bytes);
    for _ in 0..n {
        let mut blk: Vec<u8> = (0..bytes).map(|_| rng.byte()).collect();
        for &at in f16_fields(ty) {
            let v = half::f16::from_f32(rng.f(0.05)).to_bits().to_le_bytes();
            blk[at..at + 2].copy_from_slice(&v);
        }
        if ty == GgmlType::Q8_0 {
            for q in &mut blk[2..] {
                if *q == 0x80 {
                    *q = 0x81;
                }
            }
        }
        out.extend(blk);
    }
    out
}

#[test]
fn every_type_dequantizes_bit_exactly_as_the_gguf_package_does() {
    let python = reference_python();
    let dir = std::env::temp_dir().join(format!("hearth-quants-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut rng = Lcg(20261202);
    let (rows, cols) = (37, 1024);
    for ty in TYPES {
        let (per, bytes) = ty.block_layout().unwrap();
        let data = random_blocks(ty, rows * cols / per, &mut rng);
        let (inp, out) = (dir.join("in.bin"), dir.join("out.bin"));
        std::fs::write(&inp, &data).unwrap();
        let status = Command::new(&python)
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gguf_dequantize.py"))
            .arg(ty.name())
            .args([&inp, &out])
            .status()
            .unwrap();
        assert!(status.success(), "the gguf package failed on {ty}");
        let want: Vec<f32> = std::fs::read(&out)
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(want.len(), rows * cols, "{ty}");
        let row_bytes = cols / per * bytes;
        let mut got = vec![0f32; cols];
        let w = WeightView {
            ty,
            rows,
            cols,
            data: &data,
            packed: None,
        };
        let packed = PackedMatrix::pack(&w).unwrap_or_else(|| panic!("{ty} does not pack"));
        let mut unpacked = vec![0f32; 32];
        for r in 0..rows {
            dequantize_row(ty, &data[r * row_bytes..(r + 1) * row_bytes], &mut got);
            for (c, (g, w)) in got.iter().zip(&want[r * cols..(r + 1) * cols]).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{ty} row {r} column {c}: Hearth {g}, gguf {w}"
                );
            }
            // The repacked layout holds the same numbers.
            for b in 0..cols / 32 {
                blocks::dequantize(&packed.block(r, b), &mut unpacked);
                for (i, (u, w)) in unpacked.iter().zip(&want[r * cols + 32 * b..]).enumerate() {
                    assert_eq!(u, w, "{ty} row {r} block {b} value {i}: repacked {u}, gguf {w}");
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn types_hearth_cannot_compute_with_are_named() {
    use hearth_engine::formats::gguf::GgmlType as T;
    // GGUF type numbers of refused types, by ggml's names.
    for (n, name) in [
        (10, "Q2_K"),
        (11, "Q3_K"),
        (16, "IQ2_XXS"),
        (23, "IQ4_XS"),
        (20, "IQ4_NL"),
    ] {
        let t = T::from_u32(n);
        assert!(matches!(t, T::Other(_)) && t.block_layout().is_none(), "{name}");
        assert_eq!(t.name(), name);
    }
    assert_eq!(T::from_u32(12), T::Q4_K);
}
