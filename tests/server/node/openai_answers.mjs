// answers a program reads, with the official openai client: node openai_answers.mjs BASE_URL API_KEY
// chat.completions.parse with a zod schema (with and without documents), logprobs
// (streamed too), and the 400s of bad requests. The model has random or story
// weights: the grammar alone makes its answers parse and validate.
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { zodResponseFormat } from 'openai/helpers/zod';
import { z } from 'zod';

const [baseURL, apiKey] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 60000 });
const model = (await client.models.list()).data[0].id;

const Person = z.object({
  pet: z.enum(['cat', 'dog']),
  age: z.number().int().min(1).max(9),
  happy: z.boolean(),
});
const messages = [{ role: 'user', content: 'Who lives in the story?' }];

// parse: the client sends a strict json_schema and reads message.parsed
for (const seed of [1, 2, 3]) {
  const r = await client.chat.completions.parse({
    model, seed, temperature: 1, max_tokens: 80, messages,
    response_format: zodResponseFormat(Person, 'person'),
  });
  assert.equal(r.choices[0].finish_reason, 'stop');
  const parsed = r.choices[0].message.parsed;
  assert.ok(Person.safeParse(parsed).success, JSON.stringify(parsed));
}

// the same over fused documents
const fused = await client.chat.completions.parse({
  model, seed: 4, temperature: 1, max_tokens: 80, messages,
  documents: ['Lily had a little cat named Tom.', 'Ben had a big dog that ran in the park.'],
  response_format: zodResponseFormat(Person, 'person'),
});
assert.ok(fused.kvblend.n_fused > 0, JSON.stringify(fused.kvblend));
assert.ok(Person.safeParse(fused.choices[0].message.parsed).success);

// logprobs: one entry per token, five candidates each, best first
const lp = await client.chat.completions.create({
  model, temperature: 0, max_tokens: 6, logprobs: true, top_logprobs: 5,
  messages: [{ role: 'user', content: 'Once upon a time' }],
});
const content = lp.choices[0].logprobs.content;
assert.equal(content.length, lp.usage.completion_tokens);
for (const t of content) {
  assert.equal(t.top_logprobs.length, 5);
  assert.equal(t.top_logprobs[0].token, t.token);
  assert.ok(t.logprob <= 0);
  assert.ok(Array.isArray(t.bytes));
}
assert.equal(content.map((t) => t.token).join(''), lp.choices[0].message.content);

// streamed: the chunks carry the same tokens
const stream = await client.chat.completions.create({
  model, temperature: 0, max_tokens: 6, logprobs: true, top_logprobs: 5, stream: true,
  messages: [{ role: 'user', content: 'Once upon a time' }],
});
const streamed = [];
for await (const c of stream) streamed.push(...(c.choices[0]?.logprobs?.content ?? []));
assert.deepEqual(streamed.map((t) => t.token), content.map((t) => t.token));

// bad requests: 400s that name the problem
async function refused(body, says) {
  try {
    await client.chat.completions.create({ model, max_tokens: 4, messages, ...body });
  } catch (e) {
    assert.equal(e.status, 400, String(e));
    assert.ok(e.message.includes(says), e.message);
    return;
  }
  assert.fail('accepted ' + JSON.stringify(body));
}
await refused({ logprobs: true, top_logprobs: 21 }, 'top_logprobs');
await refused({ response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'string', pattern: '^(?=a)$' } } } }, 'schema');

console.log('all checks passed');
