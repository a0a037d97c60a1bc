// LangChain.js (@langchain/openai) against kvblend serve and llama-server (--jinja), same model:
//   node langchain_probes.mjs URL_KVBLEND URL_LLAMA > langchain.json
// Random weights (see openai_probes.mjs): the cases check shapes, counts,
// greedy answers equal across invoke/stream/batch, and what grammars make
// parse and validate (structured output, tool calls).
import { API_KEY, assert, pkg, runSuite, stopFrom } from './common.mjs';

const { ChatOpenAI, OpenAI, OpenAIEmbeddings } = await pkg('@langchain/openai');
const { MemoryVectorStore } = await pkg('@langchain/classic/vectorstores/memory');
const { HumanMessage, SystemMessage, ToolMessage } = await pkg('@langchain/core/messages');
const { tool } = await pkg('@langchain/core/tools');
const { ChatPromptTemplate } = await pkg('@langchain/core/prompts');
const { StringOutputParser } = await pkg('@langchain/core/output_parsers');
const { RunnablePassthrough, RunnableSequence } = await pkg('@langchain/core/runnables');
const { Document } = await pkg('@langchain/core/documents');
const { KeywordRetriever } = await import('../../tests/server/node/keyword_retriever.mjs');
const { z } = await pkg('zod');

function chat(s, fields = {}) {
  return new ChatOpenAI({
    model: s.model, temperature: 0, maxTokens: 12, apiKey: API_KEY, maxRetries: 0, timeout: 120000,
    configuration: { baseURL: s.root + '/v1' }, ...fields,
  });
}
function completionLLM(s, fields = {}) {
  return new OpenAI({
    model: s.model, temperature: 0, maxTokens: 8, apiKey: API_KEY, maxRetries: 0, timeout: 120000,
    configuration: { baseURL: s.root + '/v1' }, ...fields,
  });
}
const hello = [new HumanMessage('Once upon a time')];

const Weather = z.object({ city: z.enum(['Paris', 'Oslo', 'Lima']), days: z.number().int().min(1).max(7) });
const Time = z.object({ zone: z.enum(['UTC', 'CET']) });
const getWeather = tool(async ({ city, days }) => `${city}: clear for ${days} days`,
  { name: 'get_weather', description: 'the weather of a city', schema: Weather });
const getTime = tool(async ({ zone }) => `12:00 ${zone}`, { name: 'get_time', description: 'the time in a zone', schema: Time });
const weatherQ = new HumanMessage('What is the weather in Paris?');
const toolLLM = (s, seed, extra = {}) => chat(s, {
  temperature: 1, maxTokens: 300, modelKwargs: { seed, logit_bias: s.endBias, parallel_tool_calls: false }, ...extra });

function checkToolCall(call, names = ['get_weather', 'get_time']) {
  assert.ok(names.includes(call.name), `called ${call.name}`);
  assert.ok(typeof call.id === 'string' && call.id.length > 0, 'call id');
  const schema = call.name === 'get_weather' ? Weather : Time;
  assert.ok(schema.safeParse(call.args).success, JSON.stringify(call.args));
}

const Answer = z.object({ who: z.enum(['Lily', 'Tom', 'Ben']), sure: z.boolean() });
const story = [['system', 'Answer from the passages.'], ['human', 'Lily had a little cat named Tom. Ben had a big dog.\n\nWho had a cat?']];

// a few passages for the keyword retriever (best k by shared words)
const passages = [
  'Tom had a red ball. He threw it over the fence and it landed in the garden.',
  'Sue found a little cat under the tree and gave it some milk.',
  'Lily drew a big house with her crayons, then a sun and a dog.',
  'Ben ran to the park with his dog and played until the evening.',
].map((t, i) => new Document({ pageContent: t, metadata: { i } }));
function ragChain(llm) {
  const prompt = ChatPromptTemplate.fromMessages([['system', 'Answer from the passages.'], ['human', '{context}\n\nQuestion: {question}']]);
  return RunnableSequence.from([
    { context: new KeywordRetriever(passages, 2).pipe((ds) => ds.map((d) => d.pageContent).join('\n\n')), question: new RunnablePassthrough() },
    prompt, llm, new StringOutputParser(),
  ]);
}

