//! Guests written as WebAssembly text: a core module following the canonical ABI of the
//! `hearth:processor` world, made into a component with `wit-component`. The smallest and
//! fastest guests there are (the benchmark's "compiled" guest; the hostile test guests), and
//! `hearth processor build-wat` for anyone who wants to write one.

use crate::WIT;

/// A core module (WAT) → a `hearth:processor` component.
pub fn component(core: &str) -> anyhow::Result<Vec<u8>> {
    component_for(core, WIT, "processor")
}

pub fn component_for(core: &str, wit: &str, world: &str) -> anyhow::Result<Vec<u8>> {
    let mut module = wat::parse_str(core).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut resolve = wit_parser::Resolve::default();
    let pkg = resolve.push_str("guest.wit", wit)?;
    let world = resolve.select_world(&[pkg], Some(world))?;
    wit_component::embed_component_metadata(&mut module, &resolve, world, wit_component::StringEncoding::UTF8)?;
    wit_component::ComponentEncoder::default()
        .module(&module)?
        .validate(true)
        .encode()
}

/// The exports every guest needs, with `body` as the `on-request` body; the other hooks
/// continue. An `action` is returned through a pointer: discriminant byte at 0 (0 continue,
/// 1 replace, 2 reject), payload from offset 4.
pub fn guest(on_request: &str, extra: &str) -> String {
    format!(
        r#"(module
  {extra}
  (memory (export "memory") 1)
  (global $heap (mut i32) (i32.const 1024))
  (func (export "cabi_realloc") (param i32 i32 i32 i32) (result i32)
    (local $p i32)
    (local.set $p (i32.and (i32.add (global.get $heap) (i32.const 7)) (i32.const -8)))
    (global.set $heap (i32.add (local.get $p) (local.get 3)))
    (if (i32.gt_u (global.get $heap) (i32.mul (memory.size) (i32.const 65536)))
      (then (drop (memory.grow (i32.add (i32.div_u (local.get 3) (i32.const 65536)) (i32.const 1))))))
    (local.get $p))
  (func (export "on-request") (param i32 i32 i32 i32 i32 i32 i32 i32 i32 i32) (result i32)
    {on_request})
  (func (export "on-response") (param i32 i32 i32 i32 i32 i32 i32 i32) (result i32)
    (i32.const 0))
  (func (export "on-chunk") (param i32 i32 i32) (result i32)
    (i32.const 0))
  (func (export "on-stream-end") (result i32)
    (i32.const 0))
)"#
    )
}

/// A processor that continues everything (memory[0..16] is zero: `continue`).
pub fn trivial() -> Vec<u8> {
    component(&guest("(i32.const 0)", "")).expect("the trivial guest builds")
}
