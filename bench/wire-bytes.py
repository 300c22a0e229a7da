"""Wire bytes per committed token, binary vs JSON `/verify`, on the benchmark's short prompts.

Start one verifier and two gateways on it, one with `--verify-wire json` (docs/benchmarks.md, "Compact
wire" has the exact setup), then:

    python3 bench/wire-bytes.py BINARY_GATEWAY_PORT JSON_GATEWAY_PORT [PROMPTS]

For T = 0 and 0.8 and draft lengths 1, 4 and auto it prints the bytes of `/verify` bodies (both ways,
from `usage.spade`) per completion token, and the acceptance, for each gateway.
"""
import json
import sys
import urllib.request

ports = {"binary": int(sys.argv[1]), "json": int(sys.argv[2])}
count = int(sys.argv[3]) if len(sys.argv) > 3 else 6
prompts = [json.loads(line) for line in open("bench/prompts.jsonl")]
prompts = [p for p in prompts if p.get("max_tokens", 0) <= 64][:count]


def post(port, body):
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    return json.load(urllib.request.urlopen(request, timeout=600))


for temperature in [0.0, 0.8]:
    for draft_len in [1, 4, "auto"]:
        row = {}
        for wire, port in ports.items():
            tokens = wire_bytes = accepted = drafted = 0
            for seed, prompt in enumerate(prompts):
                body = {"messages": prompt["messages"], "max_tokens": 24, "temperature": temperature, "seed": seed, "spade": {"draft_len": draft_len}}
                usage = post(port, body)["usage"]
                details = usage["completion_tokens_details"]
                tokens += usage["completion_tokens"]
                wire_bytes += usage["spade"]["bytes_sent"] + usage["spade"]["bytes_received"]
                accepted += details["accepted_prediction_tokens"]
                drafted += details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"]
            row[wire] = (wire_bytes / tokens, accepted / max(drafted, 1))
        print(f"T={temperature} d={draft_len}: binary {row['binary'][0]:.1f} B/token (acceptance {row['binary'][1]:.3f}); "
              f"json {row['json'][0]:.1f} B/token (acceptance {row['json'][1]:.3f})", flush=True)
