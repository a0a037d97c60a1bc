// the APIs around chat, with their official clients, against kvblend serve and
// llama-server (--jinja), same model: OpenAI's Responses (openai npm),
// Anthropic's Messages (@anthropic-ai/sdk) and llama.cpp's native /completion.
//   node api_probes.mjs URL_KVBLEND URL_LLAMA > apis.json
// As in openai_probes.mjs, random weights: the cases check shapes, counts,
// stop reasons, greedy answers equal across routes and streams, and calls
// that the tool grammar makes valid.
import { API_KEY, assert, http, pkg, runSuite, stopFrom } from './common.mjs';

const { default: OpenAI } = await pkg('openai');
const { default: Anthropic } = await pkg('@anthropic-ai/sdk');

const openai = (s) => new OpenAI({ baseURL: s.root + '/v1', apiKey: API_KEY, maxRetries: 0, timeout: 120000 });
const anthropic = (s) => new Anthropic({ baseURL: s.root, apiKey: API_KEY, maxRetries: 0, timeout: 120000 });

const question = 'Once upon a time';
const weatherSchema = {
  type: 'object',
  properties: { city: { type: 'string', enum: ['Paris', 'Oslo', 'Lima'] }, days: { type: 'integer', minimum: 1, maximum: 7 } },
  required: ['city', 'days'], additionalProperties: false,
};
function checkArgs(args) {
  assert.ok(['Paris', 'Oslo', 'Lima'].includes(args.city), `city ${JSON.stringify(args)}`);
  assert.ok(Number.isInteger(args.days) && args.days >= 1 && args.days <= 7, `days ${JSON.stringify(args)}`);
}

// the greedy chat answer the other routes are compared with
async function chatGreedy(s, maxTokens, messages) {
  const r = await openai(s).chat.completions.create({ model: s.model, temperature: 0, max_tokens: maxTokens, messages });
  return r;
}

