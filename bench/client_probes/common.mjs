// the probes' harness: every case runs against two running servers (this
// starts none), kvblend first, then llama-server, and a result per server
// (pass, or FAIL and why) goes to stdout as JSON for table.mjs.
//   node openai_probes.mjs URL_KVBLEND URL_LLAMA   (URLs with or without /v1)
// environment: PROBE_API_KEY (the servers' --api-key, default probe-key),
// PROBE_ONLY (a substring: only the cases whose name holds it),
// PROBE_TIMEOUT_S (per case and server, default 180), PROBE_LLAMA_EMBED_URL
// (llama-server answers /v1/embeddings only when started with --embeddings,
// and the other cases were measured on one started without it: the
// embeddings cases may go to a second one; kvblend serves them all).
import assert from 'node:assert/strict';
import fs from 'node:fs';
import { pathToFileURL } from 'node:url';

// the packages come from the server tests' node_modules: an ES module
// resolves bare names only from folders above itself, so they are found
// here by their package.json's "exports" (the import condition)
const NODE_MODULES = new URL('../../tests/server/node/node_modules/', import.meta.url);

function pickExport(entry) {
  if (typeof entry === 'string') return entry;
  if (!entry || typeof entry !== 'object') return null;
  for (const cond of ['import', 'default', 'node']) {
    if (cond in entry) {
      const got = pickExport(entry[cond]);
      if (got) return got;
    }
  }
  return null;
}

export async function pkg(specifier) {
  const parts = specifier.split('/');
  const name = specifier.startsWith('@') ? parts.slice(0, 2).join('/') : parts[0];
  const sub = '.' + specifier.slice(name.length);
  const dir = new URL(name + '/', NODE_MODULES);
  const meta = JSON.parse(fs.readFileSync(new URL('package.json', dir), 'utf8'));
  let file = null;
  if (meta.exports) {
    const ex = meta.exports;
    if (sub === '.') file = pickExport(ex['.'] ?? ex);
    else if (sub in ex) file = pickExport(ex[sub]);
    else {  // a pattern such as "./helpers/*"
      for (const [k, v] of Object.entries(ex)) {
        const star = k.indexOf('*');
        if (star < 0 || k.indexOf('*', star + 1) >= 0) continue;
        const [head, tail] = [k.slice(0, star), k.slice(star + 1)];
        if (sub.startsWith(head) && sub.endsWith(tail) && sub.length >= head.length + tail.length) {
          const target = pickExport(v);
          if (target) file = target.replace('*', sub.slice(head.length, sub.length - tail.length));
          if (file) break;
        }
      }
    }
  }
  if (!file && sub === '.') file = meta.module ?? meta.main ?? 'index.js';
  if (!file) throw new Error(`cannot resolve ${specifier} in ${dir.pathname}`);
  return import(new URL(file, dir).href);
}

export const API_KEY = process.env.PROBE_API_KEY ?? 'probe-key';

function rootOf(url) {
  if (!url) return null;
  return url.replace(/\/+$/, '').replace(/\/v1$/, '');
}

// the two servers named on the command line
export function serversFromArgs() {
  const [kvblend, llama] = process.argv.slice(2);
  if (!kvblend || !llama) {
    console.error('usage: node PROBES.mjs URL_KVBLEND URL_LLAMA_SERVER');
    process.exit(2);
  }
  return [
    { label: 'kvblend', root: rootOf(kvblend), embedRoot: rootOf(kvblend), isKvblend: true },
    { label: 'llama-server', root: rootOf(llama), embedRoot: rootOf(process.env.PROBE_LLAMA_EMBED_URL ?? llama),
      isKvblend: false },
  ];
}

