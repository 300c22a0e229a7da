#!/usr/bin/env python3
"""What coding assistants send, timed on the two-machine emulation (issue 48's benchmark).

    python3 bench/coding-bench.py [--rtts 0,50] [--fim-cuts 8] [--out bench/results/coding-NAME]

The verifier (Qwen2.5-Coder-1.5B) is pinned to CPU 0 with one thread; one gateway per mode
(Qwen2.5-Coder-0.5B drafting) to CPU 1 with one compute thread, each behind its own
spade-delay-proxy at the RTT. Modes, all greedy, every output compared with target-only's:

  target-only   --draft-len 0
  default       --draft-len auto --prompt-lookup false   (the gateway before copied drafts)
  lookup        --draft-len auto                          (prompt lookup on: today's default)
  prediction    lookup, and the request's `prediction` = the original file

(a) edit: a source file in the prompt (delay-proxy/src/link.rs, 167 lines, unless --edit-file and
--rename say otherwise), asked back whole with one function renamed, with and without
`prediction`; (b) the same without it is the lookup mode; (c) fill-in-the-middle at random cut
points of this repository's Python and Rust files (/v1/completions with suffix, 32 tokens), in
target-only, default and lookup. Modes take turns request by request, so the compared modes are
timed seconds apart. Each edit is timed after the same request with max_tokens 1 through the same
gateway, so every mode starts with the prompt cached on both sides (the time is decoding). Needs the
binaries built (cargo build) and the models (scripts/fetch-models.sh pair).
"""
import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(os.environ.get("CARGO_TARGET_DIR", Path.home() / ".cache/spade/target")) / "debug"
DRAFT = ROOT / "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
TARGET = ROOT / "models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
MODES = {
    "target-only": ["--draft-len", "0"],
    "default": ["--draft-len", "auto", "--prompt-lookup", "false"],
    "lookup": ["--draft-len", "auto"],
    "prediction": ["--draft-len", "auto"],
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(cmd, log, env=None):
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


def wait_ready(port, timeout=600, path="/health/ready"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).status == 200:
                return
        except Exception:
            pass
        time.sleep(0.5)
    raise SystemExit(f"port {port} never became ready")


def edge(procs, verifier_port, rtt, flags, out, name):
    """A gateway on the edge core (one compute thread) behind its own delay proxy at `rtt` ms to the
    verifier; its processes join `procs`. Returns the gateway's port (not yet ready)."""
    pport, gport = free_port(), free_port()
    procs.append(spawn([BIN / "spade-delay-proxy", "--listen", f"127.0.0.1:{pport}", "--upstream",
                        f"127.0.0.1:{verifier_port}", "--rtt-ms", str(rtt)], out / f"proxy-{name}-{rtt}.log"))
    procs.append(spawn(["taskset", "-c", "1", BIN / "spade-gateway", "--draft-model", DRAFT, "--verifier-url",
                        f"http://127.0.0.1:{pport}", "--port", str(gport), "--log", "warn",
                        "--verify-timeout-secs", "600", *flags],
                       out / f"gateway-{name}-{rtt}.log", {"RAYON_NUM_THREADS": "1"}))
    return gport


def post(port, path, body):
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"content-type": "application/json"})
    started = time.monotonic()
    answer = json.load(urllib.request.urlopen(request, timeout=3600))
    return answer, time.monotonic() - started


def edit_request(path, rename, with_prediction):
    source = (ROOT / path).read_text()
    lang = {".py": "python", ".rs": "rust"}.get(Path(path).suffix, "")
    old, new = rename.split(":")
    ask = (f"Rename the function {old} to {new} everywhere in this file. Reply with the whole file "
           f"in one ```{lang} block, nothing else.\n\n```{lang}\n{source}```")
    body = {"messages": [{"role": "user", "content": ask}], "temperature": 0, "max_tokens": 3000}
    if with_prediction:
        body["prediction"] = {"type": "content", "content": f"```{lang}\n{source}```"}
    return body


