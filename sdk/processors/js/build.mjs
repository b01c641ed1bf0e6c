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
const warm = !args.includes('--no-warm');
const [source, out] = args.filter((a) => a !== '--no-warm');
if (!source || !out) {
  console.error('usage: node build.mjs [--no-warm] SOURCE.js OUT.wasm');
  process.exit(2);
}

if (warm) {
  // The same module instance componentize() uses (the package exports only its entry point,
  // so it is imported by path).
  const { splicer } = await import(
    resolve(here, 'node_modules/@bytecodealliance/componentize-js/lib/spidermonkey-embedding-splicer.js')
  );
  const splice = splicer.spliceBindings;
  splicer.spliceBindings = (...spliceArgs) => {
    const spliced = splice(...spliceArgs);
    spliced.jsBindings += warmUp(spliced.exports, spliced.jsBindings);
    return spliced;
  };
}

const { component } = await componentize(await readFile(source, 'utf8'), {
  witPath: resolve(here, '../../../runtime/wit'),
  worldName: 'processor',
  // No outgoing HTTP in a processor; stdio (captured), clocks (coarse) and random stay.
  disableFeatures: ['http', 'fetch-event'],
});
await writeFile(out, component);
console.log(`${out}: ${component.length} bytes${warm ? '' : ' (no warm-up)'}`);

// The code appended to the bindings script: every export's binding called once with zeroed
// core arguments (empty strings and lists, index 0) and a fresh return area, its hook
// variable pointing at a stand-in for the call and unset again after, as the bindings
// leave it until the processor's module is bound. The return areas are freed by the first
// real call, with the rest of its allocations.
function warmUp(exports, bindings) {
  const calls = [];
  const hooks = [];
  for (const [name, fn] of exports) {
    const hook = name.replace(/^export_/, '');
    const shaped =
      hook !== name &&
      !fn.paramptr &&
      fn.params.every((p) => p === 'i32') &&
      bindings.includes(`async function ${name}(`) &&
      bindings.includes(`let ${hook};`);
    if (!shaped) {
      throw new Error(
        `the warm-up does not know componentize-js's binding for ${name}; ` +
          'build with --no-warm (or pin the componentize-js this SDK names)',
      );
    }
    const core = fn.params.map(() => '0');
    if (fn.retptr) core.push(`$realloc(0, 0, 4, ${fn.retsize})`);
    hooks.push(hook);
    calls.push(`${name}(${core.join(', ')});`);
  }
  return `
{
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
