"""Tool calling through a running SPADE gateway with the official `openai` package (tests/sdk_e2e.sh
runs it against the Qwen pair, whose chat template knows tools).

The round trip an agent makes: tools -> tool_calls -> a tool message with the result -> the final
answer, non-streamed and streamed; each answer equal to target-only decoding (spade.draft_len 0)
under greedy decoding; parallel_tool_calls false. Then constrained output: tool_choice "required"
and a named tool (calls held to the tool's parameter schema), and `chat.completions.parse` with a
Pydantic model as the response_format, each equal to target-only decoding under the same grammar.
"""
import json
import sys

import openai
from openai import OpenAI
from pydantic import BaseModel

client = OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=600)
tools = [{"type": "function", "function": {
    "name": "multiply", "description": "Multiply two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
# Without the system prompt Qwen2.5-Coder-1.5B calls the tool again after its result (as it does
# target-only: that is the model, reproduced exactly).
messages = [{"role": "system", "content": "When a tool response is available, reply with the final answer and do not call tools again."},
            {"role": "user", "content": "What is 1234 times 5678?"}]
common = dict(model="spade", temperature=0, max_tokens=120, tools=tools)
target_only = {"spade": {"draft_len": 0}}
report = {}

first = client.chat.completions.create(messages=messages, **common)
choice = first.choices[0]
assert choice.finish_reason == "tool_calls", first
call = choice.message.tool_calls[0]
assert call.type == "function" and call.function.name == "multiply" and call.id, call
assert json.loads(call.function.arguments) == {"a": 1234, "b": 5678}, call.function.arguments
reference = client.chat.completions.create(messages=messages, extra_body=target_only, **common).choices[0].message
assert [(c.function.name, c.function.arguments) for c in reference.tool_calls] == [(call.function.name, call.function.arguments)], reference
report["call"] = call.function.model_dump()

# Streamed: the call arrives as delta.tool_calls pieces that add up to the same call.
pieces = {}
finish = None
for chunk in client.chat.completions.create(messages=messages, stream=True, **common):
    for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
        entry = pieces.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
        entry["id"] = entry["id"] or delta.id
        entry["name"] += delta.function.name or ""
        entry["arguments"] += delta.function.arguments or ""
    if chunk.choices and chunk.choices[0].finish_reason:
        finish = chunk.choices[0].finish_reason
assert finish == "tool_calls", finish
assert [(p["name"], p["arguments"]) for p in pieces.values()] == [(call.function.name, call.function.arguments)], pieces
assert all(p["id"] for p in pieces.values()), pieces

# The result goes back as a tool message; the answer uses it.
followup = messages + [choice.message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "7006652"}]
answer = client.chat.completions.create(messages=followup, **common)
text = answer.choices[0].message.content
assert answer.choices[0].finish_reason == "stop" and text and "7006652" in text, answer
assert client.chat.completions.create(messages=followup, extra_body=target_only, **common).choices[0].message.content == text
streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(messages=followup, stream=True, **common) if c.choices)
assert streamed == text, (streamed, text)
report["answer"] = text

# Two questions: two calls (here as bare JSON objects, one per line), one when parallel calls are off.
two = messages[:1] + [{"role": "user", "content": "What is 12 times 34? And what is 56 times 78?"}]
both = client.chat.completions.create(messages=two, **common).choices[0]
assert [json.loads(c.function.arguments) for c in both.message.tool_calls] == [{"a": 12, "b": 34}, {"a": 56, "b": 78}], both
single = client.chat.completions.create(messages=two, parallel_tool_calls=False, **common).choices[0]
assert [json.loads(c.function.arguments) for c in single.message.tool_calls] == [{"a": 12, "b": 34}], single
assert single.finish_reason == "tool_calls", single
report["parallel"] = [len(both.message.tool_calls), len(single.message.tool_calls)]

# Forced calls: even a question that needs no tool gets a call, with schema-valid arguments.
hello = messages[:1] + [{"role": "user", "content": "Say hello."}]
for choice_param in ["required", {"type": "function", "function": {"name": "multiply"}}]:
    forced = client.chat.completions.create(messages=hello, tool_choice=choice_param, **common).choices[0]
    assert forced.finish_reason == "tool_calls" and forced.message.tool_calls, forced
    for c in forced.message.tool_calls:
        args = json.loads(c.function.arguments)
        assert c.function.name == "multiply" and set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values()), c
    alone = client.chat.completions.create(messages=hello, tool_choice=choice_param, extra_body=target_only, **common).choices[0]
    assert [c.function.model_dump() for c in alone.message.tool_calls] == [c.function.model_dump() for c in forced.message.tool_calls], (alone, forced)
    report[f"forced {json.dumps(choice_param)}"] = [c.function.model_dump() for c in forced.message.tool_calls]
try:
    client.chat.completions.create(messages=hello, tool_choice={"type": "function", "function": {"name": "divide"}}, **common)
    raise AssertionError("a tool_choice naming no tool was accepted")
except openai.BadRequestError as e:
    assert e.body["param"] == "tool_choice.function.name", e.body


# Structured output: the SDK sends the model's strict JSON schema and parses the answer into it.
class Product(BaseModel):
    a: int
    b: int
    product: int
    note: str


question = [{"role": "user", "content": "Multiply 12 by 34. Give a, b, the product and a short note."}]
parsed = client.chat.completions.parse(model="spade", messages=question, response_format=Product, temperature=0, max_tokens=120)
message = parsed.choices[0].message
assert isinstance(message.parsed, Product), message
alone = client.chat.completions.parse(model="spade", messages=question, response_format=Product, temperature=0, max_tokens=120, extra_body=target_only)
assert alone.choices[0].message.content == message.content, (alone, message)
free = client.chat.completions.create(model="spade", messages=question, temperature=0, max_tokens=120)
assert free.choices[0].message.content != message.content, "the schema should shape the answer"
report["parsed"] = message.parsed.model_dump()
print(json.dumps(report, indent=1))
