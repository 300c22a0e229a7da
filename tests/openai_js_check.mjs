// Drives a running SPADE gateway with the official `openai` npm package under node (tests/sdk_e2e.sh
// runs it against the Qwen pair): a streamed chat completion, and a streamed tool call, each equal
// to the same request answered in one piece.
import OpenAI from "openai";
import assert from "node:assert/strict";

const client = new OpenAI({ baseURL: process.argv[2], apiKey: "unused", maxRetries: 0, timeout: 600_000 });
const report = {};

const ask = { model: "spade", temperature: 0, max_tokens: 32, messages: [{ role: "user", content: "Name three primary colours." }] };
const whole = await client.chat.completions.create(ask);
let streamed = "";
for await (const chunk of await client.chat.completions.create({ ...ask, stream: true })) {
  streamed += chunk.choices[0]?.delta?.content ?? "";
}
assert.equal(streamed, whole.choices[0].message.content);
report.text = streamed;

const tools = [{ type: "function", function: { name: "multiply", description: "Multiply two integers",
  parameters: { type: "object", properties: { a: { type: "integer" }, b: { type: "integer" } }, required: ["a", "b"] } } }];
const call = { model: "spade", temperature: 0, max_tokens: 64, tools, messages: [{ role: "user", content: "What is 1234 times 5678?" }] };
const calls = [];
let finish = null;
for await (const chunk of await client.chat.completions.create({ ...call, stream: true })) {
  for (const d of chunk.choices[0]?.delta?.tool_calls ?? []) {
    calls[d.index] ??= { id: "", name: "", arguments: "" };
    calls[d.index].id += d.id ?? "";
    calls[d.index].name += d.function?.name ?? "";
    calls[d.index].arguments += d.function?.arguments ?? "";
  }
  finish = chunk.choices[0]?.finish_reason ?? finish;
}
assert.equal(finish, "tool_calls");
assert.equal(calls.length, 1);
assert.equal(calls[0].name, "multiply");
assert.deepEqual(JSON.parse(calls[0].arguments), { a: 1234, b: 5678 });
const plain = (await client.chat.completions.create(call)).choices[0].message.tool_calls;
assert.deepEqual(plain.map((c) => [c.function.name, c.function.arguments]), [[calls[0].name, calls[0].arguments]]);
report.call = calls[0];
console.log(JSON.stringify(report));
