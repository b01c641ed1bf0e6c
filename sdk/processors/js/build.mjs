// Builds a JavaScript processor into a hearth:processor component:
//   node build.mjs [--no-warm] SOURCE.js OUT.wasm
//
// componentize-js evaluates the processor and its generated bindings once, under Wizer, and
// the component starts from that snapshot. Each hook's binding (the code that reads the
// request out of linear memory and writes the action back) is otherwise compiled and first
// run inside every request, since every request gets a fresh instance of the snapshot. With
// the warm-up (the default) each binding also runs once during the snapshot, with empty
// strings and lists and a stand-in hook that continues, so that work is in the snapshot.
// The processor's own hooks are not called: they see only real requests.
import { readFile, writeFile } from 'node:fs/promises';
import { fileURLToPath } from 'node:url';
import { dirname, resolve } from 'node:path';
import { componentize } from '@bytecodealliance/componentize-js';

const here = dirname(fileURLToPath(import.meta.url));
const args = process.argv.slice(2);
const flags = args.filter((a) => a.startsWith('--'));
const [source, out, ...extra] = args.filter((a) => !a.startsWith('--'));
if (!source || !out || extra.length || flags.some((f) => f !== '--no-warm')) {
  console.error('usage: node build.mjs [--no-warm] SOURCE.js OUT.wasm');
  process.exit(2);
}
const warm = !flags.includes('--no-warm');

let warmed = false;
if (warm) {
  // The splicer module that componentize() itself imports (its package exports only the
  // entry point, so it is found next to that): the same module instance, patched here.
  const entry = import.meta.resolve('@bytecodealliance/componentize-js');
  const { splicer } = await import(new URL('../lib/spidermonkey-embedding-splicer.js', entry));
  const splice = splicer.spliceBindings;
  splicer.spliceBindings = (...spliceArgs) => {
    const spliced = splice(...spliceArgs);
    spliced.jsBindings += warmUpScript(spliced.exports, spliced.jsBindings);
    warmed = true;
    return spliced;
  };
}

const { component } = await componentize(await readFile(source, 'utf8'), {
  witPath: resolve(here, '../../../runtime/wit'),
  worldName: 'processor',
  // No outgoing HTTP in a processor; stdio (captured), clocks (coarse) and random stay.
  disableFeatures: ['http', 'fetch-event'],
});
if (warm && !warmed) {
  throw new Error('componentize-js did not splice its bindings through the patched splicer: no warm-up');
}
await writeFile(out, component);
console.log(`${out}: ${component.length} bytes${warm ? '' : ' (no warm-up)'}`);

// The code appended to the bindings script. Every export's binding is called once with
// zeroed core arguments (for this world's parameters, all strings, lists and integers:
// empty strings and lists, index 0) and a return area of its own, freed when the call is
// done. Its hook variable points at a stand-in for the call and is unset again after, as
// the bindings leave it until the processor's module is bound. The bindings are async: a
// failure after their first await is kept and thrown from bindExports, which componentize
// calls once the processor's module is evaluated (after these calls have settled), so the
// build fails instead of snapshotting a half-run binding.
function warmUpScript(exports, bindings) {
  const calls = [];
  const hooks = [];
  for (const [name, fn] of exports) {
    const hook = name.replace(/^export_/, '');
    const argc = fn.params.length + (fn.retptr ? 1 : 0);
    const params = Array.from({ length: argc }, (_, i) => `arg${i}`).join(', ');
    const shaped =
      hook !== name &&
      !fn.paramptr &&
      fn.params.every((p) => p === 'i32') &&
      bindings.includes(`async function ${name}(${params})`) &&
      bindings.includes(`let ${hook};`) &&
      bindings.includes('function bindExports(');
    if (!shaped) {
      throw new Error(
        `the warm-up does not know componentize-js's binding for ${name}; ` +
          'build with --no-warm (or pin the componentize-js this SDK names)',
      );
    }
    const core = fn.params.map(() => '0');
    let done = '';
    if (fn.retptr) {
      core.push(`area_${hook}`);
      calls.push(`const area_${hook} = $realloc(0, 0, 4, ${fn.retsize});`);
      done = `.then(() => $dealloc(area_${hook}, ${fn.retsize}, 4))`;
    }
    hooks.push(hook);
    calls.push(`${name}(${core.join(', ')})${done}.catch(fail);`);
  }
  return `
{
  let failure = null;
  const fail = (e) => { failure ??= e; };
  const bind = bindExports;
  bindExports = function (...bindArgs) {
    if (failure) throw new Error('the warm-up of the bindings failed: ' + failure);
    return bind.apply(this, bindArgs);
  };
  const proceed = () => ({ tag: 'continue' });
  ${hooks.map((h) => `${h} = proceed;`).join(' ')}
  try {
    ${calls.join('\n    ')}
  } finally {
    ${hooks.map((h) => `${h} = undefined;`).join(' ')}
  }
}
`;
}
