//! The CUDA kernels compile: NVRTC turns `cuda/kernels.cu` into PTX and into device binaries
//! (CUBIN) for the architectures the backend targets, with every entry point it loads. No GPU is needed, only
//! `libnvrtc` on the loader's path (`scripts/test` installs the `nvidia-cuda-nvrtc-cu12`
//! wheel and sets `HEARTH_REQUIRE_NVRTC=1`, so in CI a missing NVRTC fails this test
//! instead of skipping it).
#![cfg(feature = "cuda")]

use hearth_engine::cuda::plan::KERNEL_NAMES;
use hearth_engine::cuda::{compile_cubin, compile_ptx, CudaError};

#[test]
fn kernels_compile_to_ptx_with_nvrtc() {
    let required = std::env::var("HEARTH_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    for arch in ["compute_70", "compute_80", "compute_90"] {
        let ptx = match compile_ptx(Some(arch)) {
            Ok(p) => p,
            Err(CudaError::Unavailable(why)) if !required => {
                eprintln!("SKIPPED (set HEARTH_REQUIRE_NVRTC=1 to require it): {why}");
                return;
            }
            Err(e) => panic!("{arch}: {e}"),
        };
        let text = ptx.to_src();
        assert!(text.contains(".version"), "{arch}: not PTX");
        for name in KERNEL_NAMES {
            assert!(
                text.contains(&format!(".entry {name}(")),
                "{arch}: entry point {name} missing from the PTX"
            );
        }
        let target = arch.replace("compute_", "sm_");
        assert!(
            text.contains(&format!(".target {target}")),
            "{arch}: PTX for another target"
        );
        eprintln!(
            "{arch}: {} bytes of PTX, {} entry points",
            text.len(),
            KERNEL_NAMES.len()
        );
    }
}

#[test]
fn kernels_compile_to_device_binaries_with_nvrtc() {
    // What the backend loads: a CUBIN for the device's exact architecture (NVRTC runs
    // ptxas itself), for an A100, an RTX 40x0 and an H100/H200.
    let required = std::env::var("HEARTH_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    for arch in ["sm_80", "sm_89", "sm_90"] {
        let bin = match compile_cubin(arch) {
            Ok(b) => b,
            Err(CudaError::Unavailable(why)) if !required => {
                eprintln!("SKIPPED (set HEARTH_REQUIRE_NVRTC=1 to require it): {why}");
                return;
            }
            Err(e) => panic!("{arch}: {e}"),
        };
        assert_eq!(&bin[..4], b"\x7fELF", "{arch}: not a CUBIN");
        for name in KERNEL_NAMES {
            let sym = format!("{name}\0");
            assert!(
                bin.windows(sym.len()).any(|w| w == sym.as_bytes()),
                "{arch}: {name} missing from the CUBIN"
            );
        }
        eprintln!("{arch}: {} bytes of CUBIN", bin.len());
    }
}

#[test]
fn a_kernel_with_an_error_is_refused_with_nvrtc_log() {
    // The check above can fail: NVRTC rejects bad source and the error carries its log.
    let required = std::env::var("HEARTH_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    // SAFETY: a probe only.
    if !required && !unsafe { cudarc_present() } {
        eprintln!("SKIPPED: no libnvrtc on the loader's path");
        return;
    }
    let err = cudarc::nvrtc::compile_ptx("extern \"C\" __global__ void broken(float* x) { x[0] = undefined_name; }")
        .expect_err("bad source compiled");
    let text = format!("{err:?}");
    assert!(text.contains("undefined_name"), "no NVRTC log in {text}");
}

unsafe fn cudarc_present() -> bool {
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}
