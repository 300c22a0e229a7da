"""Drives a running SPADE gateway with the official `openai` package (tests/sdk_e2e.sh runs it).

Checks that non-streamed and streamed answers parse, agree with each other under greedy decoding,
that include_usage yields a final chunk with no choices and SPADE's usage extension, that
/v1/models lists the model, that penalties and logit_bias give the target-only answer, that legacy completions
parse streamed and not, that n = 2 gives two choices, and that a bad parameter raises BadRequestError naming it.
"""
import json
import sys
import urllib.request

import openai
from openai import OpenAI

base_url = sys.argv[1]
client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
messages = [{"role": "user", "content": "Name three primary colours."}]
report = {"openai_version": openai.__version__}

plain = client.chat.completions.create(model="spade", messages=messages, temperature=0, max_tokens=24)
text = plain.choices[0].message.content
assert text, plain
assert plain.choices[0].finish_reason in ("stop", "length"), plain
usage = plain.usage
assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage
details = usage.completion_tokens_details
assert details.accepted_prediction_tokens + details.rejected_prediction_tokens >= 0, details
spade = usage.model_extra["spade"]
assert spade["verify_calls"] >= 1 and not spade["degraded"], spade
report["plain"] = {"text": text, "usage": usage.model_dump()}

chunks = list(client.chat.completions.create(
    model="spade", messages=messages, temperature=0, max_tokens=24, stream=True, stream_options={"include_usage": True}))
assert chunks[0].choices[0].delta.role == "assistant", chunks[0]
streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
assert streamed == text, (streamed, text)
assert chunks[-1].choices == [] and chunks[-1].usage is not None, chunks[-1]
assert chunks[-1].usage.completion_tokens == usage.completion_tokens, (chunks[-1].usage, usage)
finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
assert finishes == [plain.choices[0].finish_reason], finishes
report["stream"] = {"chunks": len(chunks), "text_equal": True}

# Penalties and a ban through the SDK's own parameters: the banned token never appears, and the
# answer is the one the same request gives without speculation (spade.draft_len 0).
tokenize = urllib.request.Request(base_url.removesuffix("/v1") + "/tokenize", method="POST", headers={"content-type": "application/json"},
                                  data=json.dumps({"prompt": text, "add_special_tokens": False}).encode())
first_token = json.load(urllib.request.urlopen(tokenize, timeout=60))["tokens"][0]
penalised = dict(model="spade", messages=messages, temperature=0, max_tokens=24, presence_penalty=0.5, frequency_penalty=0.5,
                 logit_bias={str(first_token): -100})
spec = client.chat.completions.create(**penalised).choices[0].message.content
target_only = client.chat.completions.create(**penalised, extra_body={"spade": {"draft_len": 0}}).choices[0].message.content
assert spec == target_only, (spec, target_only)
assert spec != text, "a ban on the answer's first token changed nothing"
report["penalties"] = {"text": spec, "banned": first_token}

# Legacy completions: a raw prompt, non-streamed and streamed, the same text.
legacy = client.completions.create(model="spade", prompt="The three primary colours are", temperature=0, max_tokens=16)
assert legacy.object == "text_completion" and legacy.choices[0].text, legacy
pieces = [c.choices[0].text for c in client.completions.create(
    model="spade", prompt="The three primary colours are", temperature=0, max_tokens=16, stream=True) if c.choices]
assert "".join(pieces) == legacy.choices[0].text, (pieces, legacy.choices[0].text)
report["completions"] = {"text": legacy.choices[0].text, "chunks": len(pieces)}

models = client.models.list()
assert [m.id for m in models.data] == ["spade"], models
# n = 2 under greedy decoding: two choices, both the target's answer; usage covers both.
two = client.chat.completions.create(model="spade", messages=messages, temperature=0, max_tokens=24, n=2)
assert [c.index for c in two.choices] == [0, 1] and all(c.message.content == text for c in two.choices), two
assert two.usage.completion_tokens == 2 * usage.completion_tokens, (two.usage, usage)
report["n"] = 2
try:
    client.chat.completions.create(model="spade", messages=messages, n=0)
    raise AssertionError("n=0 was accepted")
except openai.BadRequestError as e:
    assert e.body["param"] == "n", e.body
report["errors"] = "n=0 -> BadRequestError(param=n)"
print(json.dumps(report, indent=1))
