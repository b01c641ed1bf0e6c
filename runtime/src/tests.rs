//! Guests written as WebAssembly text (core modules following the canonical ABI, made into
//! components with `wit-component`): a trivial one, and the hostile ones.

use std::time::Instant;

use super::*;

use crate::wat_guest::{component, component_for, guest, trivial};

fn c(core: &str) -> Vec<u8> {
    component(core).unwrap()
}

fn runtime() -> Runtime {
    Runtime::new(None).unwrap()
}

fn request(body: &str) -> Request {
    Request {
        tenant: "acme".into(),
        model: "m".into(),
        endpoint: "/v1/chat/completions".into(),
        body: body.into(),
        headers: vec![Header {
            name: "user-agent".into(),
            value: "test".into(),
        }],
    }
}

async fn run_request(rt: &Runtime, wasm: &[u8], limits: Limits) -> Result<Action, ProcessorError> {
    let c = rt.compile(wasm)?;
    let mut i = rt.instantiate(&c, "{}", limits).await?;
    i.on_request(&request("{\"model\":\"m\"}")).await
}

#[tokio::test]
async fn a_trivial_guest_continues() {
    let rt = runtime();
    let wasm = trivial();
    let c = rt.compile(&wasm).unwrap();
    let mut i = rt.instantiate(&c, "{}", Limits::default()).await.unwrap();
    assert_eq!(i.on_request(&request("{}")).await.unwrap(), Action::Continue);
    let resp = Response {
        tenant: "acme".into(),
        model: "m".into(),
        endpoint: "/v1/chat/completions".into(),
        body: "{}".into(),
    };
    assert_eq!(i.on_response(&resp).await.unwrap(), Action::Continue);
    assert_eq!(i.on_chunk(0, "hello").await.unwrap(), Action::Continue);
    assert_eq!(i.on_stream_end().await.unwrap(), Action::Continue);
    // Compiled once, by content hash.
    assert!(Arc::ptr_eq(&c, &rt.compile(&wasm).unwrap()));
}

