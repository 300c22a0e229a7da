"""A burst through the official `openai` package against a gateway with a short line
(scripts/reliability.sh runs it): every request gets through in the end on the SDK's own retries of
the gateway's 429s, which it spaces as their `retry-after-ms` says.

Usage: openai_burst_check.py BASE_URL API_KEY REQUESTS CASES_FILE
Appends one case to CASES_FILE (the reliability report's JSON lines) and exits non-zero on failure.
"""
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from openai import OpenAI

base_url, api_key, total, cases = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
refusals = []


def count_refusals(response):
    if response.status_code == 429:
        refusals.append(float(response.headers.get("retry-after-ms", "nan")))


client = OpenAI(
    base_url=base_url,
    api_key=api_key,
    max_retries=100,
    timeout=600,
    http_client=httpx.Client(event_hooks={"response": [count_refusals]}),
)


def ask(_):
    answer = client.chat.completions.create(
        model="spade",
        messages=[{"role": "user", "content": "Write one sentence about the sea."}],
        temperature=0,
        max_tokens=8,
    )
    return answer.choices[0].message.content


started = time.monotonic()
with ThreadPoolExecutor(total) as pool:
    texts = list(pool.map(ask, range(total)))
took = time.monotonic() - started
identical = len(set(texts)) == 1
waits = sorted(refusals)
observed = (
    f"{total} at once through openai {__import__('openai').__version__} (max_retries=100): "
    f"{len(texts)} answered, all identical: {identical}; {len(refusals)} 429s retried by the SDK "
    f"(retry-after-ms {waits[0]:.0f}-{waits[-1]:.0f})" if waits else f"{len(texts)} answered, no 429"
) + f"; {took:.1f} s"
passed = len(texts) == total and identical and len(refusals) > 0
with open(cases, "a") as f:
    f.write(json.dumps({"area": "load", "case": f"burst of {total} through the openai SDK's own retries", "observed": observed, "pass": passed}) + "\n")
print(observed)
sys.exit(0 if passed else 1)