const cases = [
  // --- Responses ---
  { group: 'responses', name: 'responses.create: output_text = chat greedy answer, usage', run: async (s) => {
    const r = await openai(s).responses.create({ model: s.model, input: question, max_output_tokens: 8, temperature: 0 });
    const chat = await chatGreedy(s, 8, [{ role: 'user', content: question }]);
    assert.equal(r.object, 'response');
    assert.equal(r.output_text, chat.choices[0].message.content);
    assert.equal(r.usage.output_tokens, 8);
    assert.equal(r.usage.input_tokens, chat.usage.prompt_tokens);
  } },
  { group: 'responses', name: 'responses.create: instructions + input items', run: async (s) => {
    const r = await openai(s).responses.create({
      model: s.model, instructions: 'Tell a story.', max_output_tokens: 6, temperature: 0,
      input: [{ role: 'user', content: [{ type: 'input_text', text: question }] }] });
    const chat = await chatGreedy(s, 6, [{ role: 'system', content: 'Tell a story.' }, { role: 'user', content: question }]);
    assert.equal(r.output_text, chat.choices[0].message.content);
  } },
  { group: 'responses', name: 'responses: previous_response_id continues', run: async (s) => {
    const first = await openai(s).responses.create({ model: s.model, input: question, max_output_tokens: 4, temperature: 0 });
    const next = await openai(s).responses.create({
      model: s.model, input: 'and then?', previous_response_id: first.id, max_output_tokens: 4, temperature: 0 });
    const chat = await chatGreedy(s, 4, [
      { role: 'user', content: question }, { role: 'assistant', content: first.output_text }, { role: 'user', content: 'and then?' }]);
    assert.equal(next.output_text, chat.choices[0].message.content);
  } },
  { group: 'responses', name: 'responses.stream: deltas = whole text', run: async (s) => {
    const whole = await openai(s).responses.create({ model: s.model, input: question, max_output_tokens: 8, temperature: 0 });
    const stream = openai(s).responses.stream({ model: s.model, input: question, max_output_tokens: 8, temperature: 0 });
    let text = '';
    stream.on('response.output_text.delta', (e) => { text += e.delta; });
    const final = await stream.finalResponse();
    assert.equal(text, whole.output_text);
    assert.equal(final.output.find((o) => o.type === 'message').content[0].text, whole.output_text);
  } },
  { group: 'responses', name: 'responses: text.format json_schema parses', run: async (s) => {
    const r = await openai(s).responses.create({
      model: s.model, input: 'weather?', max_output_tokens: 60, temperature: 1, seed: 2,
      text: { format: { type: 'json_schema', name: 'weather', schema: weatherSchema, strict: true } } });
    checkArgs(JSON.parse(r.output_text));
  } },
  { group: 'responses', name: 'responses: function tool, tool_choice required', run: async (s) => {
    const r = await openai(s).responses.create({
      model: s.model, input: 'What is the weather in Oslo?', max_output_tokens: 200, temperature: 1, seed: 3,
      tools: [{ type: 'function', name: 'get_weather', description: 'the weather of a city', parameters: weatherSchema, strict: true }],
      tool_choice: 'required', logit_bias: s.endBias });
    const call = r.output.find((o) => o.type === 'function_call');
    assert.ok(call, JSON.stringify(r.output).slice(0, 200));
    assert.equal(call.name, 'get_weather');
    checkArgs(JSON.parse(call.arguments));
  } },
  { group: 'responses', name: 'responses: unknown previous_response_id is an error', run: async (s) => {
    await assert.rejects(openai(s).responses.create({ model: s.model, input: 'x', previous_response_id: 'resp_nobody' }),
      (e) => e.status >= 400 && e.status < 500);
  } },
  // --- Anthropic Messages ---
  { group: 'messages', name: 'messages.create: text = chat greedy answer, stop_reason, usage', run: async (s) => {
    const m = await anthropic(s).messages.create({
      model: s.model, max_tokens: 8, temperature: 0, system: 'Tell a story.', messages: [{ role: 'user', content: question }] });
    const chat = await chatGreedy(s, 8, [{ role: 'system', content: 'Tell a story.' }, { role: 'user', content: question }]);
    assert.equal(m.type, 'message');
    assert.equal(m.content[0].text, chat.choices[0].message.content);
    assert.equal(m.stop_reason, 'max_tokens');
    assert.equal(m.usage.output_tokens, 8);
  } },
  { group: 'messages', name: 'messages: stop_sequences, stop_reason stop_sequence', run: async (s) => {
    // sampled with a seed (greedy answers of these weights repeat one piece from the
    // start), the prompt computed afresh each time (a cached prefix moves the last bits)
    const ask = {
      model: s.model, max_tokens: 12, temperature: 1, seed: 5, cache_prompt: false,
      messages: [{ role: 'user', content: question }] };
    const whole = await anthropic(s).messages.create(ask);
    const stop = stopFrom(whole.content[0].text);
    assert.ok(stop, `a stop string in the answer ${JSON.stringify(whole.content[0].text)}`);
    const m = await anthropic(s).messages.create({ ...ask, stop_sequences: [stop] });
    assert.equal(m.stop_reason, 'stop_sequence');
    assert.equal(m.stop_sequence, stop);
    assert.equal(m.content[0].text, whole.content[0].text.slice(0, whole.content[0].text.indexOf(stop)));
  } },
  { group: 'messages', name: 'messages.stream: text events = whole, finalMessage', run: async (s) => {
    const whole = await anthropic(s).messages.create({
      model: s.model, max_tokens: 8, temperature: 0, messages: [{ role: 'user', content: question }] });
    const stream = anthropic(s).messages.stream({
      model: s.model, max_tokens: 8, temperature: 0, messages: [{ role: 'user', content: question }] });
    let text = '';
    stream.on('text', (t) => { text += t; });
    const final = await stream.finalMessage();
    assert.equal(text, whole.content[0].text);
    assert.equal(final.stop_reason, 'max_tokens');
  } },
  { group: 'messages', name: 'messages.countTokens = chat prompt tokens', run: async (s) => {
    const counted = await anthropic(s).messages.countTokens({ model: s.model, messages: [{ role: 'user', content: question }] });
    const chat = await chatGreedy(s, 1, [{ role: 'user', content: question }]);
    assert.equal(counted.input_tokens, chat.usage.prompt_tokens);
  } },
  { group: 'messages', name: 'messages: tool_choice tool, tool_use block valid', run: async (s) => {
    const m = await anthropic(s).messages.create({
      model: s.model, max_tokens: 200, temperature: 1, messages: [{ role: 'user', content: 'What is the weather in Oslo?' }],
      tools: [{ name: 'get_weather', description: 'the weather of a city', input_schema: weatherSchema }],
      tool_choice: { type: 'tool', name: 'get_weather', disable_parallel_tool_use: true }, logit_bias: s.endBias });
    const use = m.content.find((b) => b.type === 'tool_use');
    assert.ok(use, JSON.stringify(m.content).slice(0, 200));
    assert.equal(use.name, 'get_weather');
    checkArgs(use.input);
    assert.equal(m.stop_reason, 'tool_use');
  } },
  { group: 'messages', name: 'messages: missing max_tokens is a 400 in Anthropic\'s shape', run: async (s) => {
    await assert.rejects(anthropic(s).messages.create({ model: s.model, messages: [{ role: 'user', content: 'x' }] }),
      (e) => e.status === 400 && e.error?.type === 'error');
  } },
  // --- llama.cpp's /completion ---
  { group: 'completion', name: '/completion: content = /v1/completions greedy, stop_type limit', run: async (s) => {
    const r = await http(s, 'POST', '/completion', { prompt: question, n_predict: 8, temperature: 0 });
    assert.equal(r.status, 200, r.text.slice(0, 200));
    const ref = await openai(s).completions.create({ model: s.model, prompt: question, max_tokens: 8, temperature: 0 });
    assert.equal(r.json.content, ref.choices[0].text);
    assert.equal(r.json.stop_type, 'limit');
    assert.equal(r.json.tokens_predicted, 8);
  } },
  { group: 'completion', name: '/completion: token ids prompt = text prompt', run: async (s) => {
    const ids = (await http(s, 'POST', '/tokenize', { content: question, add_special: true })).json.tokens;
    const a = await http(s, 'POST', '/completion', { prompt: ids, n_predict: 6, temperature: 0 });
    const b = await http(s, 'POST', '/completion', { prompt: question, n_predict: 6, temperature: 0 });
    assert.equal(a.json.content, b.json.content);
  } },
  { group: 'completion', name: '/completion: n_probs 3, completion_probabilities', run: async (s) => {
    const r = await http(s, 'POST', '/completion', { prompt: question, n_predict: 4, temperature: 0, n_probs: 3 });
    assert.equal(r.json.completion_probabilities.length, 4);
    for (const p of r.json.completion_probabilities) {
      assert.equal(p.top_logprobs.length, 3);
      assert.equal(p.top_logprobs[0].id, p.id, 'greedy: the most likely token was taken');
      assert.ok(p.logprob <= 0);
    }
  } },
  { group: 'completion', name: '/completion: stop word, stop_type word', run: async (s) => {
    const whole = await http(s, 'POST', '/completion', { prompt: question, n_predict: 12, temperature: 0 });
    const stop = stopFrom(whole.json.content);
    const r = await http(s, 'POST', '/completion', { prompt: question, n_predict: 12, temperature: 0, stop: [stop] });
    assert.equal(r.json.stop_type, 'word');
    assert.equal(r.json.stopping_word, stop);
    assert.equal(r.json.content, whole.json.content.slice(0, whole.json.content.indexOf(stop)));
  } },
  { group: 'completion', name: '/completion stream: pieces = whole, last stop true', run: async (s) => {
    const whole = await http(s, 'POST', '/completion', { prompt: question, n_predict: 8, temperature: 0 });
    const r = await fetch(s.root + '/completion', {
      method: 'POST', headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${API_KEY}` },
      body: JSON.stringify({ prompt: question, n_predict: 8, temperature: 0, stream: true }) });
    const events = (await r.text()).split('\n\n').filter((b) => b.startsWith('data: ')).map((b) => b.slice(6));
    assert.ok(!events.includes('[DONE]'), 'no [DONE] on the native route');
    const objs = events.map((e) => JSON.parse(e));
    assert.equal(objs.map((o) => o.content).join(''), whole.json.content);
    assert.equal(objs.at(-1).stop, true);
  } },
  // --- kvblend's documents on these routes ---
  { group: 'kvblend documents', kvblendOnly: true, name: 'responses: documents fused', run: async (s) => {
    const r = await openai(s).responses.create({
      model: s.model, input: question, max_output_tokens: 4, temperature: 0, documents: ['Tom had a red ball.', 'Sue found a cat.'] });
    assert.ok(r.kvblend.n_fused > 0, JSON.stringify(r.kvblend));
  } },
  { group: 'kvblend documents', kvblendOnly: true, name: 'messages: document blocks fused', run: async (s) => {
    const m = await anthropic(s).messages.create({
      model: s.model, max_tokens: 4, temperature: 0, messages: [{ role: 'user', content: [
        { type: 'document', source: { type: 'text', media_type: 'text/plain', data: 'Tom had a red ball.' } },
        { type: 'text', text: question }] }] });
    assert.ok(m.kvblend.n_fused > 0, JSON.stringify(m.kvblend));
  } },
];

await runSuite('apis', cases);