#[tokio::test]
async fn replace_reject_config_and_logs() {
    let rt = runtime();
    // on-request: log "hi", then replace the body with the config string.
    let g = guest(
        r#"(call $log (i32.const 1) (i32.const 512) (i32.const 2))
           (call $config (i32.const 256))
           (i32.store8 (i32.const 128) (i32.const 1))
           (i32.store (i32.const 132) (i32.load (i32.const 256)))
           (i32.store (i32.const 136) (i32.load (i32.const 260)))
           (i32.const 128)"#,
        r#"(import "hearth:processor/host@0.1.0" "log" (func $log (param i32 i32 i32)))
           (import "hearth:processor/host@0.1.0" "config" (func $config (param i32)))
           (data (i32.const 512) "hi")"#,
    );
    let c = rt.compile(&component(&g).unwrap()).unwrap();
    let mut i = rt
        .instantiate(&c, r#"{"model":"replaced"}"#, Limits::default())
        .await
        .unwrap();
    assert_eq!(
        i.on_request(&request("{}")).await.unwrap(),
        Action::Replace(r#"{"model":"replaced"}"#.into())
    );
    assert_eq!(i.logs(), "[info] hi\n");
    // A rejection: status 451 and a message.
    let g = guest(
        r#"(i32.store8 (i32.const 128) (i32.const 2))
           (i32.store16 (i32.const 132) (i32.const 451))
           (i32.store (i32.const 136) (i32.const 512))
           (i32.store (i32.const 140) (i32.const 7))
           (i32.const 128)"#,
        r#"(data (i32.const 512) "blocked")"#,
    );
    let got = run_request(&rt, &component(&g).unwrap(), Limits::default())
        .await
        .unwrap();
    assert_eq!(
        got,
        Action::Reject(Rejection {
            status: 451,
            message: "blocked".into()
        })
    );
}

#[tokio::test]
async fn an_infinite_loop_hits_the_cpu_limit_quickly() {
    let rt = runtime();
    let wasm = c(&guest("(loop (br 0)) (i32.const 0)", ""));
    let t = Instant::now();
    let e = run_request(
        &rt,
        &wasm,
        Limits {
            cpu_ms: 20,
            ..Default::default()
        },
    )
    .await
    .unwrap_err();
    assert_eq!(e, ProcessorError::Cpu(20));
    assert!(t.elapsed() < Duration::from_secs(2), "took {:?}", t.elapsed());
}

#[tokio::test]
async fn a_memory_bomb_hits_the_memory_limit() {
    let rt = runtime();
    let wasm = c(&guest(
        "(loop (drop (memory.grow (i32.const 16))) (br 0)) (i32.const 0)",
        "",
    ));
    let e = run_request(
        &rt,
        &wasm,
        Limits {
            memory_mib: 16,
            ..Default::default()
        },
    )
    .await
    .unwrap_err();
    assert_eq!(e, ProcessorError::Memory(16));
}

#[tokio::test]
async fn deep_recursion_and_traps_fail_cleanly() {
    let rt = runtime();
    let wasm = c(&guest(
        "(call $down (i32.const 0))",
        "(func $down (param i32) (result i32) (call $down (i32.add (local.get 0) (i32.const 1))))",
    ));
    match run_request(&rt, &wasm, Limits::default()).await {
        Err(ProcessorError::Trap(m)) => assert!(m.contains("stack"), "{m}"),
        other => panic!("expected a stack overflow trap, got {other:?}"),
    }
    let wasm = c(&guest("unreachable", ""));
    match run_request(&rt, &wasm, Limits::default()).await {
        Err(ProcessorError::Trap(m)) => assert!(m.contains("unreachable"), "{m}"),
        other => panic!("expected a trap, got {other:?}"),
    }
}

#[tokio::test]
async fn a_huge_output_is_refused() {
    let rt = runtime();
    // Replace with 4 MiB of zero bytes.
    let wasm = c(&guest(
        r#"(drop (memory.grow (i32.const 80)))
           (i32.store8 (i32.const 128) (i32.const 1))
           (i32.store (i32.const 132) (i32.const 65536))
           (i32.store (i32.const 136) (i32.const 4194304))
           (i32.const 128)"#,
        "",
    ));
    let e = run_request(&rt, &wasm, Limits::default()).await.unwrap_err();
    assert!(
        matches!(e, ProcessorError::OutputTooLarge { size: 4194304, .. }),
        "{e:?}"
    );
    // And too large an input is refused before the guest runs.
    let c = rt.compile(&trivial()).unwrap();
    let mut i = rt
        .instantiate(
            &c,
            "{}",
            Limits {
                max_input_bytes: 10,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let e = i.on_request(&request(&"x".repeat(100))).await.unwrap_err();
    assert!(matches!(e, ProcessorError::InputTooLarge { .. }), "{e:?}");
}

#[tokio::test]
async fn a_guest_importing_something_not_offered_is_refused_at_upload() {
    let wit = r#"package evil:guest;
world processor {
    import steal-secrets: func() -> string;
    export on-request: func() -> u32;
}"#;
    let core = r#"(module
  (import "$root" "steal-secrets" (func (param i32)))
  (memory (export "memory") 1)
  (func (export "cabi_realloc") (param i32 i32 i32 i32) (result i32) (i32.const 1024))
  (func (export "on-request") (result i32) (i32.const 0)))"#;
    let wasm = component_for(core, wit, "processor").unwrap();
    match runtime().compile(&wasm) {
        Err(ProcessorError::Invalid(m)) => assert!(m.contains("steal-secrets"), "{m}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    // Not a component at all.
    assert!(matches!(
        runtime().compile(b"\0asm\x01\0\0\0"),
        Err(ProcessorError::Invalid(_))
    ));
    assert!(matches!(runtime().compile(b"garbage"), Err(ProcessorError::Invalid(_))));
}

/// A guest spinning at its CPU limit does not stop other guests on the same threads: it
/// yields to the executor every millisecond.
#[tokio::test(flavor = "current_thread")]
async fn a_busy_guest_does_not_block_others() {
    let rt = Arc::new(runtime());
    let busy = rt.compile(&c(&guest("(loop (br 0)) (i32.const 0)", ""))).unwrap();
    let quick = rt.compile(&trivial()).unwrap();
    let rt2 = rt.clone();
    let spinner = tokio::spawn(async move {
        let mut i = rt2
            .instantiate(
                &busy,
                "{}",
                Limits {
                    cpu_ms: 500,
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        i.on_request(&request("{}")).await
    });
    tokio::task::yield_now().await;
    // On the single executor thread, while the spinner runs, quick guests still finish.
    let t = Instant::now();
    for _ in 0..20 {
        let mut i = rt.instantiate(&quick, "{}", Limits::default()).await.unwrap();
        assert_eq!(i.on_request(&request("{}")).await.unwrap(), Action::Continue);
    }
    let quick_time = t.elapsed();
    assert!(!spinner.is_finished(), "the spinner should still be running");
    assert!(quick_time < Duration::from_millis(400), "{quick_time:?}");
    assert_eq!(spinner.await.unwrap().unwrap_err(), ProcessorError::Cpu(500));
}

/// A guest with state: each `on-request` adds one to a global and replaces the body with
/// `global + memory[600]` x's, then sets memory[600] to 1. A fresh instance answers "x"; a
/// second call on the same instance "xxx".
fn stateful() -> Vec<u8> {
    c(&guest(
        r#"(global.set $n (i32.add (global.get $n) (i32.const 1)))
           (i32.store8 (i32.const 128) (i32.const 1))
           (i32.store (i32.const 132) (i32.const 700))
           (i32.store (i32.const 136) (i32.add (global.get $n) (i32.load8_u (i32.const 600))))
           (i32.store8 (i32.const 600) (i32.const 1))
           (i32.const 128)"#,
        r#"(global $n (mut i32) (i32.const 0))
           (data (i32.const 700) "xxxxxxxxxxxxxxxx")"#,
    ))
}

#[tokio::test]
async fn a_guest_never_sees_a_previous_requests_state() {
    let rt = runtime();
    let code = rt.compile(&stateful()).unwrap();
    let replaced = |a: Action| match a {
        Action::Replace(s) => s,
        other => panic!("expected a replacement, got {other:?}"),
    };
    // The guest does keep state within one instance (globals and memory)...
    let mut one = rt.instantiate(&code, "{}", Limits::default()).await.unwrap();
    assert_eq!(replaced(one.on_request(&request("{}")).await.unwrap()), "x");
    assert_eq!(replaced(one.on_request(&request("{}")).await.unwrap()), "xxx");
    // ...but each request's instance starts from the component's image, whether the last
    // one is still alive or was dropped (its pool slot reused), and whether it was made on
    // the request's path or ahead of it (taken from the shelf).
    for n in 0..20 {
        let mut i = rt.instantiate(&code, "{}", Limits::default()).await.unwrap();
        assert_eq!(
            replaced(i.on_request(&request("{}")).await.unwrap()),
            "x",
            "request {n}"
        );
        assert_eq!(replaced(i.on_request(&request("{}")).await.unwrap()), "xxx");
        // One taken from the shelf, made after the instances above were released.
        if n % 2 == 0 {
            let mut i = ready(&rt, &code, "{}", Limits::default()).await;
            assert_eq!(replaced(i.on_request(&request("{}")).await.unwrap()), "x", "warm {n}");
        }
    }
}

/// An instance taken from the shelf: instantiates until one comes warm (the maker thread
/// tops the shelf up after each release).
async fn ready(rt: &Runtime, code: &Arc<Compiled>, config: &str, limits: Limits) -> Instance {
    for _ in 0..500 {
        let i = rt.instantiate(code, config, limits).await.unwrap();
        if i.was_warm() {
            return i;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the shelf never refilled");
}

/// Instances are made ahead per processor, configuration and limits, handed out once, and
/// counted; with shelves off every request makes its own.
#[tokio::test]
async fn instances_are_made_ahead_per_configuration_and_counted() {
    let rt = runtime();
    let code = rt.compile(&stateful()).unwrap();
    // The first request of a processor finds an empty shelf.
    let first = rt.instantiate(&code, "{}", Limits::default()).await.unwrap();
    assert!(!first.was_warm());
    let mut a = ready(&rt, &code, "{}", Limits::default()).await;
    // Another configuration is another shelf: its guest reads its own configuration.
    let b = rt.instantiate(&code, "{\"other\":1}", Limits::default()).await.unwrap();
    assert!(!b.was_warm());
    let mut b = ready(&rt, &code, "{\"other\":1}", Limits::default()).await;
    assert_eq!(b.live().unwrap().1.data().config, "{\"other\":1}");
    assert_eq!(a.live().unwrap().1.data().config, "{}");
    // So are other limits.
    let tight = Limits {
        cpu_ms: 7,
        ..Default::default()
    };
    let c = rt.instantiate(&code, "{}", tight).await.unwrap();
    assert!(!c.was_warm());
    let mut c = ready(&rt, &code, "{}", tight).await;
    assert_eq!(c.live().unwrap().1.data().max_ticks, 7);
    let stats = rt.warm_stats();
    assert!(stats.warm >= 2 && stats.made >= 3, "{stats:?}");
    // Both shelves' instances are fresh.
    for i in [&mut a, &mut b] {
        assert_eq!(i.on_request(&request("{}")).await.unwrap(), Action::Replace("x".into()));
    }

    let off = runtime().with_warm(0);
    let code = off.compile(&stateful()).unwrap();
    for _ in 0..5 {
        assert!(!off
            .instantiate(&code, "{}", Limits::default())
            .await
            .unwrap()
            .was_warm());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(off.warm_stats(), WarmStats { warm: 0, made: 5 });
}

/// Ready instances on a processor's shelf (configuration "{}") now.
fn shelved(rt: &Runtime, code: &Compiled, limits: Limits) -> usize {
    let key = WarmKey::new(code, "{}", limits.clamped());
    let shelves = rt.warm.shelves.lock().unwrap();
    shelves.get(&key).map_or(0, |s| s.ready.len())
}

/// Instances taken while their shelf is being topped up are made too: after requests taken
/// and released in many interleavings with the maker thread (a release starts a top-up, the
/// next take empties what it made), the shelf ends full.
#[tokio::test]
async fn a_shelf_emptied_during_its_top_up_ends_full() {
    let rt = runtime().with_warm(3);
    let code = rt.compile(&stateful()).unwrap();
    let limits = Limits::default();
    let mut held = std::collections::VecDeque::new();
    for n in 0..200 {
        if held.len() == 3 {
            drop(held.pop_front());
        }
        if n % 7 == 0 {
            tokio::time::sleep(Duration::from_micros(50)).await;
        }
        held.push_back(rt.instantiate(&code, "{}", limits).await.unwrap());
    }
    drop(held);
    full(&rt, &code, limits).await;
    // And its top-up ended: the next release starts another.
    let taken = rt.instantiate(&code, "{}", limits).await.unwrap();
    assert!(taken.was_warm());
    drop(taken);
    full(&rt, &code, limits).await;
}

/// Waits for the shelf of `code` (configuration "{}") to hold 3.
async fn full(rt: &Runtime, code: &Compiled, limits: Limits) {
    for _ in 0..500 {
        if shelved(rt, code, limits) == 3 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the shelf holds {} of 3", shelved(rt, code, limits));
}
