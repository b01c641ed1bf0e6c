//! Pipeline groups from the command line: `hearth worker --stage` (a leader's settings, or
//! a follower stage's whole life) and `hearth serve --pipeline N` (the other stages as
//! local processes, restarted when they die).

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use hearth_engine::models::{LoadOptions, Model, StagePlan};
use hearth_engine::pipeline::stage::{serve, StageOptions};
use hearth_engine::pipeline::PipelineConfig;

use crate::args::{ModelArgs, StageArgs};
use crate::launch::resolve_model;

/// Whether a plan names the first stage (the leader).
fn leads(plan: &StagePlan) -> bool {
    match plan {
        StagePlan::Balanced { index, .. } => *index == 0,
        StagePlan::Layers(r) => r.start == 0,
    }
}

/// What `--stage` makes of a worker: None (no stage, or the leader, whose settings are
/// now in `model`), or Some(a follower stage to run instead of the worker API).
pub fn apply(stage: &StageArgs, model: &mut ModelArgs, token: Option<&str>) -> anyhow::Result<Option<StagePlan>> {
    let Some(plan) = stage.stage.clone() else {
        if !stage.stage_next.is_empty() || stage.stage_listen.is_some() {
            bail!("--stage-next and --stage-listen belong to a pipeline stage: add --stage K/N");
        }
        return Ok(None);
    };
    if !leads(&plan) {
        if stage.stage_listen.is_none() {
            bail!("a pipeline stage after the first listens for the stage before it: add --stage-listen HOST:PORT");
        }
        return Ok(Some(plan));
    }
    if stage.stage_next.is_empty() {
        bail!("the pipeline's first stage (the leader) needs its other stages: --stage-next HOST:PORT[,HOST:PORT…]");
    }
    if let StagePlan::Balanced { count, .. } = plan {
        if count != stage.stage_next.len() + 1 {
            bail!(
                "--stage 1/{count} names {} other stages in --stage-next; a group of {count} has {}",
                stage.stage_next.len(),
                count - 1
            );
        }
    }
    let mut p = PipelineConfig::new(stage.stage_next.clone(), token.map(str::to_string));
    if let Some(m) = stage.microbatches {
        p.microbatches = m;
    }
    model.stage = Some(plan);
    model.pipeline = Some(p);
    Ok(None)
}

/// A follower stage: loads its layers, then serves the stage before it until the process
/// ends.
pub async fn follower(
    plan: StagePlan,
    stage: &StageArgs,
    model: &ModelArgs,
    token: Option<String>,
) -> anyhow::Result<()> {
    let (path, _) = resolve_model(model).await?;
    let listen = stage.stage_listen.context("--stage-listen")?;
    let mut cfg = model.engine_config();
    cfg.stage = Some(plan.clone());
    if token.is_none() && !listen.ip().is_loopback() {
        tracing::warn!(%listen, "no workers' token (HEARTH_WORKER_TOKEN): any process that reaches this address can drive this stage");
    }
    // Bound before the (long) load, so the port is this stage's from the start: a leader
    // connecting meanwhile waits in the backlog, and no other process can take the port.
    let listener = TcpListener::bind(listen).with_context(|| format!("cannot listen on {listen}"))?;
    tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        if let Some(isa) = cfg.isa {
            hearth_engine::kernels::set_isa(isa).map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        let file = hearth_engine::formats::hf::open_model(&path)?;
        hearth_engine::engine::config::check_memory(&file, &cfg, hearth_engine::engine::config::kv_mib(&cfg))?;
        let model = Model::load_options(
            file,
            LoadOptions {
                pack_cache: cfg.pack_cache.clone(),
                float_weights: cfg.float_weights,
                rope_scaling: cfg.rope_scaling,
                max_context: cfg.max_context,
                stage: Some(plan),
            },
        )
        .context("loading the stage's layers")?;
        let span = model.span();
        let fingerprint = hearth_engine::models::stage::fingerprint(model.file());
        println!(
            "Hearth pipeline stage ({span}) is listening on {}",
            listener.local_addr()?
        );
        let opts = StageOptions {
            fingerprint,
            token,
            kv_cache_mib: cfg.kv_cache_mib,
            threads: cfg.threads,
        };
        serve(listener, model, opts)?;
        Ok(())
    })
    .await?
}

