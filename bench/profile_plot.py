#!/usr/bin/env python3
"""Draw one training step's timeline from a `strider finetune --trace` file.

    python bench/profile_plot.py TRACE.json --step N --out step.png \
        [--metrics m.jsonl] [--params P --tokens T]

Lanes are rows (compute, h2d, d2h, optimizer, nvme read, nvme write, collective, hand-off); each span
is a bar colored by its kind (the first word of its name) with the block number
written on it where it fits. Prints, per lane, the busy time and busy fraction,
then the critical lane, the overlap efficiency (busiest lane / step time) and
the model FLOP/s, and ends with ONE JSON line holding the same figures.

The step's window (the trace does not record where Engine::step began and
ended, so it is rebuilt from the spans):
  begin = earliest start, end = latest finish, of the spans whose args.step == N
  on the compute, h2d and d2h lanes -- the work Engine::step waits for.
The optimizer and NVMe lanes do not define the window: the update of step N-1
(adamw, and the NVMe reads/writes of its state, all tagged step N-1) runs
inside step N's window, and step N's own update runs after it. Every span of
any step that overlaps the window is clipped to it and counted; busy time is
the union of the clipped spans, so overlapping spans on one lane count once.
This is the rule Timeline::stats applies to [t0, t1] of Engine::step; our
window starts at the first span rather than at the call, so the step time
printed here can be slightly shorter than the step_s the engine reports
(--metrics prints the engine's figures beside ours).

Compute FLOPs are pro-rated when a span is clipped, like Timeline::stats.
"""
import argparse
import json
import sys

LANES = ["compute", "h2d", "d2h", "optimizer", "nvme read", "nvme write", "collective", "hand-off"]
WINDOW_LANES = (0, 1, 2)  # compute, h2d, d2h


def load_spans(path):
    """The 'X' events of a Chrome trace as dicts: lane, name, kind, begin_us, end_us, args."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"profile_plot: cannot read trace {path}: {e} "
                         "(write one with `strider finetune --trace FILE`)")
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    spans = []
    for e in events:
        if e.get("ph") != "X":
            continue
        lane = int(e.get("tid", 0))
        if not 0 <= lane < len(LANES):
            continue
        b = float(e["ts"])
        spans.append({"lane": lane, "name": e.get("name", ""), "kind": e.get("name", "?").split(" ")[0],
                      "begin_us": b, "end_us": b + float(e.get("dur", 0.0)), "args": e.get("args", {})})
    return spans


def step_window(spans, step):
    """[begin_us, end_us] of `step` under the rule in the module docstring."""
    own = [s for s in spans if s["args"].get("step") == step and s["lane"] in WINDOW_LANES]
    if not own:
        steps = sorted({s["args"].get("step") for s in spans if s["lane"] in WINDOW_LANES
                        and s["args"].get("step") is not None})
        raise SystemExit(f"profile_plot: no compute/h2d/d2h span has args.step == {step}; "
                         f"steps in this trace: {steps}")
    return min(s["begin_us"] for s in own), max(s["end_us"] for s in own)


def union_us(intervals):
    """Total length of the union of [b, e) intervals: overlapping spans count once."""
    busy, cur_b, cur_e = 0.0, None, None
    for b, e in sorted(intervals):
        if cur_e is None or b > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_b
            cur_b, cur_e = b, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_b
    return busy


def step_stats(spans, step, params=None, tokens=None):
    """Figures of one step; times in seconds."""
    begin, end = step_window(spans, step)
    step_s = (end - begin) * 1e-6
    per_lane = [[] for _ in LANES]
    clipped = []
    flops = 0.0
    for s in spans:
        b, e = max(s["begin_us"], begin), min(s["end_us"], end)
        if e <= b:
            continue
        per_lane[s["lane"]].append((b, e))
        clipped.append(dict(s, begin_us=b, end_us=e))
        f = float(s["args"].get("flops", 0) or 0)
        if s["lane"] == 0 and f and s["end_us"] > s["begin_us"]:
            flops += f * (e - b) / (s["end_us"] - s["begin_us"])
    lanes = {}
    for i, name in enumerate(LANES):
        busy_s = union_us(per_lane[i]) * 1e-6
        lanes[name] = {"busy_s": busy_s, "busy_fraction": busy_s / step_s if step_s > 0 else 0.0}
    critical = max(LANES, key=lambda n: lanes[n]["busy_s"])
    out = {"step": step, "begin_us": begin, "end_us": end, "step_s": step_s, "lanes": lanes,
           "critical": critical,
           "overlap_efficiency": lanes[critical]["busy_s"] / step_s if step_s > 0 else 0.0,
           "compute_flops": flops, "model_flops_per_s": flops / step_s if step_s > 0 else 0.0,
           "spans": clipped}
    if params and tokens:
        out["six_n_t_flops_per_s"] = 6.0 * params * tokens / step_s if step_s > 0 else 0.0
    return out


def engine_metrics(path, step):
    """The engine's own line for `step` from a --metrics JSONL file, or None."""
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    rec = json.loads(line)
                    if rec.get("step") == step:
                        return rec
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"profile_plot: cannot read metrics {path}: {e}")
    return None


