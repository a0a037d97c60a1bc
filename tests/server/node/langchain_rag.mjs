// a LangChain.js retrieval chain against kvblend serve, the way RAG apps send
// prompts: the retrieved passages stuffed into the user message (no
// "documents" field), in the retriever's order.
//   node langchain_rag.mjs BASE_URL API_KEY DOCS_DIR
// checked: the server finds passages it saw in earlier prompts (store hits
// from the second question on), and each answer equals the answer to a
// request with the same passages in kvblend's "documents" field.
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { ChatOpenAI } from '@langchain/openai';
import { Document } from '@langchain/core/documents';
import { ChatPromptTemplate } from '@langchain/core/prompts';
import { StringOutputParser } from '@langchain/core/output_parsers';
import { RunnablePassthrough, RunnableSequence } from '@langchain/core/runnables';
import { KeywordRetriever } from './keyword_retriever.mjs';

const [baseURL, apiKey, docsDir] = process.argv.slice(2);

const docs = fs.readdirSync(docsDir).sort().map((f) =>
  new Document({ pageContent: fs.readFileSync(path.join(docsDir, f), 'utf8').trim(), metadata: { source: f } }));
const retriever = new KeywordRetriever(docs, 3);

// every raw response, for its kvblend object (LangChain keeps only the OpenAI fields)
const responses = [];
const recordingFetch = async (url, init) => {
  const r = await fetch(url, init);
  responses.push(await r.clone().json());
  return r;
};
const llm = new ChatOpenAI({
  model: 'kvblend', temperature: 0, maxTokens: 8, apiKey, maxRetries: 0,
  configuration: { baseURL, fetch: recordingFetch },
});
const system = 'Answer the question from the passages.';
const prompt = ChatPromptTemplate.fromMessages([['system', system], ['human', '{context}\n\n{question}']]);
const formatDocs = (ds) => ds.map((d) => d.pageContent).join('\n\n');
const chain = RunnableSequence.from([
  { context: retriever.pipe(formatDocs), question: new RunnablePassthrough() },
  prompt, llm, new StringOutputParser(),
]);

const questions = [
  'What did Tom throw over the fence with his ball?',
  'What did Lily draw with her crayons, and did Sue give the cat milk?',
  'Who found a cat in the garden and gave it milk?',
  'What did Tom do when the ball went over the fence?',
];
const runs = [];
const seen = new Set();
for (const [i, q] of questions.entries()) {
  const answer = await chain.invoke(q);
  const kb = responses.at(-1).kvblend;
  assert.ok(kb, 'the response has a kvblend object');
  assert.equal(kb.spans.length, 3, `question ${i}: all three passages found: ${JSON.stringify(kb)}`);
  for (const s of kb.spans) {
    // a passage seen in an earlier prompt comes from the store
    if (seen.has(s.id)) assert.equal(s.store_hit, true, `question ${i}: ${JSON.stringify(kb)}`);
    seen.add(s.id);
  }
  if (i > 0) assert.ok(kb.store_hits >= 3, `question ${i}: ${JSON.stringify(kb)}`);
  runs.push({ q, answer, passages: (await retriever.invoke(q)).map((d) => d.pageContent) });
}
// the retriever put the passages in more than one order
assert.ok(new Set(runs.map((r) => r.passages.join('|'))).size >= 2, 'the passages came in different orders');

// the same passages in the documents field, asked after all chain questions
// (in reverse, so no request repeats the one before it): the same answers
for (const r of [...runs].reverse()) {
  const res = await fetch(baseURL + '/chat/completions', {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${apiKey}` },
    body: JSON.stringify({
      model: 'kvblend', temperature: 0, max_tokens: 8,
      messages: [{ role: 'system', content: system }, { role: 'user', content: r.q }],
      documents: r.passages.map((text) => ({ text })),
    }),
  });
  assert.equal(res.status, 200);
  const body = await res.json();
  assert.equal(body.choices[0].message.content, r.answer, `question '${r.q}'`);
}
console.log('all checks passed');
