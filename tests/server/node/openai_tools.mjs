// tool calls with the official openai client: node openai_tools.mjs BASE_URL API_KEY
// a round trip (tools → tool_calls → the tool's result → an answer) and the
// streamed deltas as the client's own stream helper puts them together. The
// model has random weights: "required" makes its grammar write a call from
// the first token; the ends of a turn are biased up so that it stops after one.
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const [baseURL, apiKey] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 600000 });
const model = (await client.models.list()).data[0].id;

async function tokenOf(text) {
  const r = await fetch(baseURL.replace(/\/v1$/, '') + '/tokenize', {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${apiKey}` },
    body: JSON.stringify({ content: text, parse_special: true }),
  });
  const { tokens } = await r.json();
  assert.equal(tokens.length, 1, text);
  return tokens[0];
}
const logit_bias = { [await tokenOf('<|im_end|>')]: 100, [await tokenOf('<|endoftext|>')]: 100 };

const tools = [{
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'the weather of a city',
    parameters: {
      type: 'object',
      properties: { city: { enum: ['Paris', 'Oslo', 'Lima'] }, days: { type: 'integer', minimum: 1, maximum: 7 } },
      required: ['city', 'days'],
      additionalProperties: false,
    },
  },
}];

function checkCall(call) {
  assert.equal(call.type, 'function');
  assert.equal(call.function.name, 'get_weather');
  assert.ok(call.id.length > 0);
  const args = JSON.parse(call.function.arguments);
  assert.ok(['Paris', 'Oslo', 'Lima'].includes(args.city), call.function.arguments);
  assert.ok(Number.isInteger(args.days) && args.days >= 1 && args.days <= 7, call.function.arguments);
}

const ask = { model, tools, tool_choice: 'required', parallel_tool_calls: false, temperature: 1, max_tokens: 200, logit_bias };

// the round trip: the assistant message goes back as the client returned it
const messages = [{ role: 'user', content: 'What is the weather in Oslo?' }];
const first = await client.chat.completions.create({ ...ask, seed: 1, messages });
assert.equal(first.choices[0].finish_reason, 'tool_calls');
const called = first.choices[0].message;
assert.equal(called.content, null);
assert.ok(called.tool_calls.length >= 1);
called.tool_calls.forEach(checkCall);
messages.push(called);
for (const call of called.tool_calls)
  messages.push({ role: 'tool', tool_call_id: call.id, content: JSON.stringify({ temperature: 21, sky: 'clear' }) });
const answer = await client.chat.completions.create({ model, tools, messages, tool_choice: 'none', seed: 2, max_tokens: 8 });
assert.equal(typeof answer.choices[0].message.content, 'string');
assert.equal(answer.choices[0].message.tool_calls, undefined);
assert.ok(answer.usage.prompt_tokens > first.usage.prompt_tokens);

// streamed: the client's stream helper accumulates the deltas into the same calls
const streamMessages = [{ role: 'user', content: 'What is the weather in Lima?' }];
const whole = await client.chat.completions.create({ ...ask, seed: 3, messages: streamMessages });
const stream = client.chat.completions.stream({ ...ask, seed: 3, messages: streamMessages });
let deltas = 0;
stream.on('tool_calls.function.arguments.delta', () => deltas++);
const streamed = await stream.finalChatCompletion();
assert.equal(streamed.choices[0].finish_reason, whole.choices[0].finish_reason);
const want = whole.choices[0].message.tool_calls;
const got = streamed.choices[0].message.tool_calls;
assert.equal(got.length, want.length);
got.forEach((call, i) => {
  checkCall(call);
  assert.deepEqual(call.function, want[i].function);
});
assert.ok(deltas > 1, `the arguments came in ${deltas} deltas`);

// a tool_choice naming no tool, and a tool result that answers no call: 400s
for (const [body, says] of [
  [{ ...ask, messages, tool_choice: { type: 'function', function: { name: 'get_time' } } }, 'get_time'],
  [{ ...ask, messages: [...messages, { role: 'tool', tool_call_id: 'call_x', content: '1' }] }, 'call_x'],
]) {
  await assert.rejects(client.chat.completions.create(body), (e) => e.status === 400 && e.message.includes(says));
}

console.log('all checks passed');
