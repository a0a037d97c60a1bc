// LangChain.js's structured output against kvblend serve:
//   node langchain_answers.mjs BASE_URL API_KEY
// withStructuredOutput(zodSchema) with the json_schema method (response_format),
// plain and over the documents of a retrieval prompt; the answers parse and
// validate. (jsonMode's json_object lets a random-weight model write one string
// until max_tokens: tests/server/test_server_answers.cpp checks it on stories260K.)
import assert from 'node:assert/strict';
import { ChatOpenAI } from '@langchain/openai';
import { z } from 'zod';

const [baseURL, apiKey] = process.argv.slice(2);

const Answer = z.object({
  who: z.enum(['Lily', 'Tom', 'Ben']),
  sure: z.boolean(),
});

for (const seed of [1, 2]) {
  const llm = new ChatOpenAI({
    model: 'kvblend', temperature: 1, maxTokens: 60, apiKey, maxRetries: 0, modelKwargs: { seed },
    configuration: { baseURL },
  });
  const structured = llm.withStructuredOutput(Answer, { method: 'jsonSchema', name: 'answer' });
  const out = await structured.invoke([
    ['system', 'Answer from the passages.'],
    ['human', 'Lily had a little cat named Tom. Ben had a big dog.\n\nWho had a cat?'],
  ]);
  assert.ok(Answer.safeParse(out).success, JSON.stringify(out));
}

// the server's documents field passed through modelKwargs: the same answer shape over fused documents
const rag = new ChatOpenAI({
  model: 'kvblend', temperature: 1, maxTokens: 60, apiKey, maxRetries: 0,
  modelKwargs: { seed: 5, documents: ['Lily had a little cat named Tom.', 'Ben had a big dog.'] },
  configuration: { baseURL },
});
const fused = await rag.withStructuredOutput(Answer, { method: 'jsonSchema', name: 'answer' }).invoke('Who had a cat?');
assert.ok(Answer.safeParse(fused).success, JSON.stringify(fused));

console.log('all checks passed');
