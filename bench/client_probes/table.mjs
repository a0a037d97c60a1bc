// the probes' results as a markdown table: node table.mjs openai.json langchain.json > table.md
// case | kvblend | llama-server, pass or FAIL with the reason; kvblend-only cases
// (its documents field) in their own section; a summary line per suite.
import fs from 'node:fs';

const files = process.argv.slice(2);
if (!files.length) {
  console.error('usage: node table.mjs RESULTS.json...');
  process.exit(2);
}
const esc = (t) => String(t).replace(/\|/g, '\\|').replace(/\n/g, ' ');
const cell = (r) => (!r ? '—' : r.status === 'pass' ? 'pass' : r.status === 'n/a' ? 'n/a' : `**FAIL** ${esc(r.reason ?? '')}`);

const out = [];
for (const f of files) {
  const rows = JSON.parse(fs.readFileSync(f, 'utf8'));
  if (!rows.length) continue;
  const suite = rows[0].suite;
  const shared = rows.filter((r) => !r.kvblendOnly);
  const own = rows.filter((r) => r.kvblendOnly);
  const count = (label) => shared.filter((r) => r.results[label]?.status === 'pass').length;
  const both = shared.filter((r) => r.results['llama-server']?.status === 'pass');
  const behind = both.filter((r) => r.results.kvblend?.status !== 'pass');
  out.push(`### ${suite} (${shared.length} cases)`, '');
  out.push(`kvblend passes ${count('kvblend')}/${shared.length}, llama-server ${count('llama-server')}/${shared.length}; ` +
           `where llama-server passes, kvblend fails ${behind.length}` +
           (behind.length ? ` (${behind.map((r) => r.name).join('; ')})` : '') + '.', '');
  out.push('| group | case | kvblend | llama-server |', '|---|---|---|---|');
  for (const r of shared) out.push(`| ${esc(r.group)} | ${esc(r.name)} | ${cell(r.results.kvblend)} | ${cell(r.results['llama-server'])} |`);
  out.push('');
  if (own.length) {
    out.push(`#### ${suite}: kvblend-only (the documents field; llama-server has none)`, '');
    out.push('| case | kvblend |', '|---|---|');
    for (const r of own) out.push(`| ${esc(r.name)} | ${cell(r.results.kvblend)} |`);
    out.push('');
  }
}
process.stdout.write(out.join('\n') + '\n');