def fim_cuts(n):
    files = sorted(p for p in ROOT.glob("**/*") if p.suffix in (".py", ".rs") and "target" not in p.parts
                   and "patched" not in p.parts and p.stat().st_size > 2000)
    rng = random.Random(48)
    cuts = []
    for path in rng.sample(files, n):
        text = path.read_text()
        lines = text.splitlines(keepends=True)
        at = rng.randrange(len(lines) // 4, 3 * len(lines) // 4)
        column = rng.randrange(0, max(1, len(lines[at].rstrip("\n"))))
        cut = sum(len(l) for l in lines[:at]) + column
        # ~40 lines before and ~12 after, a window like an editor plugin's (one CPU core prefills it).
        cuts.append((str(path.relative_to(ROOT)), text[max(0, cut - 1500):cut], text[cut:cut + 500]))
    return cuts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtts", default="0,50")
    parser.add_argument("--edit-rtts", default=None, help="RTTs of the edit task (default: all of --rtts)")
    parser.add_argument("--edit-file", default="delay-proxy/src/link.rs", help="the file asked back (from the repository root)")
    parser.add_argument("--rename", default="deliver_at:delivery_time", help="OLD:NEW, the function renamed")
    parser.add_argument("--fim-cuts", type=int, default=6)
    parser.add_argument("--out", default=str(ROOT / f"bench/results/coding-{time.strftime('%Y%m%d-%H%M')}"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        vport = free_port()
        procs.append(spawn(["taskset", "-c", "0", BIN / "spade-verifier", "--model", TARGET, "--port", str(vport),
                            "--threads", "1", "--log", "warn"], out / "verifier.log"))
        wait_ready(vport)
        pass_ms = json.load(urllib.request.urlopen(f"http://127.0.0.1:{vport}/v1/info"))["pass_ms"]
        results = {"pass_ms": pass_ms, "edit": {}, "fim": {}}
        cuts = fim_cuts(args.fim_cuts)
        for rtt in [int(r) for r in args.rtts.split(",")]:
            gateways = {}
            for mode, flags in MODES.items():
                gateways[mode] = edge(procs, vport, rtt, flags, out, mode)
            for port in gateways.values():
                wait_ready(port)
            edits = {}
            edit_rtts = args.edit_rtts if args.edit_rtts is not None else args.rtts
            for mode, port in gateways.items() if str(rtt) in edit_rtts.split(",") else []:
                request = edit_request(args.edit_file, args.rename, mode == "prediction")
                # The prompt once through this gateway first: every mode then starts with it cached on
                # the verifier and on its edge, so the times compare decoding, not who prefilled first.
                post(port, "/v1/chat/completions", {**request, "max_tokens": 1})
                answer, secs = post(port, "/v1/chat/completions", request)
                usage = answer["usage"]
                edits[mode] = {"text": answer["choices"][0]["message"]["content"], "seconds": secs,
                               "tokens": usage["completion_tokens"], "tokens_per_s": usage["completion_tokens"] / secs,
                               "verify_calls": usage["spade"]["verify_calls"], "details": usage["completion_tokens_details"],
                               "looked_up": [usage["spade"]["looked_up_accepted"], usage["spade"]["looked_up"]],
                               "drafted": [usage["spade"]["draft_accepted"], usage["spade"]["drafted"]]}
                same = edits[mode]["text"] == edits["target-only"]["text"]
                print(f"rtt {rtt} edit {mode}: {edits[mode]['tokens']} tokens in {secs:.1f} s, {edits[mode]['verify_calls']} calls, identical {same}", flush=True)
            if edits:
                results["edit"][rtt] = edits
            fims = {mode: [] for mode in ("target-only", "default", "lookup")} if cuts else {}
            for path, prefix, suffix in cuts:
                for mode in fims:
                    body = {"prompt": prefix, "suffix": suffix, "max_tokens": 32, "temperature": 0}
                    answer, secs = post(gateways[mode], "/v1/completions", body)
                    fims[mode].append({"file": path, "text": answer["choices"][0]["text"], "seconds": secs,
                                       "tokens": answer["usage"]["completion_tokens"],
                                       "verify_calls": answer["usage"]["spade"]["verify_calls"]})
            if fims:
                results["fim"][rtt] = fims
                print(f"rtt {rtt} fim: " + ", ".join(f"{m} {sum(r['seconds'] for r in v):.1f} s" for m, v in fims.items()), flush=True)
            for p in procs[1:]:
                p.terminate()
            procs = procs[:1]
        (out / "results.json").write_text(json.dumps(results, indent=1))
        report(results, out, args.edit_file)
    finally:
        for p in procs:
            p.terminate()


def report(results, out, edit_file):
    one_row, more = results["pass_ms"][0], statistics.median(b - a for a, b in zip(results["pass_ms"], results["pass_ms"][1:]))
    lines = [f"# Coding workload ({time.strftime('%Y-%m-%d %H:%M')} UTC)", "",
             f"Verifier pass: {one_row:.0f} ms for one row, {more:.0f} ms per further row (`pass_ms`); a block of k rows "
             f"that commits all k+1 tokens is then at most (k+1)·{one_row:.0f}/({one_row:.0f}+k·{more:.0f}) times target-only "
             f"per call: the bound at RTT 0 as k grows is {one_row / more:.2f}x.", "",
             f"## Edit task ({edit_file} back whole, one function renamed)", "",
             "| RTT | mode | tokens | s | tokens/s | x target-only | verify calls | prediction kept / rejected | lookup accepted / proposed | identical |",
             "|---:|---|---:|---:|---:|---:|---:|---|---|---|"]
    for rtt, edits in results["edit"].items():
        base = edits["target-only"]
        for mode, e in edits.items():
            d = e["details"]
            lines.append(f"| {rtt} | {mode} | {e['tokens']} | {e['seconds']:.1f} | {e['tokens_per_s']:.2f} | "
                         f"{e['tokens_per_s'] / base['tokens_per_s']:.2f} | {e['verify_calls']} | "
                         f"{d['accepted_prediction_tokens']} / {d['rejected_prediction_tokens']} | "
                         f"{e['looked_up'][0]} / {e['looked_up'][1]} | {e['text'] == base['text']} |")
    lines += ["", "## Fill-in-the-middle at random cut points (32 tokens, /v1/completions with suffix)", "",
              "| RTT | mode | total s | x target-only | x default | verify calls | identical to target-only |", "|---:|---|---:|---:|---:|---:|---|"]
    for rtt, fims in results["fim"].items():
        total = {m: sum(r["seconds"] for r in v) for m, v in fims.items()}
        for mode, runs in fims.items():
            same = sum(r["text"] == b["text"] for r, b in zip(runs, fims["target-only"]))
            lines.append(f"| {rtt} | {mode} | {total[mode]:.1f} | {total['target-only'] / total[mode]:.2f} | "
                         f"{total['default'] / total[mode]:.2f} | {sum(r['verify_calls'] for r in runs)} | {same} of {len(runs)} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
