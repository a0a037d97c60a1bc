// LangChain.js tool calling against kvblend serve: node langchain_tools.mjs BASE_URL API_KEY
// bindTools with a zod-typed tool: the AIMessage's tool_calls validate against
// the tool's schema, the tool runs, and its ToolMessage goes back for an answer.
import assert from 'node:assert/strict';
import { ChatOpenAI } from '@langchain/openai';
import { HumanMessage } from '@langchain/core/messages';
import { tool } from '@langchain/core/tools';
import { z } from 'zod';

const [baseURL, apiKey] = process.argv.slice(2);

async function tokenOf(text) {
  const r = await fetch(baseURL.replace(/\/v1$/, '') + '/tokenize', {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${apiKey}` },
    body: JSON.stringify({ content: text, parse_special: true }),
  });
  return (await r.json()).tokens[0];
}
// random weights: the ends of a turn made likely, so that the answer stops after one call
const logit_bias = { [await tokenOf('<|im_end|>')]: 100, [await tokenOf('<|endoftext|>')]: 100 };

const Weather = z.object({ city: z.enum(['Paris', 'Oslo', 'Lima']), days: z.number().int().min(1).max(7) });
const getWeather = tool(async ({ city, days }) => `${city}: clear for ${days} days`, {
  name: 'get_weather',
  description: 'the weather of a city',
  schema: Weather,
});

const llm = new ChatOpenAI({
  model: 'kvblend', temperature: 1, maxTokens: 200, apiKey, maxRetries: 0, timeout: 600000,
  modelKwargs: { seed: 4, logit_bias }, configuration: { baseURL },
});
const question = new HumanMessage('What is the weather in Paris?');
const ai = await llm.bindTools([getWeather], { tool_choice: 'any' }).invoke([question]);
assert.ok(ai.tool_calls.length >= 1, JSON.stringify(ai));
for (const call of ai.tool_calls) {
  assert.equal(call.name, 'get_weather');
  assert.ok(Weather.safeParse(call.args).success, JSON.stringify(call.args));
}
const result = await getWeather.invoke(ai.tool_calls[0]);  // a ToolMessage for that call
assert.equal(result.tool_call_id, ai.tool_calls[0].id);
const extra = ai.tool_calls.slice(1).map((c) => ({ role: 'tool', tool_call_id: c.id, content: 'n/a' }));
const brief = new ChatOpenAI({
  model: 'kvblend', temperature: 1, maxTokens: 8, apiKey, maxRetries: 0, timeout: 600000,
  modelKwargs: { seed: 5 }, configuration: { baseURL },
});
const answer = await brief.bindTools([getWeather], { tool_choice: 'none' }).invoke([question, ai, result, ...extra]);
assert.equal(typeof answer.content, 'string');
assert.equal(answer.tool_calls.length, 0);

console.log('all checks passed');
