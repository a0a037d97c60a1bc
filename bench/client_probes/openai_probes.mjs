// the official openai client against kvblend serve and llama-server (--jinja), same model:
//   node openai_probes.mjs URL_KVBLEND URL_LLAMA > openai.json
// The model has random weights (tiny-qwen3 with Qwen2.5's chat template): free
// text is gibberish, so the cases check what holds for any weights: shapes,
// counts, finish reasons, greedy answers equal across calls and streams, and
// grammars (JSON, schemas, tool calls) that make the answer parse and validate.
import { API_KEY, assert, assertUsage, http, pkg, runSuite, stopFrom } from './common.mjs';

const { default: OpenAI } = await pkg('openai');
const { zodResponseFormat } = await pkg('openai/helpers/zod');
const { z } = await pkg('zod');

const clients = new Map();
function client(s, opts = {}) {
  const key = s.label + JSON.stringify(opts);
  if (!clients.has(key))
    clients.set(key, new OpenAI({ baseURL: s.root + '/v1', apiKey: API_KEY, maxRetries: 0, timeout: 120000, ...opts }));
  return clients.get(key);
}

// the server that answers embeddings (llama-server: its --embeddings one, PROBE_LLAMA_EMBED_URL)
function embedClient(s) {
  return client({ ...s, label: s.label + ' embeddings', root: s.embedRoot });
}

const hello = [{ role: 'user', content: 'Once upon a time' }];

// greedy chat answer of a prompt (cached per server)
const greedyCache = new Map();
async function greedy(s, maxTokens = 12, messages = hello) {
  const k = s.label + maxTokens + JSON.stringify(messages);
  if (!greedyCache.has(k))
    greedyCache.set(k, await client(s).chat.completions.create({ model: s.model, temperature: 0, max_tokens: maxTokens, messages }));
  return greedyCache.get(k);
}

// tools: every argument bounded (enum, integer range, boolean), so that random
// weights cannot run on inside a string
const Weather = z.object({ city: z.enum(['Paris', 'Oslo', 'Lima']), days: z.number().int().min(1).max(7) }).strict();
const Time = z.object({ zone: z.enum(['UTC', 'CET']) }).strict();
const tools = [
  {
    type: 'function',
    function: {
      name: 'get_weather', description: 'the weather of a city',
      parameters: {
        type: 'object',
        properties: { city: { type: 'string', enum: ['Paris', 'Oslo', 'Lima'] }, days: { type: 'integer', minimum: 1, maximum: 7 } },
        required: ['city', 'days'], additionalProperties: false,
      },
    },
  },
  {
    type: 'function',
    function: {
      name: 'get_time', description: 'the time in a zone',
      parameters: {
        type: 'object', properties: { zone: { type: 'string', enum: ['UTC', 'CET'] } }, required: ['zone'],
        additionalProperties: false,
      },
    },
  },
];
const schemaOf = { get_weather: Weather, get_time: Time };
const weatherQ = [{ role: 'user', content: 'What is the weather in Oslo?' }];

function checkCall(call, names = ['get_weather', 'get_time']) {
  assert.equal(call.type, 'function', 'call.type');
  assert.ok(typeof call.id === 'string' && call.id.length > 0, 'call.id');
  assert.ok(names.includes(call.function.name), `called ${call.function.name}`);
  const args = JSON.parse(call.function.arguments);
  assert.ok(schemaOf[call.function.name].safeParse(args).success, `arguments ${call.function.arguments}`);
}

function toolAsk(s, extra = {}) {
  return { model: s.model, tools, temperature: 1, max_tokens: 200, logit_bias: s.endBias, messages: weatherQ, ...extra };
}

// a request that must be refused with a 400
async function refused(promise, says) {
  try {
    await promise;
  } catch (e) {
    assert.equal(e.status, 400, `status ${e.status}: ${String(e.message).slice(0, 120)}`);
    if (says) assert.match(String(e.message), says);
    return;
  }
  assert.fail('accepted (200)');
}

// the error a call throws (a failed assertion when it succeeds)
async function errorOf(promise) {
  try {
    await promise;
  } catch (e) {
    return e;
  }
  assert.fail('accepted (200)');
}

// a stream's chunks and their text
async function drain(stream) {
  const chunks = [];
  for await (const c of stream) chunks.push(c);
  return chunks;
}

// a sampled answer (temperature 1, a seed): less repetitive than greedy ones,
// so that a stop string can be taken from its middle
const sampledAsk = (s) => ({ model: s.model, temperature: 1, seed: 21, max_tokens: 16, messages: hello });

const Person = z.object({ pet: z.enum(['cat', 'dog']), age: z.number().int().min(1).max(9), happy: z.boolean() });
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

