;; The smallest processor, in WebAssembly text: every hook continues. Build it with
;;   hearth processor build-wat trivial.wat -o trivial-wat.wasm
;; Canonical ABI: an `action` is returned through a pointer to its discriminant (0 =
;; continue) at offset 0; memory[0..16] is zero here. `cabi_realloc` is the allocator the
;; host uses to pass strings in (a bump allocator: an instance lives for one request).
(module
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
    (i32.const 0))
  (func (export "on-response") (param i32 i32 i32 i32 i32 i32 i32 i32) (result i32)
    (i32.const 0))
  (func (export "on-chunk") (param i32 i32 i32) (result i32)
    (i32.const 0))
  (func (export "on-stream-end") (result i32)
    (i32.const 0)))