function embedder(s) {
  return new OpenAIEmbeddings({ model: s.model, apiKey: API_KEY, maxRetries: 0, timeout: 120000,
    configuration: { baseURL: s.embedRoot + '/v1' } });
}
const cosine = (a, b) => a.reduce((t, x, i) => t + x * b[i], 0) / (Math.hypot(...a) * Math.hypot(...b));

const greedyCache = new Map();
async function greedy(s) {
  if (!greedyCache.has(s.label)) greedyCache.set(s.label, await chat(s).invoke(hello));
  return greedyCache.get(s.label);
}

const cases = [
  { group: 'chat', name: 'ChatOpenAI.invoke: AIMessage, usage_metadata, finish_reason', run: async (s) => {
    const m = await chat(s, { maxTokens: 8 }).invoke(hello);
    assert.equal(m.getType(), 'ai');
    assert.ok(typeof m.content === 'string' && m.content.length > 0, 'content');
    assert.equal(m.response_metadata.finish_reason, 'length');
    assert.equal(m.usage_metadata.output_tokens, 8);
    assert.ok(m.usage_metadata.input_tokens > 0);
    assert.equal(m.usage_metadata.total_tokens, m.usage_metadata.input_tokens + 8);
  } },
  { group: 'chat', name: 'ChatOpenAI.stream: chunks concat = invoke, usage on the stream', run: async (s) => {
    const whole = await greedy(s);
    let acc;
    let n = 0;
    for await (const c of await chat(s).stream(hello)) {
      acc = acc ? acc.concat(c) : c;
      n++;
    }
    assert.ok(n >= 3, `${n} chunks`);
    assert.equal(acc.content, whole.content);
    assert.equal(acc.usage_metadata?.output_tokens, 12, `usage ${JSON.stringify(acc.usage_metadata)}`);
  } },
  { group: 'chat', name: 'ChatOpenAI.batch: 4 at once on 1 slot, same greedy answers', run: async (s) => {
    const out = await chat(s).batch([hello, [new HumanMessage('Hi')], hello, hello], { maxConcurrency: 4 });
    const whole = await greedy(s);
    assert.equal(out.length, 4);
    for (const i of [0, 2, 3]) assert.equal(out[i].content, whole.content, `answer ${i}`);
    assert.equal(typeof out[1].content, 'string');
  } },
  { group: 'chat', name: 'invoke with stop: cut, finish_reason stop', run: async (s) => {
    const llm = chat(s, { temperature: 1, maxTokens: 16, modelKwargs: { seed: 21 } });
    const text = (await llm.invoke(hello)).content;
    const stop = stopFrom(text);
    assert.ok(stop, `no stop string in '${text}'`);
    const m = await llm.invoke(hello, { stop: [stop] });
    assert.equal(m.content, text.slice(0, text.indexOf(stop)));
    assert.equal(m.response_metadata.finish_reason, 'stop');
  } },
  { group: 'chat', name: 'logprobs: response_metadata.logprobs', run: async (s) => {
    const m = await chat(s, { maxTokens: 5, logprobs: true, topLogprobs: 2 }).invoke(hello);
    const content = m.response_metadata.logprobs?.content;
    assert.ok(Array.isArray(content), 'logprobs.content');
    assert.equal(content.length, 5);
    for (const t of content) {
      assert.equal(t.top_logprobs.length, 2);
      assert.equal(t.top_logprobs[0].token, t.token);
    }
    assert.equal(content.map((t) => t.token).join(''), m.content);
  } },
  { group: 'chat', name: 'callbacks: tokens streamed, usage at the end', run: async (s) => {
    // (.stream, not invoke with streaming: true, which counts tokens with
    // tiktoken's files from the network when the stream ends: offline it waits on retries)
    let tokens = 0;
    let ended = null;
    let acc;
    const stream = await chat(s, { maxTokens: 6 }).stream(hello, { callbacks: [{
      handleLLMNewToken() { tokens++; },
      handleLLMEnd(out) { ended = out; },
    }] });
    for await (const c of stream) acc = acc ? acc.concat(c) : c;
    assert.ok(tokens >= 3, `${tokens} tokens seen`);
    assert.ok(ended, 'handleLLMEnd called');
    const msg = ended.generations[0][0].message;
    assert.equal(msg.usage_metadata?.output_tokens, 6, JSON.stringify(msg.usage_metadata));
    assert.equal(acc.usage_metadata?.output_tokens, 6);
  } },
  { group: 'chat', name: 'a 400 comes back as an error with its status', run: async (s) => {
    const llm = chat(s, { logprobs: true, topLogprobs: 21 });
    let caught = null;
    try {
      await llm.invoke(hello);
    } catch (e) {
      caught = e;
    }
    assert.ok(caught, 'accepted (200)');
    assert.ok(caught.status === 400 || /400/.test(String(caught.message)), String(caught.message).slice(0, 100));
  } },

  { group: 'chat', name: 'a prompt over the context: ContextOverflowError', run: async (s) => {
    const long = Array.from({ length: 2600 }, (_, i) => `w${i % 97}`).join(' ');
    await assert.rejects(chat(s, { maxTokens: 4 }).invoke([new HumanMessage(long)]),
      (e) => e.name === 'ContextOverflowError' || assert.fail(`${e.name}, not ContextOverflowError: ${String(e.message).slice(0, 100)}`));
  } },

  // ---- structured output
  { group: 'structured', name: 'withStructuredOutput(zod) jsonSchema', run: async (s) => {
    for (const seed of [1, 2]) {
      const out = await chat(s, { temperature: 1, maxTokens: 60, modelKwargs: { seed } })
        .withStructuredOutput(Answer, { method: 'jsonSchema', name: 'answer' }).invoke(story);
      assert.ok(Answer.safeParse(out).success, JSON.stringify(out));
    }
  } },
  { group: 'structured', name: 'withStructuredOutput(zod) functionCalling', run: async (s) => {
    const out = await toolLLM(s, 3).withStructuredOutput(Answer, { method: 'functionCalling', name: 'answer' }).invoke(story);
    assert.ok(Answer.safeParse(out).success, `not an Answer: ${JSON.stringify(out)?.slice(0, 80)}`);
  } },
  { group: 'structured', name: 'withStructuredOutput jsonMode (json_object)', run: async (s) => {
    const Loose = z.record(z.string(), z.unknown());
    const out = await chat(s, { temperature: 1, maxTokens: 100,
      modelKwargs: { seed: 1, logit_bias: { ...s.endBias, [s.tok.brace]: 8, [s.tok.quote]: 8 } } })
      .withStructuredOutput(Loose, { method: 'jsonMode', includeRaw: true }).invoke([['human', 'Reply in JSON.']]);
    assert.equal(out.raw.response_metadata.finish_reason, 'stop', `finish ${out.raw.response_metadata.finish_reason}`);
    assert.ok(out.parsed && typeof out.parsed === 'object' && !Array.isArray(out.parsed),
      `parsed ${JSON.stringify(out.parsed)} from ${JSON.stringify(out.raw.content).slice(0, 60)}`);
    assert.deepEqual(out.parsed, JSON.parse(out.raw.content));
  } },
  { group: 'structured', name: 'withStructuredOutput includeRaw: raw + parsed', run: async (s) => {
    const out = await chat(s, { temperature: 1, maxTokens: 60, modelKwargs: { seed: 4 } })
      .withStructuredOutput(Answer, { method: 'jsonSchema', name: 'answer', includeRaw: true }).invoke(story);
    assert.equal(out.raw.getType(), 'ai');
    assert.ok(Answer.safeParse(out.parsed).success, JSON.stringify(out.parsed));
    assert.deepEqual(out.parsed, JSON.parse(out.raw.content));
  } },

  // ---- tools
  { group: 'tools', name: "bindTools tool_choice 'any': tool_calls validate", run: async (s) => {
    const ai = await toolLLM(s, 4).bindTools([getWeather, getTime], { tool_choice: 'any' }).invoke([weatherQ]);
    assert.ok(ai.tool_calls.length >= 1, `no tool_calls; content ${JSON.stringify(ai.content).slice(0, 60)}`);
    ai.tool_calls.forEach((c) => checkToolCall(c));
    assert.equal(ai.response_metadata.finish_reason, 'tool_calls');
  } },
  { group: 'tools', name: 'bindTools named tool_choice', run: async (s) => {
    const ai = await toolLLM(s, 5).bindTools([getWeather, getTime], { tool_choice: 'get_time' }).invoke([weatherQ]);
    assert.ok(ai.tool_calls.length >= 1, `no tool_calls; content ${JSON.stringify(ai.content).slice(0, 60)}`);
    ai.tool_calls.forEach((c) => checkToolCall(c, ['get_time']));
  } },
  { group: 'tools', name: 'tool round trip: ToolMessage -> answer', run: async (s) => {
    const ai = await toolLLM(s, 6).bindTools([getWeather], { tool_choice: 'any' }).invoke([weatherQ]);
    assert.ok(ai.tool_calls.length >= 1, `no tool_calls; content ${JSON.stringify(ai.content).slice(0, 60)}`);
    const results = [];
    for (const call of ai.tool_calls) results.push(await getWeather.invoke(call));
    assert.ok(results[0] instanceof ToolMessage, 'the tool gives a ToolMessage');
    assert.equal(results[0].tool_call_id, ai.tool_calls[0].id);
    const answer = await chat(s, { temperature: 1, maxTokens: 8, modelKwargs: { seed: 7 } })
      .bindTools([getWeather], { tool_choice: 'none' }).invoke([weatherQ, ai, ...results]);
    assert.equal(typeof answer.content, 'string');
    assert.equal(answer.tool_calls.length, 0);
    assert.ok(answer.usage_metadata.input_tokens > ai.usage_metadata.input_tokens + 10, 'the call and its result are in the prompt');
  } },
  { group: 'tools', name: 'streamed tool_call_chunks concat = invoke', run: async (s) => {
    const llm = toolLLM(s, 8).bindTools([getWeather, getTime], { tool_choice: 'any' });
    const whole = await llm.invoke([weatherQ]);
    let acc;
    let chunks = 0;
    for await (const c of await llm.stream([weatherQ])) {
      acc = acc ? acc.concat(c) : c;
      if (c.tool_call_chunks?.length) chunks++;
    }
    assert.ok(chunks > 1, `${chunks} tool-call chunks`);
    assert.equal(acc.tool_calls.length, whole.tool_calls.length);
    acc.tool_calls.forEach((c, i) => {
      checkToolCall(c);
      assert.equal(c.name, whole.tool_calls[i].name);
      assert.deepEqual(c.args, whole.tool_calls[i].args);
    });
  } },

  // ---- completions (the OpenAI LLM class)
  { group: 'completions', name: 'OpenAI (completions) invoke + usage', run: async (s) => {
    let usage = null;
    const text = await completionLLM(s).invoke('Once upon a time', { callbacks: [{ handleLLMEnd(out) { usage = out.llmOutput?.tokenUsage; } }] });
    assert.ok(typeof text === 'string' && text.length > 0, 'text');
    assert.equal(usage?.completionTokens, 8, JSON.stringify(usage));
  } },
  { group: 'completions', name: 'OpenAI (completions) stream = invoke', run: async (s) => {
    const text = await completionLLM(s).invoke('Once upon a time');
    let acc = '';
    for await (const c of await completionLLM(s).stream('Once upon a time')) acc += c;
    assert.equal(acc, text);
  } },

  // ---- a retrieval chain
  { group: 'rag', name: 'RAG chain: retriever | prompt | llm | parser', run: async (s) => {
    let input = 0;
    const llm = chat(s, { maxTokens: 8 });
    const answer = await ragChain(llm).invoke('What did Tom throw over the fence?', { callbacks: [{
      handleLLMEnd(out) { input = out.generations[0][0].message.usage_metadata?.input_tokens ?? 0; } }] });
    assert.equal(typeof answer, 'string');
    assert.ok(answer.length > 0);
    const bare = await llm.invoke([new SystemMessage('Answer from the passages.'), new HumanMessage('Question: What did Tom throw over the fence?')]);
    assert.ok(input > bare.usage_metadata.input_tokens + 20, `the passages are in the prompt (${input} tokens)`);
    // the same chain twice: the same greedy answer
    assert.equal(await ragChain(llm).invoke('What did Tom throw over the fence?'), answer);
  } },

  // ---- retrieval by embeddings (PROBE_LLAMA_EMBED_URL: llama-server's --embeddings server)
  { group: 'embeddings', name: 'OpenAIEmbeddings: embedQuery = embedDocuments row, unit-length floats', run: async (s) => {
    const e = embedder(s);
    const texts = passages.map((d) => d.pageContent);
    const rows = await e.embedDocuments(texts);
    assert.equal(rows.length, texts.length);
    for (const r of rows) assert.ok(Math.abs(Math.hypot(...r) - 1) < 1e-3, `norm ${Math.hypot(...r)}`);
    const q = await e.embedQuery(texts[2]);
    assert.equal(q.length, rows[2].length);
    assert.ok(cosine(q, rows[2]) > 0.999, `a text alone and in a batch: cosine ${cosine(q, rows[2])}`);
  } },
  { group: 'embeddings', name: 'MemoryVectorStore retriever → RAG chain: nearest passage first, an answer', run: async (s) => {
    const store = await MemoryVectorStore.fromDocuments(passages, embedder(s));
    const hits = await store.similaritySearch(passages[1].pageContent, 2);
    assert.equal(hits[0].pageContent, passages[1].pageContent, 'a passage is nearest to itself');
    const prompt = ChatPromptTemplate.fromMessages([['system', 'Answer from the passages.'], ['human', '{context}\n\nQuestion: {question}']]);
    const chain = RunnableSequence.from([
      { context: store.asRetriever(2).pipe((ds) => ds.map((d) => d.pageContent).join('\n\n')), question: new RunnablePassthrough() },
      prompt, chat(s, { maxTokens: 8 }), new StringOutputParser(),
    ]);
    const answer = await chain.invoke('What did Sue give the cat?');
    assert.ok(typeof answer === 'string' && answer.length > 0, 'an answer');
  } },

  // ---- kvblend's own fields
  { group: 'kvblend documents', kvblendOnly: true, name: 'documents via modelKwargs + structured output', run: async (s) => {
    const responses = [];
    const fetchRec = async (url, init) => {
      const r = await fetch(url, init);
      responses.push(await r.clone().json());
      return r;
    };
    const llm = chat(s, { temperature: 1, maxTokens: 60, configuration: { baseURL: s.root + '/v1', fetch: fetchRec },
      modelKwargs: { seed: 5, documents: ['Lily had a little cat named Tom.', 'Ben had a big dog.'] } });
    const out = await llm.withStructuredOutput(Answer, { method: 'jsonSchema', name: 'answer' }).invoke('Who had a cat?');
    assert.ok(Answer.safeParse(out).success, JSON.stringify(out));
    assert.ok(responses.at(-1).kvblend?.n_fused > 0, JSON.stringify(responses.at(-1).kvblend));
  } },
  { group: 'kvblend documents', kvblendOnly: true, name: 'RAG chain: known passages found in the prompt', run: async (s) => {
    // the passages become known documents, then a chain that pastes them is fused from the store
    const r = await fetch(s.root + '/v1/documents', { method: 'POST', headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${API_KEY}` },
      body: JSON.stringify({ documents: passages.map((d) => d.pageContent) }) });
    assert.equal(r.status, 200);
    const responses = [];
    const fetchRec = async (url, init) => {
      const res = await fetch(url, init);
      responses.push(await res.clone().json());
      return res;
    };
    const llm = chat(s, { maxTokens: 8, configuration: { baseURL: s.root + '/v1', fetch: fetchRec } });
    await ragChain(llm).invoke('What did Sue give the cat?');
    const kb = responses.at(-1).kvblend;
    assert.equal(kb?.spans?.length, 2, JSON.stringify(kb));
    assert.ok(kb.store_hits >= 2, JSON.stringify(kb));
  } },
];

await runSuite('langchain', cases);
