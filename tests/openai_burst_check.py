"""A burst through the official `openai` package against a gateway with a short line
(scripts/reliability.sh runs it): every request gets through in the end on the SDK's own retries of
the gateway's 429s, which it spaces as their `retry-after-ms` says.

Usage: openai_burst_check.py BASE_URL API_KEY REQUESTS CASES_FILE
Appends one case to CASES_FILE (the reliability report's JSON lines) and exits non-zero on failure.
"""
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
from openai import OpenAI

base_url, api_key, total, cases = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]


def refused():
    """The gateway's count of 429s so far."""
    url = base_url.removesuffix("/v1") + "/metrics"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"})
    text = urllib.request.urlopen(request).read().decode()
    return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith("spade_gateway_requests_refused_total{"))


client = OpenAI(base_url=base_url, api_key=api_key, max_retries=100, timeout=600)


def ask(_):
    answer = client.chat.completions.create(
        model="spade",
        messages=[{"role": "user", "content": "Write one sentence about the sea."}],
        temperature=0,
        max_tokens=8,
    )
    return answer.choices[0].message.content


before = refused()
started = time.monotonic()
with ThreadPoolExecutor(total) as pool:
    texts = list(pool.map(ask, range(total)))
took = time.monotonic() - started
refusals = refused() - before
identical = len(set(texts)) == 1
observed = (
    f"{total} at once through openai {openai.__version__} (max_retries=100): {len(texts)} answered, "
    f"all identical: {identical}; {refusals:.0f} 429s on the way, retried by the SDK; {took:.1f} s"
)
passed = len(texts) == total and identical and refusals > 0
with open(cases, "a") as f:
    f.write(json.dumps({"area": "load", "case": f"burst of {total} through the openai SDK's own retries", "observed": observed, "pass": passed}) + "\n")
print(observed)
sys.exit(0 if passed else 1)
