// the official openai client against kvblend serve: node openai_client.mjs BASE_URL API_KEY
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const [baseURL, apiKey] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 60000 });

const models = await client.models.list();
assert.ok(models.data.length >= 1, 'a model is listed');
const model = models.data[0].id;

// chat, not streaming
const chat = await client.chat.completions.create({
  model, temperature: 0, max_tokens: 12,
  messages: [{ role: 'user', content: 'Once upon a time' }],
});
assert.equal(chat.object, 'chat.completion');
assert.equal(chat.choices[0].message.role, 'assistant');
assert.ok(chat.choices[0].message.content.length > 0);
assert.equal(chat.usage.completion_tokens, 12);

// chat, streaming: the same text, chunk by chunk
const stream = await client.chat.completions.create({
  model, temperature: 0, max_tokens: 12, stream: true,
  messages: [{ role: 'user', content: 'Once upon a time' }],
});
let text = '';
let chunks = 0;
for await (const c of stream) {
  assert.equal(c.object, 'chat.completion.chunk');
  text += c.choices[0]?.delta?.content ?? '';
  chunks++;
}
assert.ok(chunks >= 3, 'several chunks');
assert.equal(text, chat.choices[0].message.content);

// completions
const comp = await client.completions.create({ model, prompt: 'Once upon a time', max_tokens: 8, temperature: 0 });
assert.equal(comp.object, 'text_completion');
assert.ok(comp.choices[0].text.startsWith(', there was a little girl'), comp.choices[0].text);

// documents: added once, then used by id and by text in another order
const added = await client.post('/documents', { body: { documents: ['Tom had a red ball.', 'Sue found a little cat.'] } });
assert.equal(added.data.length, 2);
const rag = await client.chat.completions.create({
  model, temperature: 0, max_tokens: 8,
  messages: [{ role: 'system', content: 'Stories:' }, { role: 'user', content: 'Once upon a time' }],
  documents: [{ id: added.data[1].id }, { text: 'Tom had a red ball.' }],
});
assert.ok(rag.kvblend.store_hits >= 2, JSON.stringify(rag.kvblend));
assert.ok(rag.kvblend.n_recomputed < rag.kvblend.n_fused);

// errors come back as the client's typed errors
await assert.rejects(
  client.chat.completions.create({ model, messages: [] }),
  (e) => e instanceof OpenAI.BadRequestError && e.status === 400);
const wrong = new OpenAI({ baseURL, apiKey: 'wrong-key', maxRetries: 0 });
await assert.rejects(wrong.models.list(), (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);

console.log('openai client: all checks passed');
