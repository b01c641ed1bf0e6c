//! The `hearth` command line: argument parsing ([`args`]) and launchers ([`launch`]); the
//! management commands ([`manage`]), benchmarks ([`bench_cmd`]) and the book's generated
//! references ([`docs`]) each in their own module.

mod args;
mod bench_cmd;
mod catalogue;
mod docs;
mod launch;
mod local_worker;
mod login;
mod manage;
mod output;
mod pipeline;
mod telemetry;

use clap::Parser;
use hearth_engine::formats::fetch::{ensure_model, hearth_home};

use crate::args::{Cli, Command, DocsCommand, ModelCommand};

/// Keeps freed memory for reuse instead of handing it back to the kernel at once (glibc's
/// `malloc`; elsewhere nothing): allocations of up to 32 MiB come from the heap, and up to
/// 256 MiB of free memory at the top of each arena is kept before it is trimmed. A KV
/// transfer allocates and frees a block-sized buffer per block (360 KiB for the default
/// model); handed back and faulted in again each time, that costs more than the copy
/// (measured: 127 such buffers filled in 28–60 ms fresh, 8–10 ms reused). The price: memory
/// freed after a burst may stay resident. Process-wide policy, so it lives here, called
/// before any other thread exists.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt is not thread-safe; it runs first in `main`, before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}

fn main() -> anyhow::Result<()> {
    tune_allocator();
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let service = match cli.command {
        Command::Worker(_) => "hearth-worker",
        Command::Gateway(_) => "hearth-gateway",
        _ => "hearth",
    };
    let _telemetry = rt.block_on(async { telemetry::init(cli.otlp_endpoint.as_deref(), service) })?;
    rt.block_on(async move {
        match cli.command {
            Command::Serve(a) => launch::serve(a).await,
            Command::Worker(a) => launch::worker(a).await,
            Command::Gateway(a) => launch::gateway(a).await,
            Command::Admin(a) => manage::admin(a).await,
            Command::Billing { command } => manage::billing(command).await,
            Command::Processor(a) => manage::processor(a).await,
            Command::Model {
                command: ModelCommand::Fetch { model },
            } => {
                let path = ensure_model(&model, &hearth_home(), &mut |m| eprintln!("{m}"))?;
                println!("{}", path.display());
                Ok(())
            }
            Command::Model {
                command:
                    ModelCommand::ExportHf {
                        model,
                        out,
                        dtype,
                        shards,
                    },
            } => {
                let dtype = hearth_engine::formats::hf::export::ExportDtype::parse(&dtype)
                    .ok_or_else(|| anyhow::anyhow!("unknown --dtype {dtype:?} (f16, bf16, f32)"))?;
                let path = if std::path::Path::new(&model).exists() {
                    model.into()
                } else {
                    ensure_model(&model, &hearth_home(), &mut |m| eprintln!("{m}"))?
                };
                let file = hearth_engine::formats::gguf::GgufFile::open(&path)?;
                let bytes = hearth_engine::formats::hf::export::export(&file, &out, dtype, shards)?;
                eprintln!("hearth: wrote {} MiB of weights", bytes >> 20);
                println!("{}", out.display());
                Ok(())
            }
            Command::Model {
                command:
                    ModelCommand::Pack {
                        model,
                        out,
                        float_weights,
                    },
            } => {
                let path = if std::path::Path::new(&model).exists() {
                    model.into()
                } else {
                    ensure_model(&model, &hearth_home(), &mut |m| eprintln!("{m}"))?
                };
                let file = hearth_engine::formats::hf::open_model(&path)?;
                let opts = hearth_engine::models::LoadOptions {
                    pack_cache: hearth_engine::kernels::pack_cache::PackCache {
                        mode: hearth_engine::kernels::pack_cache::PackMode::Write,
                        dir: out,
                    },
                    float_weights,
                    ..Default::default()
                };
                let done = hearth_engine::models::Model::prepare_pack(file, opts)?;
                eprintln!(
                    "hearth: packed {} MiB in {:.1} s ({:.2} GB/s)",
                    done.bytes >> 20,
                    done.seconds,
                    done.bytes as f64 / done.seconds.max(1e-9) / 1e9
                );
                println!("{}", done.path.display());
                Ok(())
            }
            Command::Model {
                command: ModelCommand::Inspect { model, json },
            } => {
                let path = if std::path::Path::new(&model).exists() {
                    model.into()
                } else {
                    ensure_model(&model, &hearth_home(), &mut |m| eprintln!("{m}"))?
                };
                let report = hearth_engine::formats::inspect::inspect(&path)?;
                if json {
                    println!("{}", serde_json::to_string_pretty(&report)?);
                } else {
                    print!("{}", report.text());
                }
                Ok(())
            }
            Command::Bench { command } => bench_cmd::run(command).await,
            Command::Docs { command } => {
                let text = match command {
                    DocsCommand::Config => docs::config(),
                    DocsCommand::Metrics => docs::metrics(),
                    DocsCommand::Openapi { admin } => docs::openapi(admin),
                    DocsCommand::Api => docs::api(),
                };
                // A reader that stops early (`| head`) is not an error.
                use std::io::Write;
                match std::io::stdout().lock().write_all(text.as_bytes()) {
                    Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
                    _ => Ok(()),
                }
            }
        }
    })
}