// a raw HTTP call (for what the clients do not wrap): {status, body}
export async function http(server, method, path, body, headers = {}) {
  const r = await fetch(server.root + path, {
    method,
    headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${API_KEY}`, ...headers },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await r.text();
  let json = null;
  try {
    json = JSON.parse(text);
  } catch {}
  return { status: r.status, json, text };
}

// the token id of a text that is one token (special tokens too)
export async function tokenOf(server, text) {
  const r = await http(server, 'POST', '/tokenize', { content: text, parse_special: true, add_special: false });
  assert.equal(r.status, 200, `/tokenize: ${r.text.slice(0, 200)}`);
  const ids = r.json.tokens.map((t) => (typeof t === 'number' ? t : t.id));
  assert.equal(ids.length, 1, `'${text}' is ${ids.length} tokens`);
  return ids[0];
}

// what every case gets about its server: the model id and the token ids it biases
export async function prepare(server) {
  const models = await http(server, 'GET', '/v1/models');
  assert.equal(models.status, 200, `/v1/models: ${models.text.slice(0, 200)}`);
  server.model = models.json.data[0].id;
  server.tok = {};
  for (const [k, text] of Object.entries({
    imEnd: '<|im_end|>', endOfText: '<|endoftext|>', brace: '}', quote: '"',
    paris: ' Paris',
  }))
    server.tok[k] = await tokenOf(server, text);
  // the ends of a turn made as likely as can be: random weights stop as soon as a grammar allows
  server.endBias = { [server.tok.imEnd]: 100, [server.tok.endOfText]: 100 };
  return server;
}

export function withTimeout(promise, ms, what) {
  let timer;
  return Promise.race([
    promise.finally(() => clearTimeout(timer)),
    new Promise((_, reject) => {
      timer = setTimeout(() => reject(new Error(`timed out after ${ms / 1000} s (${what})`)), ms);
    }),
  ]);
}

function reasonOf(e) {
  let s = e?.status ? `${e.status} ` : '';
  s += (e?.message ?? String(e)).replace(/\s+/g, ' ').trim();
  return s.length > 160 ? s.slice(0, 157) + '...' : s;
}

// cases: [{group, name, kvblendOnly?, run: async (server) => {}}]; a case passes
// when run returns without throwing (its assertions held)
export async function runSuite(suite, cases, makeServers = serversFromArgs) {
  const servers = makeServers();
  const only = process.env.PROBE_ONLY;
  const timeoutMs = Number(process.env.PROBE_TIMEOUT_S ?? 180) * 1000;
  const ready = {};
  for (const s of servers) {
    try {
      await withTimeout(prepare(s), 60000, 'prepare');
      ready[s.label] = null;
    } catch (e) {
      ready[s.label] = `server not ready: ${reasonOf(e)}`;
    }
  }
  const rows = [];
  for (const c of cases) {
    if (only && !c.name.includes(only)) continue;
    const row = { suite, group: c.group, name: c.name, kvblendOnly: !!c.kvblendOnly, results: {} };
    for (const s of servers) {
      if (c.kvblendOnly && !s.isKvblend) {
        row.results[s.label] = { status: 'n/a', reason: 'kvblend-only field' };
        continue;
      }
      if (ready[s.label]) {
        row.results[s.label] = { status: 'FAIL', reason: ready[s.label] };
        continue;
      }
      const t0 = Date.now();
      try {
        await withTimeout(Promise.resolve().then(() => c.run(s)), timeoutMs, c.name);
        row.results[s.label] = { status: 'pass', ms: Date.now() - t0 };
      } catch (e) {
        row.results[s.label] = { status: 'FAIL', reason: reasonOf(e), ms: Date.now() - t0 };
      }
      const r = row.results[s.label];
      console.error(`${suite} | ${c.name} | ${s.label}: ${r.status}${r.reason ? ' (' + r.reason + ')' : ''} ${r.ms} ms`);
    }
    rows.push(row);
  }
  process.stdout.write(JSON.stringify(rows, null, 1) + '\n');
}

// asserts shared by the suites
export function assertUsage(usage, completionTokens) {
  assert.ok(usage, 'usage is present');
  assert.ok(Number.isInteger(usage.prompt_tokens) && usage.prompt_tokens > 0, `prompt_tokens ${usage.prompt_tokens}`);
  if (completionTokens !== undefined)
    assert.equal(usage.completion_tokens, completionTokens, 'completion_tokens');
  assert.equal(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens, 'total_tokens = prompt + completion');
}

// a stop string taken from an answer: a piece that first occurs at least
// 3 characters in, so that the answer cut before it is not empty
export function stopFrom(text) {
  const chars = [...text];
  for (let at = 3; at + 2 <= chars.length; at++) {
    const stop = chars.slice(at, at + 2).join('');
    // U+FFFD stands for bytes of a character cut between tokens: no server matches it
    if (!/^\s*$/.test(stop) && !stop.includes('\uFFFD') && text.indexOf(stop) === chars.slice(0, at).join('').length) return stop;
  }
  return null;
}

export { assert };
