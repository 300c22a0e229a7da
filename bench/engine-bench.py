#!/usr/bin/env python3
"""Verification on a serving engine, timed on the two-machine emulation (issue 47's benchmark).

    python3 bench/engine-bench.py [--rtts 0,50,100] [--prompts 4] [--tokens 64] [--out DIR]

The cloud machine is CPU 0, one thread: llama-server (Qwen2.5-Coder-1.5B, the GGUF the verifier
reads) with `spade-verifier --engine` in front of it, and our own `spade-verifier --model` for
comparison. The edge is CPU 1: one gateway per mode (Qwen2.5-Coder-0.5B drafting, one compute
thread), each behind its own spade-delay-proxy at the RTT. Modes, greedy, taking turns prompt by
prompt so that compared modes are timed seconds apart:

  engine target-only   gateway --draft-len 0 -> verifier --engine (sequential) -> llama-server
  engine match seq     gateway auto          -> verifier --engine --engine-calls sequential
  engine match par     gateway auto          -> verifier --engine --engine-calls parallel (6 slots)
  ours target-only     gateway --draft-len 0 -> spade-verifier --model
  ours ratio           gateway auto          -> spade-verifier --model (rule ratio)
  ours match           gateway auto          -> spade-verifier --model --rule match

Every engine answer is compared with llama-server's own greedy generation of the same prompt ids;
ours with ours target-only. Then acceptance at T = 0.7 (seeded, draft length 4) under ratio and
match on our scorer. Needs the binaries (cargo build), the models (scripts/fetch-models.sh pair)
and llama-server (bash scripts/llama-cpp-build.sh llama-server).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from importlib import import_module

coding = import_module("coding-bench")
ROOT, BIN, DRAFT, TARGET = coding.ROOT, coding.BIN, coding.DRAFT, coding.TARGET
free_port, spawn, wait_ready, post = coding.free_port, coding.spawn, coding.wait_ready, coding.post


def llama_server_path():
    return subprocess.run(["bash", str(ROOT / "scripts/llama-cpp-build.sh"), "llama-server"], check=True,
                          capture_output=True, text=True).stdout.strip() + "/llama-server"


def prompts(n):
    rows = [json.loads(l) for l in open(ROOT / "bench/prompts.jsonl")]
    return [r for r in rows if r["id"].startswith("code")][:n]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtts", default="0,50,100")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / f"bench/results/engine-{time.strftime('%Y%m%d-%H%M')}"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llama = llama_server_path()
    procs = []
    cloud = ["taskset", "-c", "0"]
    try:
        engines = {}
        for name, slots in (("seq", ["-np", "1"]), ("par", ["-np", "6", "-kvu"])):
            port = free_port()
            procs.append(spawn([*cloud, llama, "-m", TARGET, "--port", str(port), "-c", "4096", "-t", "1", "-tb", "1",
                                "--poll", "0", *slots], out / f"llama-server-{name}.log"))
            engines[name] = port
        for port in engines.values():
            wait_ready(port, path="/health")  # llama-server has no /health/ready
        verifiers = {}
        for name, flags in {
            "engine-seq": ["--engine", f"http://127.0.0.1:{engines['seq']}", "--engine-calls", "sequential"],
            "engine-par": ["--engine", f"http://127.0.0.1:{engines['par']}", "--engine-calls", "parallel"],
            "ours": ["--threads", "1"],
            "ours-match": ["--threads", "1", "--rule", "match"],
        }.items():
            port = free_port()
            procs.append(spawn([*cloud, BIN / "spade-verifier", "--model", TARGET, "--port", str(port), "--log", "warn",
                                *flags], out / f"verifier-{name}.log"))
            verifiers[name] = port
        for port in verifiers.values():
            wait_ready(port)
        modes = {
            "engine target-only": ("engine-seq", ["--draft-len", "0"]),
            "engine match seq": ("engine-seq", ["--draft-len", "auto"]),
            "engine match par": ("engine-par", ["--draft-len", "auto"]),
            "ours target-only": ("ours", ["--draft-len", "0"]),
            "ours ratio": ("ours", ["--draft-len", "auto"]),
            "ours match": ("ours-match", ["--draft-len", "auto"]),
        }
        chosen = prompts(args.prompts)
        results = {"speed": {}, "acceptance": {}}
        base = procs[:]
        for rtt in [int(r) for r in args.rtts.split(",")]:
            gateways = {}
            for mode, (verifier, flags) in modes.items():
                gateways[mode] = coding.edge(procs, verifiers[verifier], rtt, flags, out, mode.replace(" ", "-"))
            for port in gateways.values():
                wait_ready(port)
            runs = {mode: [] for mode in modes}
            for p in chosen:
                body = {"messages": p["messages"], "max_tokens": args.tokens, "temperature": 0}
                ids, _ = post(gateways["ours ratio"], "/tokenize", {"messages": p["messages"], "add_generation_prompt": True})
                own, _ = post(engines["seq"], "/completion", {"prompt": ids["tokens"], "n_predict": args.tokens,
                                                              "temperature": 0, "samplers": ["temperature"]})
                for mode, port in gateways.items():
                    answer, secs = post(port, "/v1/chat/completions", body)
                    usage = answer["usage"]
                    runs[mode].append({"id": p["id"], "text": answer["choices"][0]["message"]["content"],
                                       "engine_text": own["content"], "seconds": secs,
                                       "tokens": usage["completion_tokens"], "calls": usage["spade"]["verify_calls"],
                                       "drafted": usage["spade"]["drafted"], "accepted": usage["spade"]["draft_accepted"]})
                print(f"rtt {rtt} {p['id']}: " + ", ".join(f"{m} {r[-1]['seconds']:.1f} s" for m, r in runs.items()), flush=True)
            results["speed"][rtt] = runs
            for p in procs[len(base):]:
                p.terminate()
            procs = procs[:len(base)]
        # Acceptance at T = 0.7, draft length 4, seeded: ratio against match on our scorer, RTT 0.
        for mode, verifier in (("ratio", "ours"), ("match", "ours-match")):
            gport = free_port()
            procs.append(spawn(["taskset", "-c", "1", BIN / "spade-gateway", "--draft-model", DRAFT, "--verifier-url",
                                f"http://127.0.0.1:{verifiers[verifier]}", "--port", str(gport), "--log", "warn"],
                               out / f"gateway-acceptance-{mode}.log", {"RAYON_NUM_THREADS": "1"}))
            wait_ready(gport)
            drafted = accepted = calls = tokens = 0
            for seed, p in enumerate(chosen):
                body = {"messages": p["messages"], "max_tokens": args.tokens, "temperature": 0.7, "seed": seed,
                        "spade": {"draft_len": 4}}
                answer, _ = post(gport, "/v1/chat/completions", body)
                s = answer["usage"]["spade"]
                drafted, accepted = drafted + s["drafted"], accepted + s["draft_accepted"]
                calls, tokens = calls + s["verify_calls"], tokens + answer["usage"]["completion_tokens"]
            results["acceptance"][mode] = {"drafted": drafted, "accepted": accepted, "calls": calls, "tokens": tokens}
            print(f"T=0.7 {mode}: {accepted}/{drafted} drafts accepted, {tokens / max(calls, 1):.2f} tokens per call", flush=True)
            procs.pop().terminate()
        (out / "results.json").write_text(json.dumps(results, indent=1))
        report(results, out)
    finally:
        for p in procs:
            p.terminate()


def report(results, out):
    lines = [f"# Verification on a serving engine ({time.strftime('%Y-%m-%d %H:%M')} UTC)", "",
             "| RTT | mode | median s | x its target-only | tokens/call | drafts accepted | identical |",
             "|---:|---|---:|---:|---:|---:|---|"]
    for rtt, runs in results["speed"].items():
        for mode, rs in runs.items():
            base = runs["engine target-only" if mode.startswith("engine") else "ours target-only"]
            ratio = statistics.median(b["seconds"] / r["seconds"] for r, b in zip(rs, base))
            if mode.startswith("engine"):
                same = sum(r["text"] == r["engine_text"] for r in rs)
                against = "llama-server's own"
            else:
                same = sum(r["text"] == b["text"] for r, b in zip(rs, base))
                against = "ours target-only"
            lines.append(f"| {rtt} | {mode} | {statistics.median(r['seconds'] for r in rs):.1f} | {ratio:.2f} | "
                         f"{sum(r['tokens'] for r in rs) / max(1, sum(r['calls'] for r in rs)):.2f} | "
                         f"{sum(r['accepted'] for r in rs)}/{sum(r['drafted'] for r in rs)} | {same} of {len(rs)} ({against}) |")
    lines += ["", "| T = 0.7, draft length 4 | drafts accepted | tokens per call |", "|---|---:|---:|"]
    for mode, a in results["acceptance"].items():
        lines.append(f"| {mode} | {a['accepted']}/{a['drafted']} ({a['accepted'] / max(1, a['drafted']):.2f}) | "
                     f"{a['tokens'] / max(1, a['calls']):.2f} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
