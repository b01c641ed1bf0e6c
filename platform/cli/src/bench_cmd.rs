//! `hearth bench …`: the benchmarks (in `hearth-bench`), each printing a
//! table and optionally writing JSON.

use std::path::PathBuf;

use crate::args::{BenchCommand, ModelArgs};
use crate::launch::resolve_model;
use crate::output::write_json;

pub async fn run(command: BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Engine {
            model,
            quick,
            speculative,
            json,
        } => engine(model, quick, speculative, json).await,
        BenchCommand::Pd {
            model,
            seconds,
            streams,
            short_tokens,
            long_words,
            burst_every,
            burst,
            step_tokens,
            threshold,
            sim_transfer_gbs,
            pd_threads,
            decode_max_running,
            quick,
            json,
        } => {
            let (path, id) = resolve_model(&model).await?;
            let cfg = hearth_bench::pd::PdBenchConfig {
                exe: std::env::current_exe()?,
                model: path.to_string_lossy().into_owned(),
                model_id: id,
                threads: model.engine_config().threads,
                step_tokens: step_tokens.clamp(16, 8192),
                seconds: if quick { 15.0 } else { seconds.max(5.0) },
                streams: streams.clamp(1, 256),
                short_tokens: short_tokens.clamp(2, 4096),
                long_words: long_words.clamp(16, 7000),
                burst_every: burst_every.max(1.0),
                burst: burst.clamp(1, 64),
                threshold: threshold.max(1),
                sim_transfer_gbs,
                quick,
                pd_threads,
                decode_max_running: decode_max_running.map(|c| c.max(1)),
            };
            let report = hearth_bench::pd::run(cfg).await?;
            print!("{}", report.table());
            write_json(&report, json)
        }
        BenchCommand::KvTransfer {
            model,
            prompt_tokens,
            json,
        } => {
            let (path, id) = resolve_model(&model).await?;
            let mut cfg = model.engine_config();
            // Room for the prompt's blocks in each engine, whatever the machine's memory.
            cfg.kv_cache_mib.get_or_insert(256);
            let report = hearth_bench::engine::kvtransfer::run(&path, &id, &cfg, prompt_tokens.clamp(32, 8192)).await?;
            print!("{}", report.table());
            write_json(&report, json)
        }
        BenchCommand::Lora {
            model,
            streams,
            adapters,
            rank,
            tokens,
            quick,
            json,
        } => {
            let (path, id) = resolve_model(&model).await?;
            let tokens = if quick { tokens.min(16) } else { tokens };
            let report = hearth_bench::engine::lora::run(
                &path,
                &id,
                &model.engine_config(),
                streams.clamp(1, 256),
                adapters.clamp(1, 64),
                rank.clamp(1, 64),
                tokens.clamp(2, 1024),
                quick,
            )
            .await?;
            print!("{}", report.table());
            write_json(&report, json)
        }
        BenchCommand::Load { model, rounds, json } => {
            let (path, id) = resolve_model(&model).await?;
            let cfg = model.engine_config();
            let report = hearth_bench::engine::load::run(&path, &id, &cfg, rounds.clamp(1, 50)).await?;
            print!("{}", report.table());
            write_json(&report, json)
        }
        BenchCommand::Pipeline { model, json } => {
            let (path, id) = resolve_model(&model).await?;
            let exe = std::env::current_exe()?;
            let report = hearth_bench::engine::pipeline::run(&exe, &path, &id, &model.engine_config()).await?;
            print!("{}", report.table());
            write_json(&report, json)
        }
        BenchCommand::Kld { models, json } => {
            let report = tokio::task::spawn_blocking(move || hearth_bench::engine::kld::run(&models)).await??;
            print!("{}", report.table());
            write_json(&report, json)
        }
        BenchCommand::KvTiers { model, quick, json } => {
            let (path, id) = resolve_model(&model).await?;
            let report = hearth_bench::engine::kvtiers::run(&path, &id, &model.engine_config(), quick).await?;
            print!("{}", report.table());
            write_json(&report, json)
        }
        BenchCommand::Attention { quick, json } => {
            let report = hearth_bench::engine::attention::run(quick);
            print!("{}", report.table());
            write_json(&report, json)
        }
        BenchCommand::Tokenizer { model, quick, json } => {
            let (path, id) = resolve_model(&model).await?;
            let file = hearth_engine::formats::hf::open_model(&path)?;
            let spec = hearth_engine::tokenizer_spec(&file)?;
            let reference = hearth_protocol::tokenizer::hf_tokenizer_json(&spec)?;
            let report = hearth_bench::tokenizer::run(&id, &spec, &reference.to_string(), quick)?;
            print!("{}", report.table());
            write_json(&report, json)
        }
        BenchCommand::Coldstart {
            model,
            prompt_tokens,
            json,
        } => {
            let (path, id) = resolve_model(&model).await?;
            let cfg = model.engine_config();
            let exe = std::env::current_exe().ok();
            let report =
                hearth_bench::engine::coldstart::run(&path, &id, &cfg, prompt_tokens.clamp(1, 4096), exe.as_deref())
                    .await?;
            print!("{}", report.table());
            write_json(&report, json)
        }
        BenchCommand::Processors {
            model,
            examples,
            requests,
            quick,
            json,
        } => {
            let (path, id) = resolve_model(&model).await?;
            let examples = if examples.exists() {
                Some(examples)
            } else {
                eprintln!(
                    "hearth: {} does not exist, so only the WebAssembly text guest runs \
                     (sdk/processors/build builds the JavaScript and Python ones there)",
                    examples.display()
                );
                None
            };
            let (requests, seconds) = if quick { (200, 0.5) } else { (requests.max(20), 2.0) };
            let report = hearth_bench::processors::run(examples.as_deref(), &path, &id, requests, seconds).await?;
            print!("{}", report.table());
            write_json(&report, json)
        }
        BenchCommand::Gateway {
            model,
            requests,
            seconds,
            concurrency,
            redis_url,
            quick,
            json,
        } => {
            let (path, id) = resolve_model(&model).await?;
            let cfg = hearth_bench::gateway::GatewayBenchConfig {
                requests: if quick { 300 } else { requests.max(10) },
                seconds: if quick { 1.0 } else { seconds.max(0.5) },
                concurrency: concurrency.clamp(1, 1024),
                redis_url: redis_url.filter(|u| !u.is_empty()),
            };
            let report = hearth_bench::gateway::run(&path, &id, cfg).await?;
            print!("{}", report.table());
            write_json(&report, json)
        }
        BenchCommand::Batch {
            model,
            lines,
            max_tokens,
            concurrency,
            capacity_clients,
            interactive_share,
            seconds,
            seed,
            json,
        } => {
            let (path, id) = resolve_model(&model).await?;
            let cfg = hearth_bench::batch::BatchBenchConfig {
                exe: std::env::current_exe()?,
                model: path.to_string_lossy().into_owned(),
                model_id: id,
                threads: model.threads,
                lines: lines.clamp(1, hearth_tenants::batches::MAX_BATCH_LINES),
                max_tokens: max_tokens.max(1),
                concurrency: concurrency.clamp(1, 256),
                capacity_clients: capacity_clients.clamp(1, 256),
                interactive_share: interactive_share.clamp(0.0, 0.95),
                seconds: seconds.max(2.0),
                seed,
            };
            let report = hearth_bench::batch::run(cfg).await?;
            print!("{}", report.table());
            write_json(&report, json)
        }
        BenchCommand::Soak {
            model,
            minutes,
            concurrency,
            sample_secs,
            seed,
            json,
        } => {
            let (path, id) = resolve_model(&model).await?;
            let cfg = hearth_bench::soak::SoakConfig {
                exe: std::env::current_exe()?,
                model: path.to_string_lossy().into_owned(),
                model_id: id,
                threads: model.threads,
                minutes: minutes.max(0.1),
                concurrency: concurrency.clamp(1, 256),
                sample_secs,
                seed,
            };
            let report = hearth_bench::soak::run(cfg).await?;
            print!("{}", report.table());
            write_json(&report, json)?;
            anyhow::ensure!(report.books_balance, "the usage books do not balance");
            Ok(())
        }
        BenchCommand::Fairness {
            model,
            sim_seconds,
            steady_rps,
            flood,
            engine_requests,
            engine_steady_load,
            engine_steady_rps,
            step_cost,
            sim_only,
            seed,
            quick,
            json,
        } => {
            let engine = if sim_only {
                None
            } else {
                let (path, id) = resolve_model(&model).await?;
                Some(hearth_bench::fairness::EngineRun {
                    model: path,
                    model_id: id,
                    threads: model.engine_config().threads,
                    requests: if quick { 20 } else { engine_requests.clamp(5, 100_000) },
                    steady_rps: engine_steady_rps.map(|r| r.clamp(0.05, 100.0)),
                    steady_load: engine_steady_load.clamp(0.01, 1.0),
                })
            };
            let cfg = hearth_bench::fairness::FairnessConfig {
                sim_seconds: if quick { 30.0 } else { sim_seconds.clamp(5.0, 3600.0) },
                steady_rps: steady_rps.clamp(0.01, 100.0),
                flood: flood.clamp(1.0, 1000.0),
                seed,
                mixed: hearth_engine::worker::sim::MixedStep::parse(&step_cost).unwrap_or_default(),
                engine,
            };
            let report = hearth_bench::fairness::run(cfg).await?;
            print!("{}", report.table());
            write_json(&report, json)
        }
        BenchCommand::Agent {
            model,
            requests,
            seeds,
            seed,
            quick,
            json,
        } => {
            let (path, id) = resolve_model(&model).await?;
            let cfg = hearth_bench::agent::AgentConfig {
                model: path,
                model_id: id,
                engine: model.engine_config(),
                requests: if quick { 2 } else { requests.clamp(1, 1000) },
                seeds: if quick { 8 } else { seeds.clamp(1, 10_000) },
                seed,
            };
            let report = hearth_bench::agent::run(cfg).await?;
            print!("{}", report.table());
            write_json(&report, json)
        }
        BenchCommand::Routing {
            workers,
            quick,
            seed,
            json,
        } => {
            let cfg = hearth_bench::routing::RoutingBenchConfig {
                workers: workers.clamp(1, 64),
                quick,
                seed,
            };
            let report = tokio::task::spawn_blocking(move || hearth_bench::routing::run(cfg)).await?;
            print!("{}", report.table());
            write_json(&report, json)
        }
    }
}

async fn engine(model: ModelArgs, quick: bool, speculative: bool, json: Option<PathBuf>) -> anyhow::Result<()> {
    let (path, id) = resolve_model(&model).await?;
    let cfg = model.engine_config();
    let bench = hearth_bench::engine::BenchConfig {
        threads: cfg.threads,
        kv_cache_mib: cfg.kv_cache_mib,
        kv_dtype: cfg.kv_dtype,
        isa: cfg.isa,
        quick,
        speculative,
    };
    let report = hearth_bench::engine::run(&path, &id, &bench).await?;
    print!("{}", report.table());
    write_json(&report, json)
}
