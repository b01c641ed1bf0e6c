// Builds a JavaScript processor into a hearth:processor component:
//   node build.mjs SOURCE.js OUT.wasm
import { readFile, writeFile } from 'node:fs/promises';
import { fileURLToPath } from 'node:url';
import { dirname, resolve } from 'node:path';
import { componentize } from '@bytecodealliance/componentize-js';

const [source, out] = process.argv.slice(2);
if (!source || !out) {
  console.error('usage: node build.mjs SOURCE.js OUT.wasm');
  process.exit(2);
}
const here = dirname(fileURLToPath(import.meta.url));
const { component } = await componentize(await readFile(source, 'utf8'), {
  witPath: resolve(here, '../../../runtime/wit'),
  worldName: 'processor',
  // No outgoing HTTP in a processor; stdio (captured), clocks (coarse) and random stay.
  disableFeatures: ['http', 'fetch-event'],
});
await writeFile(out, component);
console.log(`${out}: ${component.length} bytes`);