def plot(st, out_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    begin, step_s = st["begin_us"], st["step_s"]
    span_ms = max(step_s * 1e3, 1e-9)
    kinds = sorted({s["kind"] for s in st["spans"]})
    cmap = plt.get_cmap("tab10" if len(kinds) <= 10 else "tab20")
    color = {k: cmap(i % cmap.N) for i, k in enumerate(kinds)}

    fig, ax = plt.subplots(figsize=(16, 4.8))
    width_px = fig.get_figwidth() * fig.dpi * 0.8  # axes width, roughly
    for s in st["spans"]:
        row = s["lane"]
        x = (s["begin_us"] - begin) * 1e-3
        w = (s["end_us"] - s["begin_us"]) * 1e-3
        other_step = s["args"].get("step") != st["step"]
        wide = w / span_ms * width_px > 3  # an outline on a sliver would hide its color
        ax.barh(row, w, left=x, height=0.7, color=color[s["kind"]], edgecolor="black",
                linewidth=0.3 if wide else 0,
                alpha=0.55 if other_step else 1.0, hatch="//" if other_step else None)
        block = s["args"].get("block", -1)
        label = f"b{block}" if block is not None and block >= 0 else ""
        # ~7 px per character at fontsize 7: write the block only where it fits.
        if label and w / span_ms * width_px > 7 * len(label) + 2:
            ax.text(x + w / 2, row, label, ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_yticks(range(len(LANES)))
    ax.set_yticklabels([f"{n}  {st['lanes'][n]['busy_fraction'] * 100:.0f}%" for n in LANES])
    ax.invert_yaxis()
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("ms since the step's first span")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    title = (f"step {st['step']}: {step_s * 1e3:.1f} ms | critical: {st['critical']} | "
             f"overlap efficiency {st['overlap_efficiency']:.2f}")
    if st["model_flops_per_s"]:
        title += f" | {st['model_flops_per_s'] / 1e9:.2f} GFLOP/s"
    ax.set_title(title)
    handles = [Patch(facecolor=color[k], edgecolor="black", label=k) for k in kinds]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="other step"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="Chrome trace JSON from `strider finetune --trace`")
    ap.add_argument("--step", type=int, required=True, help="the step to draw (args.step of its spans)")
    ap.add_argument("--out", help="PNG to write (none: print the figures only)")
    ap.add_argument("--metrics", help="JSONL from `strider finetune --metrics`: print the engine's figures too")
    ap.add_argument("--params", type=float, help="model parameters N, for the 6*N*tokens FLOP/s convention")
    ap.add_argument("--tokens", type=float, help="tokens per step, for the 6*N*tokens FLOP/s convention")
    a = ap.parse_args(argv)

    st = step_stats(load_spans(a.trace), a.step, a.params, a.tokens)
    eng = engine_metrics(a.metrics, a.step) if a.metrics else None
    print(f"step {a.step}: window {st['step_s'] * 1e3:.3f} ms")
    for n in LANES:
        line = f"  {n:<10} busy {st['lanes'][n]['busy_s'] * 1e3:9.3f} ms  {st['lanes'][n]['busy_fraction']:6.1%}"
        if eng is not None and n in eng.get("lanes", {}):
            line += f"   (engine {eng['lanes'][n]:6.1%})"
        print(line)
    print(f"  critical lane: {st['critical']}")
    print(f"  overlap efficiency: {st['overlap_efficiency']:.3f}")
    print(f"  model FLOP/s (compute spans): {st['model_flops_per_s'] / 1e9:.3f} GFLOP/s "
          f"({st['compute_flops'] / 1e9:.3f} GFLOP)")
    if "six_n_t_flops_per_s" in st:
        print(f"  model FLOP/s (6*N*tokens): {st['six_n_t_flops_per_s'] / 1e9:.3f} GFLOP/s")
    if eng is not None:
        print(f"  engine: step_s {eng.get('step_s', float('nan')) * 1e3:.3f} ms, "
              f"overlap efficiency {eng.get('overlap_efficiency', float('nan')):.3f}")
    elif a.metrics:
        print(f"  engine: no line for step {a.step} in {a.metrics}")
    if a.out:
        try:
            plot(st, a.out)
        except ImportError as e:
            raise SystemExit(f"profile_plot: matplotlib is needed for --out ({e}); "
                             "install it with `.venv/bin/pip install -r requirements.txt`")
        print(f"  png: {a.out}")
    summary = {k: v for k, v in st.items() if k != "spans"}
    summary["png"] = a.out
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