/// `hearth serve --pipeline N`'s other stages: processes of this binary on loopback ports,
/// each restarted when it dies, all killed with this process.
pub struct LocalStages {
    stop: Arc<AtomicBool>,
}

impl Drop for LocalStages {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

impl LocalStages {
    /// Starts stages 2..=n of `path`; `model` becomes the leader's settings (stage 1, its
    /// share of the threads).
    pub fn start(n: usize, path: &Path, model: &mut ModelArgs) -> anyhow::Result<Self> {
        let total = model
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        let threads = (total / n).max(1);
        let token = hearth_engine::pipeline::wire::nonce();
        let stop = Arc::new(AtomicBool::new(false));
        let mut next = Vec::new();
        for k in 2..=n {
            // A fixed port, so the leader finds a restarted stage where it was.
            let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
            let addr = format!("127.0.0.1:{port}");
            let mut args: Vec<String> = vec![
                "worker".into(),
                "--model".into(),
                path.display().to_string(),
                "--stage".into(),
                format!("{k}/{n}"),
                "--stage-listen".into(),
                addr.clone(),
                "--threads".into(),
                threads.to_string(),
                "--isa".into(),
                model.isa.to_string(),
                "--float-weights".into(),
                model.float_weights.name().into(),
                "--pack-cache".into(),
                model.pack_cache.name().into(),
                "--kv-dtype".into(),
                model.kv_dtype.name().into(),
            ];
            for (flag, v) in [
                ("--kv-cache-mib", model.kv_cache_mib.map(|v| v.to_string())),
                ("--memory-budget-mib", model.memory_budget_mib.map(|v| v.to_string())),
                ("--context-length", model.context_length.map(|v| v.to_string())),
                ("--pack-dir", model.pack_dir.as_ref().map(|p| p.display().to_string())),
            ] {
                if let Some(v) = v {
                    args.extend([flag.to_string(), v]);
                }
            }
            supervise(k, args, token.clone(), stop.clone())?;
            next.push(addr);
        }
        model.threads = Some(threads);
        model.stage = Some(StagePlan::Balanced { index: 0, count: n });
        model.pipeline = Some(PipelineConfig::new(next, Some(token)));
        Ok(Self { stop })
    }
}

/// Runs one stage process, starting it again a second after it dies, until `stop`.
fn supervise(k: usize, args: Vec<String>, token: String, stop: Arc<AtomicBool>) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("finding this binary to start the pipeline's stages")?;
    let spawn = move || -> std::io::Result<Child> {
        let mut c = Command::new(&exe);
        c.args(&args)
            .env("HEARTH_WORKER_TOKEN", &token)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        // The stage dies with the thread that started it: the caller's for the first start
        // (`hearth serve`'s main thread, which lives as long as the process), this
        // supervisor's for a restart.
        // SAFETY: prctl is async-signal-safe and touches only the child.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut c, || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        c.spawn()
    };
    let mut child = spawn().context("starting a pipeline stage")?;
    std::thread::Builder::new()
        .name(format!("hearth-stage-{k}"))
        .spawn(move || loop {
            match child.try_wait() {
                Ok(None) if !stop.load(Ordering::Acquire) => std::thread::sleep(Duration::from_millis(200)),
                Ok(None) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return;
                }
                Ok(Some(status)) => {
                    if stop.load(Ordering::Acquire) {
                        return;
                    }
                    tracing::error!(stage = k, %status, "pipeline stage exited; starting it again");
                    std::thread::sleep(Duration::from_secs(1));
                    match spawn() {
                        Ok(c) => child = c,
                        Err(e) => {
                            tracing::error!(stage = k, error = %e, "cannot start the pipeline stage again");
                            return;
                        }
                    }
                }
                Err(_) => return,
            }
        })?;
    Ok(())
}
