// the Responses API with the official openai client (responses.create, a
// conversation by previous_response_id, responses.stream) and the Messages API
// with Anthropic's official client (messages.create, messages.stream,
// countTokens, document blocks fused), errors as each client's typed errors:
// node responses_and_messages.mjs BASE_URL API_KEY
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import Anthropic from '@anthropic-ai/sdk';

const [baseURL, apiKey] = process.argv.slice(2);
const openai = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 60000 });
const model = (await openai.models.list()).data[0].id;

// --- Responses -------------------------------------------------------------------
const first = await openai.responses.create({
  model, instructions: 'Be brief.', input: 'Where is the tower?', max_output_tokens: 8, temperature: 0,
});
assert.equal(first.object, 'response');
assert.ok(first.id.startsWith('resp_'));
assert.equal(typeof first.output_text, 'string', 'the client joins the output text');
assert.ok(first.output_text.length > 0);
assert.equal(first.usage.output_tokens, 8);
assert.equal(first.status, 'incomplete');
assert.equal(first.incomplete_details.reason, 'max_output_tokens');

// the same conversation through chat completions gives the same words
const chat = await openai.chat.completions.create({
  model, max_tokens: 8, temperature: 0,
  messages: [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: 'Where is the tower?' }],
});
assert.equal(first.output_text, chat.choices[0].message.content);

const second = await openai.responses.create({
  model, input: [{ role: 'user', content: 'And then?' }], previous_response_id: first.id, max_output_tokens: 4,
  temperature: 0,
});
assert.equal(second.previous_response_id, first.id);
assert.ok(second.usage.input_tokens > first.usage.input_tokens, 'the earlier turn is part of the prompt');

// the stream helper rebuilds the response from its events (cut by max_output_tokens,
// it ends with response.incomplete: the helper keeps what the events built)
const stream = openai.responses.stream({
  model, instructions: 'Be brief.', input: 'Where is the tower?', max_output_tokens: 8, temperature: 0,
});
let deltas = '';
let ended = null;
stream.on('response.output_text.delta', (e) => { deltas += e.delta; });
stream.on('response.incomplete', (e) => { ended = e.response; });
const streamed = await stream.finalResponse();
assert.equal(streamed.output[0].content[0].text, first.output_text);
assert.equal(deltas, first.output_text);
assert.equal(ended.usage.output_tokens, 8);

// documents fuse here as in chat
const fused = await openai.responses.create({
  model, input: 'Where is the tower?', max_output_tokens: 4, temperature: 0,
  documents: ['The tower is in Paris.', 'The bridge is in London.'],
});
assert.ok(fused.kvblend.n_fused > 0, JSON.stringify(fused.kvblend));

await assert.rejects(openai.responses.create({ model, input: 'x', previous_response_id: 'resp_nobody' }),
  (e) => e instanceof OpenAI.NotFoundError);
await assert.rejects(openai.responses.create({ model, input: 'x', tools: [{ type: 'web_search' }] }),
  (e) => e instanceof OpenAI.BadRequestError && /function tools/.test(e.message));

// --- Anthropic Messages ------------------------------------------------------------
const anthropic = new Anthropic({ baseURL: baseURL.replace(/\/v1$/, ''), apiKey, maxRetries: 0, timeout: 60000 });
const msg = await anthropic.messages.create({
  model, max_tokens: 8, temperature: 0, system: 'Be brief.',
  messages: [{ role: 'user', content: 'Where is the tower?' }],
});
assert.equal(msg.type, 'message');
assert.equal(msg.role, 'assistant');
assert.equal(msg.stop_reason, 'max_tokens');
assert.equal(msg.content[0].type, 'text');
assert.equal(msg.content[0].text, chat.choices[0].message.content);
assert.equal(msg.usage.output_tokens, 8);

const counted = await anthropic.messages.countTokens({
  model, system: 'Be brief.', messages: [{ role: 'user', content: 'Where is the tower?' }],
});
assert.equal(counted.input_tokens, chat.usage.prompt_tokens);

const mstream = anthropic.messages.stream({
  model, max_tokens: 8, temperature: 0, system: 'Be brief.',
  messages: [{ role: 'user', content: 'Where is the tower?' }],
});
let text = '';
mstream.on('text', (t) => { text += t; });
const final = await mstream.finalMessage();
assert.equal(text, msg.content[0].text);
assert.equal(final.content[0].text, msg.content[0].text);
assert.equal(final.stop_reason, 'max_tokens');

// Anthropic's own document blocks opening the question are fused documents
const withDocs = await anthropic.messages.create({
  model, max_tokens: 4, temperature: 0,
  messages: [{
    role: 'user',
    content: [
      { type: 'document', source: { type: 'text', media_type: 'text/plain', data: 'The tower is in Paris.' } },
      { type: 'text', text: 'Where is the tower?' },
    ],
  }],
});
assert.ok(withDocs.kvblend.n_fused > 0, JSON.stringify(withDocs.kvblend));

await assert.rejects(
  anthropic.messages.create({ model, max_tokens: 4, messages: [{ role: 'user', content: [{ type: 'image', source: { type: 'url', url: 'http://x' } }] }] }),
  (e) => e instanceof Anthropic.BadRequestError && e.error.type === 'error' && /image/.test(e.message));
const wrongKey = new Anthropic({ baseURL: baseURL.replace(/\/v1$/, ''), apiKey: 'wrong', maxRetries: 0 });
await assert.rejects(wrongKey.messages.create({ model, max_tokens: 4, messages: [{ role: 'user', content: 'x' }] }),
  (e) => e instanceof Anthropic.AuthenticationError);
console.log('all checks passed');
