#!/usr/bin/env python3
"""Acceptance traces for core/examples/draft_control_sim.rs, from gateway logs of `--draft-len 1`.

    python3 scripts/acceptance-trace.py GATEWAY_LOG... > trace.txt

Run the gateway with `--draft-len 1 --draft-ahead true` and `--log info,spade_engine=debug` (the
benchmark: `SPADE_GATEWAY_LOG=info,spade_engine=debug bash scripts/bench.sh --draft-lens 1 ...`).
Its per-round lines show every output position's verdict under greedy decoding: the drafted token
(`accepted`), then, when it was accepted, the guess of the token after it (`guess_matched`). Each
generation (from its prompt's call, `drafted=0`) becomes one line of 1 (the draft's token is the
target's) and 0.
"""
import re
import sys


def generations(lines):
    trace = None
    for line in lines:
        if " round " not in line and not line.rstrip().endswith(" round"):
            continue
        f = dict(re.findall(r"(\w+)=(\S+)", line))
        if "drafted" not in f:
            continue
        drafted, accepted, guess = int(f["drafted"]), int(f["accepted"]), f.get("guess_matched")
        if drafted == 0 and guess is None:
            continue  # the last token of a generation, committed without a draft
        if drafted == 0:
            if trace:
                yield trace
            # The prompt's call: the draft guessed its token while it ran.
            trace = ["1" if guess == "true" else "0"]
            continue
        if drafted != 1 or trace is None:
            sys.exit(f"not a --draft-len 1 log (a block of {drafted}): {line.strip()}")
        trace.append("1" if accepted == 1 else "0")
        if accepted == 1:
            if guess not in ("true", "false"):
                continue  # the generation ended here
            trace.append("1" if guess == "true" else "0")
    if trace:
        yield trace


for path in sys.argv[1:]:
    with open(path) as log:
        for trace in generations(log):
            print("".join(trace))
