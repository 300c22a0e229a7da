#!/usr/bin/env python3
"""Plot a spade-bench run: calls saved and tokens/s against draft length, one line per RTT.

    python3 bench/plot.py RESULTS_DIR      # reads RESULTS_DIR/results.json, writes RESULTS_DIR/plot.png

Left: target (cloud) calls saved vs target-only, greedy and sampled, from the accounting runs.
Middle: end-to-end tokens/s on the long prompts (median over repetitions, bars from min to max)
through the emulated link, one line per RTT; draft length 0 is target-only; a dashed line of the same
colour is `auto` at that RTT, a hollow marker a draft length without draft-ahead; the dotted grey line
is the draft model alone.
Right: the drift case (RTT changing mid-run), tokens/s per mode.
"""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: write the file only
import matplotlib.pyplot as plt  # noqa: E402


def draft_len(mode):
    """Draft length on the x axis: target-only is 0, draft-only has none."""
    if mode == "target_only":
        return 0
    if isinstance(mode, dict) and "speculative" in mode:
        return mode["speculative"]
    return None


def points(rows, value):
    """(x, y) pairs sorted by draft length, for rows with a draft length and a value."""
    pts = [(draft_len(r["mode"]), value(r)) for r in rows]
    return sorted((x, y) for x, y in pts if x is not None and y is not None)


def main(folder):
    folder = Path(folder)
    run = json.loads((folder / "results.json").read_text())
    summary = run["summary"]
    fig, (calls_ax, speed_ax, drift_ax) = plt.subplots(1, 3, figsize=(17, 4.8))

    for rows, label, style in ((summary["greedy"], "greedy (T=0)", "o-"), (summary["sampled"], f"sampled (T={run['plan']['temperature']})", "s--")):
        pts = points(rows, lambda r: None if r["calls_saved"] is None else 100 * r["calls_saved"])
        if pts:
            calls_ax.plot(*zip(*pts), style, label=label)
    calls_ax.set_xlabel("draft length (0 = target-only)")
    calls_ax.set_ylabel("target calls saved vs target-only (%)")
    calls_ax.set_ylim(0, 100)
    calls_ax.grid(alpha=0.3)
    calls_ax.legend()
    calls_ax.set_title("Cloud calls saved")

    speed = summary.get("speed", [])
    for rtt in run["plan"]["rtts_ms"]:
        rows = [r for r in speed if r["rtt_ms"] == rtt and r.get("tokens_per_s")]
        pts = points(rows, lambda r: r["tokens_per_s"])
        if not pts:
            continue
        xs = [x for x, _ in pts]
        med = [s["median"] for _, s in pts]
        err = [[s["median"] - s["min"] for _, s in pts], [s["max"] - s["median"] for _, s in pts]]
        line = speed_ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=f"RTT {rtt} ms")
        colour = line[0].get_color()
        for r in rows:
            if r["mode"] == "auto":
                speed_ax.axhline(r["tokens_per_s"]["median"], color=colour, linestyle="--", linewidth=1)
            elif isinstance(r["mode"], dict) and "no_ahead" in r["mode"]:
                speed_ax.plot([r["mode"]["no_ahead"]], [r["tokens_per_s"]["median"]], "o", mfc="none", color=colour)
    draft_only = [r for r in speed if r["mode"] == "draft_only" and r.get("tokens_per_s")]
    if draft_only:
        speed_ax.axhline(draft_only[0]["tokens_per_s"]["median"], color="grey", linestyle=":", label="draft model alone")
    speed_ax.set_xlabel("draft length (0 = target-only)")
    speed_ax.set_ylabel("end-to-end tokens/s (median, min–max)")
    speed_ax.set_ylim(bottom=0)
    speed_ax.grid(alpha=0.3)
    speed_ax.legend()
    speed_ax.set_title("Long prompts through an emulated link (greedy; dashed: auto)")

    drift = [r for r in summary.get("drift", []) if r.get("tokens_per_s")]
    if drift:
        labels = [r["label"].replace("speculative ", "") for r in drift]
        med = [r["tokens_per_s"]["median"] for r in drift]
        err = [[r["tokens_per_s"]["median"] - r["tokens_per_s"]["min"] for r in drift], [r["tokens_per_s"]["max"] - r["tokens_per_s"]["median"] for r in drift]]
        drift_ax.bar(range(len(drift)), med, yerr=err, capsize=3, color=["tab:red" if r["mode"] == "auto" else "tab:blue" for r in drift])
        drift_ax.set_xticks(range(len(drift)), labels, rotation=20, ha="right")
        d = run["plan"].get("drift") or {}
        drift_ax.set_title(f"Drift: RTT {d.get('from_ms')} → {d.get('to_ms')} ms mid-output")
    else:
        drift_ax.set_title("Drift: not run")
    drift_ax.set_ylabel("end-to-end tokens/s (median, min–max)")
    drift_ax.grid(alpha=0.3, axis="y")

    machine = run["machine"]
    fig.suptitle(f"SPADE, {Path(run['models']['draft']).name} drafting for {Path(run['models']['target']).name}, "
                 f"{machine['cpus']} CPUs ({machine['cpu_model']}), {run['stamp']}", fontsize=10)
    fig.tight_layout()
    out = folder / "plot.png"
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
