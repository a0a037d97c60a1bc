// /v1/embeddings with the official openai client and LangChain's
// OpenAIEmbeddings in LangChain's own vector store (MemoryVectorStore) and a
// retrieval chain over it, then store → search → ask on the one server:
// node openai_embeddings.mjs BASE_URL API_KEY
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { ChatOpenAI, OpenAIEmbeddings } from '@langchain/openai';
import { MemoryVectorStore } from '@langchain/classic/vectorstores/memory';
import { ChatPromptTemplate } from '@langchain/core/prompts';
import { StringOutputParser } from '@langchain/core/output_parsers';
import { RunnablePassthrough, RunnableSequence } from '@langchain/core/runnables';

const [baseURL, apiKey] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 60000 });
const model = (await client.models.list()).data[0].id;
const texts = ['The quick brown fox jumps over the lazy dog.', 'A chunk store keeps KV caches.', 'hi'];

// the client asks for base64 unless told otherwise, and decodes it itself
const b64 = await client.embeddings.create({ model, input: texts });
const floats = await client.embeddings.create({ model, input: texts, encoding_format: 'float' });
assert.equal(b64.object, 'list');
assert.equal(b64.data.length, texts.length);
for (let i = 0; i < texts.length; i++) {
  assert.equal(b64.data[i].index, i);
  assert.deepEqual(Array.from(b64.data[i].embedding), floats.data[i].embedding, 'base64 decodes to the same floats');
  const norm = Math.hypot(...floats.data[i].embedding);
  assert.ok(Math.abs(norm - 1) < 1e-5, `unit length, not ${norm}`);
}
assert.ok(b64.usage.prompt_tokens > 0);
assert.equal(b64.usage.total_tokens, b64.usage.prompt_tokens);

const cut = await client.embeddings.create({ model, input: 'hi', dimensions: 16, encoding_format: 'float' });
assert.equal(cut.data[0].embedding.length, 16);

// errors reach the client as its typed errors
await assert.rejects(client.embeddings.create({ model, input: [] }), (e) => e.status === 400);

// LangChain's embeddings, as a vector store calls them. inputs of one request
// share a forward, so a query alone is compared with the same text alone
const embeddings = new OpenAIEmbeddings({ model, apiKey, configuration: { baseURL }, maxRetries: 0 });
const alone = await client.embeddings.create({ model, input: texts[0], encoding_format: 'float' });
assert.deepEqual(await embeddings.embedQuery(texts[0]), alone.data[0].embedding);
const docs = await embeddings.embedDocuments(texts);
for (let i = 0; i < texts.length; i++) assert.deepEqual(docs[i], floats.data[i].embedding);

// LangChain's vector store over those embeddings: a text is nearest to itself,
// with the cosine the floats give; its retriever feeds a chain to the chat model
const cosine = (a, b) => a.reduce((s, x, i) => s + x * b[i], 0) / (Math.hypot(...a) * Math.hypot(...b));
const store = await MemoryVectorStore.fromTexts(texts, texts.map((_, i) => ({ i })), embeddings);
const hits = await store.similaritySearchWithScore(texts[1], 3);
assert.equal(hits.length, 3);
assert.equal(hits[0][0].pageContent, texts[1], 'a text is nearest to itself');
for (const [doc, score] of hits) {
  const want = cosine(await embeddings.embedQuery(texts[1]), floats.data[doc.metadata.i].embedding);
  assert.ok(Math.abs(score - want) < 1e-5, `score ${score} vs the floats' cosine ${want}`);
}
const llm = new ChatOpenAI({ model, temperature: 0, maxTokens: 4, apiKey, maxRetries: 0, configuration: { baseURL } });
const prompt = ChatPromptTemplate.fromMessages([['system', 'Answer from the passages.'], ['human', '{context}\n\n{question}']]);
const chain = RunnableSequence.from([
  { context: store.asRetriever(2).pipe((ds) => ds.map((d) => d.pageContent).join('\n\n')), question: new RunnablePassthrough() },
  prompt, llm, new StringOutputParser(),
]);
const chained = await chain.invoke(texts[1]);
assert.equal(typeof chained, 'string');
// the one-server RAG loop: store, search, then ask with the ids found (fused from the store)
const stored = await client.post('/documents', { body: { documents: texts } });
const found = await client.post('/documents/search', { body: { query: texts[1], k: 2 } });
assert.equal(found.data.length, 2);
assert.equal(found.data[0].id, stored.data[1].id, 'a document is nearest to its own text');
const answer = await client.chat.completions.create({
  model, max_tokens: 4, temperature: 0,
  messages: [{ role: 'user', content: 'What keeps KV caches?' }],
  documents: found.data.map((d) => ({ id: d.id })),
});
assert.ok(answer.kvblend.store_hits >= 2, JSON.stringify(answer.kvblend));
console.log('all checks passed');