const cases = [
  // ---- basics
  { group: 'embeddings', name: 'embeddings.create: base64 (the default) = floats, order, usage', run: async (s) => {
    const c = embedClient(s);
    const input = ['The quick brown fox.', 'A chunk store keeps KV caches.', 'hi'];
    const b64 = await c.embeddings.create({ model: s.model, input });
    const floats = await c.embeddings.create({ model: s.model, input, encoding_format: 'float' });
    assert.equal(b64.object, 'list');
    assert.equal(b64.data.length, 3);
    for (let i = 0; i < 3; i++) {
      assert.equal(b64.data[i].index, i);
      assert.deepEqual(Array.from(b64.data[i].embedding), floats.data[i].embedding, `row ${i}: base64 = floats`);
    }
    assert.ok(b64.usage.prompt_tokens > 0 && b64.usage.total_tokens === b64.usage.prompt_tokens, JSON.stringify(b64.usage));
  } },
  { group: 'embeddings', name: 'embeddings.create: empty input is a 400 the client throws', run: async (s) => {
    await assert.rejects(embedClient(s).embeddings.create({ model: s.model, input: [] }), (e) => e.status === 400);
  } },
  { group: 'basics', name: 'models.list', run: async (s) => {
    const page = await client(s).models.list();
    assert.ok(page.data.length >= 1, 'a model is listed');
    for (const m of page.data) {
      assert.equal(typeof m.id, 'string');
      assert.equal(m.object, 'model');
    }
  } },
  { group: 'basics', name: 'models.retrieve(id)', run: async (s) => {
    const m = await client(s).models.retrieve(s.model);
    assert.equal(m.id, s.model);
    assert.equal(m.object, 'model');
  } },
  { group: 'basics', name: 'chat: shape, usage, finish_reason length', run: async (s) => {
    const r = await client(s).chat.completions.create({ model: s.model, temperature: 0, max_tokens: 8, messages: hello });
    assert.equal(r.object, 'chat.completion');
    assert.ok(typeof r.id === 'string' && r.id.length > 0, 'id');
    assert.ok(Number.isInteger(r.created), 'created');
    assert.equal(r.choices.length, 1);
    assert.equal(r.choices[0].index, 0);
    assert.equal(r.choices[0].message.role, 'assistant');
    assert.ok(typeof r.choices[0].message.content === 'string' && r.choices[0].message.content.length > 0, 'content');
    assert.equal(r.choices[0].finish_reason, 'length');
    assertUsage(r.usage, 8);
  } },
  { group: 'basics', name: 'chat: temperature 0 twice, same answer', run: async (s) => {
    const a = await client(s).chat.completions.create({ model: s.model, temperature: 0, max_tokens: 12, messages: hello });
    const b = await client(s).chat.completions.create({ model: s.model, temperature: 0, max_tokens: 12, messages: hello });
    assert.equal(b.choices[0].message.content, a.choices[0].message.content);
  } },
  { group: 'basics', name: 'chat stream: chunks, role first, text = non-stream', run: async (s) => {
    const whole = await greedy(s);
    const chunks = await drain(await client(s).chat.completions.create({
      model: s.model, temperature: 0, max_tokens: 12, messages: hello, stream: true }));
    assert.ok(chunks.length >= 3, `${chunks.length} chunks`);
    for (const c of chunks) {
      assert.equal(c.object, 'chat.completion.chunk');
      assert.equal(c.id, chunks[0].id, 'one id for all chunks');
    }
    assert.equal(chunks[0].choices[0].delta.role, 'assistant');
    const text = chunks.map((c) => c.choices[0]?.delta?.content ?? '').join('');
    assert.equal(text, whole.choices[0].message.content);
    assert.equal(chunks.filter((c) => c.choices[0]?.finish_reason).map((c) => c.choices[0].finish_reason).join(), 'length');
  } },
  { group: 'basics', name: 'chat stream: no usage chunk unless asked', run: async (s) => {
    const chunks = await drain(await client(s).chat.completions.create({
      model: s.model, temperature: 0, max_tokens: 4, messages: hello, stream: true }));
    assert.ok(chunks.every((c) => c.choices.length === 1), 'every chunk has its choice (clients read choices[0])');
  } },
  { group: 'basics', name: 'chat stream: stream_options.include_usage', run: async (s) => {
    const chunks = await drain(await client(s).chat.completions.create({
      model: s.model, temperature: 0, max_tokens: 6, messages: hello, stream: true, stream_options: { include_usage: true } }));
    const last = chunks.at(-1);
    assert.deepEqual(last.choices, [], 'the last chunk has no choices');
    assertUsage(last.usage, 6);
    assert.ok(chunks.slice(0, -1).every((c) => c.usage == null), 'only the last chunk carries usage');
  } },
  { group: 'basics', name: 'chat: stream helper finalChatCompletion', run: async (s) => {
    const whole = await greedy(s);
    const stream = client(s).chat.completions.stream({ model: s.model, temperature: 0, max_tokens: 12, messages: hello });
    let deltas = 0;
    stream.on('content.delta', () => deltas++);
    const fin = await stream.finalChatCompletion();
    assert.equal(fin.choices[0].message.content, whole.choices[0].message.content);
    assert.equal(fin.choices[0].finish_reason, 'length');
    assert.ok(deltas >= 3, `${deltas} content deltas`);
  } },
  { group: 'basics', name: 'chat: max_completion_tokens', run: async (s) => {
    const r = await client(s).chat.completions.create({ model: s.model, temperature: 0, max_completion_tokens: 5, messages: hello });
    assert.equal(r.choices[0].finish_reason, 'length');
    assert.equal(r.usage.completion_tokens, 5);
  } },
  { group: 'basics', name: 'chat: max_tokens 1 = first token of the greedy answer', run: async (s) => {
    const r = await client(s).chat.completions.create({ model: s.model, temperature: 0, max_tokens: 1, messages: hello, logprobs: true });
    const whole = await greedy(s);
    assert.equal(r.usage.completion_tokens, 1);
    assert.ok(whole.choices[0].message.content.startsWith(r.choices[0].message.content), 'a prefix of the 12-token answer');
  } },
  { group: 'basics', name: 'chat: stop string cuts the answer, finish stop', run: async (s) => {
    const text = (await client(s).chat.completions.create(sampledAsk(s))).choices[0].message.content;
    const stop = stopFrom(text);
    assert.ok(stop, `no stop string in '${text}'`);
    const r = await client(s).chat.completions.create({ ...sampledAsk(s), stop });
    assert.equal(r.choices[0].message.content, text.slice(0, text.indexOf(stop)));
    assert.equal(r.choices[0].finish_reason, 'stop');
  } },
  { group: 'basics', name: 'chat stream: stop array, text held back', run: async (s) => {
    const text = (await client(s).chat.completions.create(sampledAsk(s))).choices[0].message.content;
    const stop = stopFrom(text);
    assert.ok(stop, `no stop string in '${text}'`);
    const chunks = await drain(await client(s).chat.completions.create({ ...sampledAsk(s), stop: ['\u0001never', stop], stream: true }));
    assert.equal(chunks.map((c) => c.choices[0]?.delta?.content ?? '').join(''), text.slice(0, text.indexOf(stop)));
    assert.equal(chunks.map((c) => c.choices[0]?.finish_reason).filter(Boolean).join(), 'stop');
  } },
  { group: 'basics', name: 'chat: seed repeats a sampled answer', run: async (s) => {
    const ask = (seed) => client(s).chat.completions.create({ model: s.model, temperature: 1, max_tokens: 16, messages: hello, seed });
    const [a, b, c] = [await ask(7), await ask(7), await ask(8)];
    assert.equal(b.choices[0].message.content, a.choices[0].message.content, 'seed 7 twice');
    assert.notEqual(c.choices[0].message.content, a.choices[0].message.content, 'seed 8 differs');
  } },
  { group: 'basics', name: 'chat: top_p tiny at temperature 1 = greedy', run: async (s) => {
    const r = await client(s).chat.completions.create({ model: s.model, temperature: 1, top_p: 1e-9, seed: 3, max_tokens: 12, messages: hello });
    assert.equal(r.choices[0].message.content, (await greedy(s)).choices[0].message.content);
  } },
  { group: 'basics', name: 'chat: n 2 gives two choices', run: async (s) => {
    const r = await client(s).chat.completions.create({ model: s.model, temperature: 1, seed: 5, max_tokens: 6, n: 2, messages: hello });
    assert.equal(r.choices.length, 2, `${r.choices.length} choices`);
    assert.deepEqual(r.choices.map((c) => c.index).sort(), [0, 1]);
    for (const c of r.choices) assert.equal(typeof c.message.content, 'string');
  } },
  { group: 'basics', name: 'chat: logit_bias +100 forces a token', run: async (s) => {
    const r = await client(s).chat.completions.create({
      model: s.model, temperature: 0, max_tokens: 3, messages: hello, logit_bias: { [s.tok.paris]: 100 } });
    assert.equal(r.choices[0].message.content, ' Paris Paris Paris');
  } },
  { group: 'basics', name: 'chat: system + earlier turns, text content parts', run: async (s) => {
    const parts = await client(s).chat.completions.create({
      model: s.model, temperature: 0, max_tokens: 6,
      messages: [{ role: 'system', content: [{ type: 'text', text: 'Be brief.' }] },
                 { role: 'user', content: 'Hi' }, { role: 'assistant', content: 'Hello!' },
                 { role: 'user', content: [{ type: 'text', text: 'Once upon ' }, { type: 'text', text: 'a time' }] }] });
    const plain = await client(s).chat.completions.create({
      model: s.model, temperature: 0, max_tokens: 6,
      messages: [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: 'Hi' },
                 { role: 'assistant', content: 'Hello!' }, { role: 'user', content: 'Once upon a time' }] });
    assert.equal(parts.usage.prompt_tokens, plain.usage.prompt_tokens, 'the same prompt');
    assert.equal(parts.choices[0].message.content, plain.choices[0].message.content);
    assert.ok(plain.usage.prompt_tokens > (await greedy(s)).usage.prompt_tokens, 'the turns are in the prompt');
  } },
  { group: 'basics', name: 'chat: fields clients send by default (user, store, text format, 0 penalties)', run: async (s) => {
    const r = await client(s).chat.completions.create({
      model: s.model, temperature: 0, max_tokens: 12, messages: hello, user: 'u-1', store: false, response_format: { type: 'text' },
      parallel_tool_calls: undefined, frequency_penalty: 0, presence_penalty: 0 });
    assert.equal(r.choices[0].message.content, (await greedy(s)).choices[0].message.content);
  } },
  { group: 'basics', name: 'chat: developer role (newer clients) read as system', run: async (s) => {
    const dev = await client(s).chat.completions.create({ model: s.model, temperature: 0, max_tokens: 6,
      messages: [{ role: 'developer', content: 'Be brief.' }, ...hello] });
    const sys = await client(s).chat.completions.create({ model: s.model, temperature: 0, max_tokens: 6,
      messages: [{ role: 'system', content: 'Be brief.' }, ...hello] });
    assert.equal(dev.usage.prompt_tokens, sys.usage.prompt_tokens, 'the same prompt as a system message');
    assert.equal(dev.choices[0].message.content, sys.choices[0].message.content);
  } },
  { group: 'basics', name: 'chat stream: abort mid-stream, server serves the next', run: async (s) => {
    const stream = await client(s).chat.completions.create({ model: s.model, temperature: 0, max_tokens: 400, messages: hello, stream: true });
    let n = 0;
    for await (const c of stream) if (++n === 3) break;  // the client aborts the request
    await sleep(200);
    const r = await client(s).chat.completions.create({ model: s.model, temperature: 0, max_tokens: 12, messages: hello });
    assert.equal(r.choices[0].message.content, (await greedy(s)).choices[0].message.content);
  } },

  // ---- completions
  { group: 'completions', name: 'completions: shape, usage', run: async (s) => {
    const r = await client(s).completions.create({ model: s.model, prompt: 'Once upon a time', max_tokens: 8, temperature: 0 });
    assert.equal(r.object, 'text_completion');
    assert.equal(r.choices.length, 1);
    assert.ok(typeof r.choices[0].text === 'string' && r.choices[0].text.length > 0);
    assert.equal(r.choices[0].finish_reason, 'length');
    assertUsage(r.usage, 8);
  } },
  { group: 'completions', name: 'completions stream: text = non-stream, include_usage', run: async (s) => {
    const whole = await client(s).completions.create({ model: s.model, prompt: 'Once upon a time', max_tokens: 8, temperature: 0 });
    const chunks = await drain(await client(s).completions.create({
      model: s.model, prompt: 'Once upon a time', max_tokens: 8, temperature: 0, stream: true, stream_options: { include_usage: true } }));
    assert.equal(chunks.map((c) => c.choices[0]?.text ?? '').join(''), whole.choices[0].text);
    assert.equal(chunks.map((c) => c.choices[0]?.finish_reason).filter(Boolean).join(), 'length');
    assertUsage(chunks.at(-1).usage, 8);
  } },
  { group: 'completions', name: 'completions: prompt array of 2 strings, 2 choices', run: async (s) => {
    const one = async (prompt) => (await client(s).completions.create({ model: s.model, prompt, max_tokens: 6, temperature: 0 })).choices[0].text;
    const r = await client(s).completions.create({ model: s.model, prompt: ['Once upon a time', 'The weather'], max_tokens: 6, temperature: 0 });
    assert.equal(r.choices.length, 2, `${r.choices.length} choices`);
    const byIndex = [...r.choices].sort((a, b) => a.index - b.index);
    assert.deepEqual(byIndex.map((c) => c.index), [0, 1]);
    assert.equal(byIndex[0].text, await one('Once upon a time'));
    assert.equal(byIndex[1].text, await one('The weather'));
  } },
  { group: 'completions', name: 'completions: stop', run: async (s) => {
    const ask = { model: s.model, prompt: 'Once upon a time', max_tokens: 16, temperature: 1, seed: 21 };
    const text = (await client(s).completions.create(ask)).choices[0].text;
    const stop = stopFrom(text);
    assert.ok(stop, `no stop string in '${text}'`);
    const r = await client(s).completions.create({ ...ask, stop: [stop] });
    assert.equal(r.choices[0].text, text.slice(0, text.indexOf(stop)));
    assert.equal(r.choices[0].finish_reason, 'stop');
  } },
  { group: 'completions', name: 'completions: logprobs 3 (legacy shape)', run: async (s) => {
    const r = await client(s).completions.create({ model: s.model, prompt: 'Once upon a time', max_tokens: 5, temperature: 0, logprobs: 3 });
    const lp = r.choices[0].logprobs;
    assert.ok(lp, 'logprobs present');
    assert.equal(lp.tokens.length, 5);
    assert.equal(lp.token_logprobs.length, 5);
    assert.equal(lp.tokens.join(''), r.choices[0].text);
    assert.equal(lp.top_logprobs.length, 5);
    lp.top_logprobs.forEach((top, i) => {
      const entries = Object.entries(top);
      assert.equal(entries.length, 3, `${entries.length} alternatives`);
      const best = Math.max(...entries.map(([, v]) => v));
      assert.ok(Math.abs(best - lp.token_logprobs[i]) < 1e-4, 'greedy: the chosen token is the best');
    });
    assert.equal(lp.text_offset.length, 5);
    for (let i = 1; i < 5; i++) assert.ok(lp.text_offset[i] >= lp.text_offset[i - 1], 'text_offset grows');
  } },
  { group: 'completions', name: 'completions: seed repeats a sampled answer', run: async (s) => {
    const ask = () => client(s).completions.create({ model: s.model, prompt: 'Once upon a time', max_tokens: 10, temperature: 1, seed: 11 });
    const [a, b] = [await ask(), await ask()];
    assert.equal(b.choices[0].text, a.choices[0].text);
  } },

  // ---- logprobs (chat)
  { group: 'logprobs', name: 'chat: logprobs + top_logprobs 3', run: async (s) => {
    const r = await client(s).chat.completions.create({ model: s.model, temperature: 0, max_tokens: 6, messages: hello, logprobs: true, top_logprobs: 3 });
    const content = r.choices[0].logprobs.content;
    assert.equal(content.length, r.usage.completion_tokens);
    for (const t of content) {
      assert.equal(t.top_logprobs.length, 3);
      assert.equal(t.top_logprobs[0].token, t.token, 'greedy: the chosen token first');
      assert.ok(t.logprob <= 0);
      for (let i = 1; i < 3; i++) assert.ok(t.top_logprobs[i].logprob <= t.top_logprobs[i - 1].logprob, 'best first');
      assert.ok(Array.isArray(t.bytes), 'bytes');
    }
    assert.equal(content.map((t) => t.token).join(''), r.choices[0].message.content);
  } },
  { group: 'logprobs', name: 'chat stream: logprobs in the chunks', run: async (s) => {
    const whole = await client(s).chat.completions.create({ model: s.model, temperature: 0, max_tokens: 6, messages: hello, logprobs: true, top_logprobs: 2 });
    const chunks = await drain(await client(s).chat.completions.create({
      model: s.model, temperature: 0, max_tokens: 6, messages: hello, logprobs: true, top_logprobs: 2, stream: true }));
    const got = chunks.flatMap((c) => c.choices[0]?.logprobs?.content ?? []);
    assert.deepEqual(got.map((t) => t.token), whole.choices[0].logprobs.content.map((t) => t.token));
  } },
  { group: 'logprobs', name: 'chat: logprobs true, top_logprobs absent', run: async (s) => {
    const r = await client(s).chat.completions.create({ model: s.model, temperature: 0, max_tokens: 4, messages: hello, logprobs: true });
    const content = r.choices[0].logprobs.content;
    assert.equal(content.length, 4);
    for (const t of content) {
      assert.equal(typeof t.logprob, 'number');
      assert.ok(Array.isArray(t.top_logprobs) && t.top_logprobs.length === 0, `top_logprobs ${JSON.stringify(t.top_logprobs)}`);
    }
  } },

  // ---- structured output
  { group: 'structured', name: 'json_object: a JSON object', run: async (s) => {
    const r = await client(s).chat.completions.create({
      model: s.model, temperature: 1, seed: 1, max_tokens: 100, messages: [{ role: 'user', content: 'Reply in JSON.' }],
      response_format: { type: 'json_object' }, logit_bias: { ...s.endBias, [s.tok.brace]: 8, [s.tok.quote]: 8 } });
    assert.equal(r.choices[0].finish_reason, 'stop', `finish ${r.choices[0].finish_reason}: ${r.choices[0].message.content}`);
    let v;
    assert.doesNotThrow(() => { v = JSON.parse(r.choices[0].message.content); }, `not JSON: ${JSON.stringify(r.choices[0].message.content).slice(0, 60)}`);
    assert.ok(v && typeof v === 'object' && !Array.isArray(v), 'an object');
  } },
  { group: 'structured', name: 'json_schema: chat.completions.parse + zodResponseFormat', run: async (s) => {
    for (const seed of [1, 2, 3]) {
      const r = await client(s).chat.completions.parse({
        model: s.model, seed, temperature: 1, max_tokens: 80, messages: [{ role: 'user', content: 'Who lives in the story?' }],
        response_format: zodResponseFormat(Person, 'person') });
      assert.equal(r.choices[0].finish_reason, 'stop');
      assert.ok(Person.safeParse(r.choices[0].message.parsed).success, JSON.stringify(r.choices[0].message.parsed));
    }
  } },
  { group: 'structured', name: 'json_schema streamed: the chunks parse', run: async (s) => {
    const stream = client(s).chat.completions.stream({
      model: s.model, seed: 4, temperature: 1, max_tokens: 80, messages: [{ role: 'user', content: 'Who?' }],
      response_format: zodResponseFormat(Person, 'person') });
    const fin = await stream.finalChatCompletion();
    assert.ok(Person.safeParse(fin.choices[0].message.parsed).success, fin.choices[0].message.content);
  } },
  { group: 'structured', name: 'json_schema: nested array of objects', run: async (s) => {
    const Team = z.object({ members: z.array(z.object({ role: z.enum(['lead', 'dev']), level: z.number().int().min(1).max(3) })).min(1).max(3) });
    const r = await client(s).chat.completions.parse({
      model: s.model, seed: 9, temperature: 1, max_tokens: 150, messages: [{ role: 'user', content: 'The team?' }],
      response_format: zodResponseFormat(Team, 'team') });
    assert.equal(r.choices[0].finish_reason, 'stop');
    assert.ok(Team.safeParse(r.choices[0].message.parsed).success, r.choices[0].message.content);
  } },
  { group: 'structured', name: 'completions: json_schema (llama-server field)', run: async (s) => {
    const schema = { type: 'object', properties: { n: { type: 'integer', minimum: 0, maximum: 99 } }, required: ['n'], additionalProperties: false };
    const r = await client(s).completions.create({ model: s.model, prompt: 'A number:', max_tokens: 40, temperature: 1, seed: 2, json_schema: schema });
    const v = JSON.parse(r.choices[0].text);
    assert.ok(Number.isInteger(v.n) && v.n >= 0 && v.n <= 99 && Object.keys(v).length === 1, r.choices[0].text);
  } },

  // ---- tools
  { group: 'tools', name: 'tools required: valid calls, finish tool_calls', run: async (s) => {
    const r = await client(s).chat.completions.create(toolAsk(s, { tool_choice: 'required', seed: 1, max_tokens: 400 }));
    const m = r.choices[0].message;
    assert.equal(r.choices[0].finish_reason, 'tool_calls');
    assert.equal(m.content, null, 'content null');
    assert.ok(m.tool_calls?.length >= 1, `no tool_calls; finish ${r.choices[0].finish_reason}, content ${JSON.stringify(m.content)?.slice(0, 60)}`);
    m.tool_calls.forEach((c) => checkCall(c));
  } },
  { group: 'tools', name: 'tools named function', run: async (s) => {
    const r = await client(s).chat.completions.create(toolAsk(s, { tool_choice: { type: 'function', function: { name: 'get_time' } }, parallel_tool_calls: false, seed: 2 }));
    const calls = r.choices[0].message.tool_calls;
    assert.ok(calls?.length >= 1, `no tool_calls; content ${JSON.stringify(r.choices[0].message.content)?.slice(0, 60)}`);
    calls.forEach((c) => checkCall(c, ['get_time']));
    assert.equal(r.choices[0].finish_reason, 'tool_calls');
  } },
  { group: 'tools', name: 'tools auto: text or valid calls, finish_reason to match', run: async (s) => {
    const plain = await client(s).chat.completions.create({ model: s.model, temperature: 0, max_tokens: 1, messages: weatherQ });
    for (const seed of [3, 4, 5]) {
      const r = await client(s).chat.completions.create(toolAsk(s, { tool_choice: 'auto', seed, max_tokens: 60 }));
      const m = r.choices[0].message;
      assert.ok(r.usage.prompt_tokens > plain.usage.prompt_tokens + 50, 'the tools are rendered into the prompt');
      if (m.tool_calls?.length) {
        m.tool_calls.forEach((c) => checkCall(c));
        assert.equal(r.choices[0].finish_reason, 'tool_calls');
      } else {
        assert.equal(typeof m.content, 'string', 'text content');
        assert.ok(!m.content.includes('<tool_call>'), 'no raw call markup in the text');
        assert.ok(['stop', 'length'].includes(r.choices[0].finish_reason), r.choices[0].finish_reason);
      }
    }
  } },
  { group: 'tools', name: 'tools none: text, no calls', run: async (s) => {
    const r = await client(s).chat.completions.create(toolAsk(s, { tool_choice: 'none', seed: 5, max_tokens: 8, logit_bias: undefined }));
    const m = r.choices[0].message;
    assert.ok(!m.tool_calls || m.tool_calls.length === 0, `tool_calls ${JSON.stringify(m.tool_calls)}`);
    assert.ok(typeof m.content === 'string' && m.content.length > 0, 'text content');
    assert.equal(r.choices[0].finish_reason, 'length');
  } },
  { group: 'tools', name: 'tools parallel_tool_calls false: one call', run: async (s) => {
    // no end bias: left alone, random weights call again and again
    for (const seed of [6, 7]) {
      const r = await client(s).chat.completions.create(toolAsk(s, { tool_choice: 'required', parallel_tool_calls: false, seed, logit_bias: undefined, max_tokens: 300 }));
      const calls = r.choices[0].message.tool_calls;
      assert.equal(calls?.length, 1, `${calls?.length} calls`);
      checkCall(calls[0]);
    }
  } },
  { group: 'tools', name: 'tools streamed: deltas accumulate to the same calls', run: async (s) => {
    const ask = toolAsk(s, { tool_choice: 'required', parallel_tool_calls: false, seed: 8 });
    const whole = await client(s).chat.completions.create(ask);
    const raw = await drain(await client(s).chat.completions.create({ ...ask, stream: true }));
    const first = raw.flatMap((c) => c.choices[0]?.delta?.tool_calls ?? [])[0];
    assert.ok(first?.id && first?.function?.name, `the first tool-call delta names the call (${raw.length} chunks, ${JSON.stringify(first)})`);
    const stream = client(s).chat.completions.stream(ask);
    let deltas = 0;
    stream.on('tool_calls.function.arguments.delta', () => deltas++);
    const fin = await stream.finalChatCompletion();
    assert.equal(fin.choices[0].finish_reason, 'tool_calls');
    const got = fin.choices[0].message.tool_calls;
    const want = whole.choices[0].message.tool_calls;
    assert.equal(got.length, want.length);
    got.forEach((c, i) => {
      checkCall(c);
      assert.deepEqual(c.function, want[i].function);
    });
    assert.ok(deltas > 1, `arguments in ${deltas} deltas`);
  } },
  { group: 'tools', name: 'tools round trip: tool_calls + tool message -> answer', run: async (s) => {
    const messages = [...weatherQ];
    const first = await client(s).chat.completions.create(toolAsk(s, { tool_choice: 'required', parallel_tool_calls: false, seed: 1, messages }));
    const called = first.choices[0].message;
    assert.ok(called.tool_calls?.length >= 1, `no tool_calls; content ${JSON.stringify(called.content)?.slice(0, 60)}`);
    messages.push(called);
    for (const call of called.tool_calls)
      messages.push({ role: 'tool', tool_call_id: call.id, content: JSON.stringify({ temperature: 21, sky: 'clear' }) });
    const answer = await client(s).chat.completions.create({ model: s.model, tools, messages, tool_choice: 'none', seed: 2, max_tokens: 8 });
    assert.equal(typeof answer.choices[0].message.content, 'string');
    assert.ok(!answer.choices[0].message.tool_calls?.length, 'no calls');
    assert.ok(answer.usage.prompt_tokens > first.usage.prompt_tokens + 10, 'the call and its result are in the prompt');
  } },
  { group: 'tools', name: 'tools: assistant tool_calls with content null replayed', run: async (s) => {
    const messages = [...weatherQ,
      { role: 'assistant', content: null, tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '{"city":"Oslo","days":2}' } }] },
      { role: 'tool', tool_call_id: 'call_1', content: 'rain' }];
    const r = await client(s).chat.completions.create({ model: s.model, tools, messages, temperature: 0, max_tokens: 4 });
    assert.equal(r.choices[0].message.role, 'assistant');
    assert.equal(r.usage.completion_tokens + r.usage.prompt_tokens, r.usage.total_tokens);
    const without = await client(s).chat.completions.create({ model: s.model, tools, messages: weatherQ, temperature: 0, max_tokens: 4 });
    assert.ok(r.usage.prompt_tokens > without.usage.prompt_tokens + 10, 'the call and its result are rendered');
  } },

  // ---- errors and access
  { group: 'errors', name: '400: top_logprobs 21', run: async (s) => {
    await refused(client(s).chat.completions.create({ model: s.model, max_tokens: 4, messages: hello, logprobs: true, top_logprobs: 21 }));
  } },
  { group: 'errors', name: '400: tool_choice naming no tool', run: async (s) => {
    await refused(client(s).chat.completions.create(toolAsk(s, { tool_choice: { type: 'function', function: { name: 'get_stock' } } })));
  } },
  { group: 'errors', name: '400: a schema no grammar can express', run: async (s) => {
    await refused(client(s).chat.completions.create({ model: s.model, max_tokens: 4, messages: hello,
      response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'string', pattern: '^(?=a)$' } } } }));
  } },
  { group: 'errors', name: '400: empty messages (BadRequestError)', run: async (s) => {
    const e = await errorOf(client(s).chat.completions.create({ model: s.model, max_tokens: 4, messages: [] }));
    assert.ok(e instanceof OpenAI.BadRequestError, `${e.constructor.name} ${e.status}: ${String(e.message).slice(0, 80)}`);
  } },
  { group: 'errors', name: '400 context_length_exceeded: a prompt over the context', run: async (s) => {
    const long = Array.from({ length: 2600 }, (_, i) => `w${i % 97}`).join(' ');
    const e = await errorOf(client(s).chat.completions.create({ model: s.model, max_tokens: 4, messages: [{ role: 'user', content: long }] }));
    assert.equal(e.status, 400, `status ${e.status}`);
    assert.equal(e.code, 'context_length_exceeded', `code ${e.code}: ${String(e.message).slice(0, 100)}`);
  } },
  { group: 'errors', name: '401: wrong key (AuthenticationError)', run: async (s) => {
    const wrong = new OpenAI({ baseURL: s.root + '/v1', apiKey: 'wrong-key', maxRetries: 0 });
    const e = await errorOf(wrong.chat.completions.create({ model: s.model, max_tokens: 2, messages: hello }));
    assert.ok(e instanceof OpenAI.AuthenticationError, `${e.constructor.name} ${e.status}`);
  } },
  { group: 'errors', name: 'X-Api-Key header instead of Bearer', run: async (s) => {
    const c = new OpenAI({ baseURL: s.root + '/v1', apiKey: 'unused', maxRetries: 0,
                           defaultHeaders: { Authorization: null, 'X-Api-Key': API_KEY } });
    const r = await c.chat.completions.create({ model: s.model, max_tokens: 2, temperature: 0, messages: hello });
    assert.equal(r.usage.completion_tokens, 2);
    const bad = await http(s, 'POST', '/v1/chat/completions', { messages: hello, max_tokens: 2 }, { Authorization: '', 'X-Api-Key': 'wrong' });
    assert.equal(bad.status, 401, 'a wrong X-Api-Key');
  } },
  { group: 'errors', name: 'routes without /v1 (chat, models)', run: async (s) => {
    const c = new OpenAI({ baseURL: s.root, apiKey: API_KEY, maxRetries: 0 });
    const models = await c.models.list();
    assert.equal(models.data[0].id, s.model);
    const r = await c.chat.completions.create({ model: s.model, temperature: 0, max_tokens: 12, messages: hello });
    assert.equal(r.choices[0].message.content, (await greedy(s)).choices[0].message.content);
  } },
  { group: 'errors', name: 'errors have the OpenAI error body', run: async (s) => {
    for (const body of [{ messages: 'x' }, { messages: hello, temperature: 'hot' }]) {
      const r = await http(s, 'POST', '/v1/chat/completions', { max_tokens: 4, ...body });
      assert.equal(r.status, 400, r.text.slice(0, 120));
      assert.equal(typeof r.json?.error?.message, 'string', r.text.slice(0, 120));
      assert.equal(typeof r.json?.error?.type, 'string');
    }
  } },
  { group: 'errors', name: '400 (not 500): a malformed JSON body', run: async (s) => {
    const r = await fetch(s.root + '/v1/chat/completions', { method: 'POST', body: '{"messages": [',
      headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${API_KEY}` } });
    const text = await r.text();
    assert.equal(r.status, 400, text.slice(0, 120));
    assert.equal(typeof JSON.parse(text).error?.message, 'string');
  } },

  // ---- kvblend's own fields (llama-server has no documents field)
  { group: 'kvblend documents', kvblendOnly: true, name: 'documents by text: fused, shape kept', run: async (s) => {
    const r = await client(s).chat.completions.create({
      model: s.model, temperature: 0, max_tokens: 6, messages: [{ role: 'system', content: 'Stories:' }, ...hello],
      documents: [{ text: 'Tom had a red ball.' }, { text: 'Sue found a little cat.' }] });
    assert.equal(r.object, 'chat.completion');
    assert.ok(r.kvblend.n_fused > 0, JSON.stringify(r.kvblend));
    assertUsage(r.usage, 6);
  } },
  { group: 'kvblend documents', kvblendOnly: true, name: 'POST /v1/documents then by id: store hits', run: async (s) => {
    const added = await client(s).post('/documents', { body: { documents: ['Lily drew a blue house.', 'Ben ran to the park.'] } });
    assert.equal(added.data.length, 2);
    const r = await client(s).chat.completions.create({
      model: s.model, temperature: 0, max_tokens: 4, messages: [{ role: 'system', content: 'Stories:' }, ...hello],
      documents: [{ id: added.data[1].id }, { id: added.data[0].id }] });
    assert.ok(r.kvblend.store_hits >= 2, JSON.stringify(r.kvblend));
  } },
  { group: 'kvblend documents', kvblendOnly: true, name: 'documents + parse(zod)', run: async (s) => {
    const r = await client(s).chat.completions.parse({
      model: s.model, seed: 4, temperature: 1, max_tokens: 80, messages: [{ role: 'user', content: 'Who?' }],
      documents: ['Lily had a little cat named Tom.', 'Ben had a big dog.'], response_format: zodResponseFormat(Person, 'person') });
    assert.ok(r.kvblend.n_fused > 0);
    assert.ok(Person.safeParse(r.choices[0].message.parsed).success, r.choices[0].message.content);
  } },
  { group: 'kvblend documents', kvblendOnly: true, name: 'documents + tools required', run: async (s) => {
    const r = await client(s).chat.completions.create(toolAsk(s, { tool_choice: 'required', parallel_tool_calls: false, seed: 3, documents: ['It rains in Oslo.', 'Lima is dry.'] }));
    assert.ok(r.kvblend.n_fused > 0);
    r.choices[0].message.tool_calls.forEach((c) => checkCall(c));
    assert.equal(r.choices[0].finish_reason, 'tool_calls');
  } },
];

await runSuite('openai', cases);
