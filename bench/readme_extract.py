"""The figures each command of bench/readme_figures.sh prints, for bench/readme_figures.py: the
commands' names by part (PARTS) and how each part's figures are read from its commands' logs (EXTRACT,
given a Logs and a Figures of readme_figures.py). What --check holds is what the blocks quote.
"""
import re
import statistics

from figure_blocks import blocks

GIB = float(1 << 30)
MIB = float(1 << 20)


# ---- the commands and the figures each one prints -------------------------------------
# PARTS: part -> command names, as bench/readme_figures.sh runs them.

PLAN_8B = {8: "plan-8b-b8", 16: "plan-8b-b16", 32: "plan-8b-b32", 64: "plan-8b-b64"}
# The same 8B runs in fp16 (loss scaling), with fp32 and with fp16 accumulation in the GEMMs.
PLAN_PRECISION = {(prec, b): f"plan-8b-b{b}-{prec}" for prec in ("fp16", "fp16acc") for b in PLAN_8B}
PLAN_NVME = {  # (model tag, clip tag) -> command name
    ("70b", "clip1"): "plan-70b-nvme", ("70b", "clip0"): "plan-70b-nvme-clip0",
    ("123b", "clip1"): "plan-123b-nvme", ("123b", "clip0"): "plan-123b-nvme-clip0"}
PLAN_REFUSED = {"70b": "plan-70b-ram-only", "123b": "plan-123b-ram-only"}
PLAN_Q8 = {"8b": "plan-8b-q8", "70b": "plan-70b-nvme-q8"}  # the q8 optimizer-state format
PLAN_LORA = {("8b", "lora"): "plan-8b-lora", ("8b", "full"): "plan-8b-full-128",  # batch 16, 128 / 256 GiB
             ("70b", "lora"): "plan-70b-lora", ("70b", "full"): "plan-70b-full-b16",
             ("8b", "lora-nf4"): "plan-8b-lora-nf4", ("70b", "lora-nf4"): "plan-70b-lora-nf4-128"}  # 128 GiB
PLAN_LORA_REFUSED = "plan-70b-lora-128"
# The predict scripts' blocks, each printed whole (figure_blocks.marked) by the command of the same name.
PREDICT_BLOCKS = ("predict-dp", "predict-pool", "predict-past-ram")

PARTS = {
    "plan": list(PLAN_8B.values()) + ["plan-8b-b8-clip0"] + list(PLAN_PRECISION.values()) + list(PLAN_NVME.values()) + list(PLAN_REFUSED.values()) +
            list(PLAN_Q8.values()) + list(PLAN_LORA.values()) + [PLAN_LORA_REFUSED],
    "predict": list(PREDICT_BLOCKS),
    "profile": ["profile"],
    "demo": ["demo"],
    "step": ["bench_step"],
    "torch": ["bench_vs_torch"],
    "calibrate": ["bench_calibrate"],
    "adam": ["bench_adam"],
    "nvme": ["bench_nvme", "bench_nvme_extents"],
}


def plan_figures(logs, f):
    for (prec, batch), cmd in PLAN_PRECISION.items():
        j = logs.last_json(cmd, "step_s")
        if not j or j.get("step_s") is None:
            continue
        p = f"predict.8b.b{batch}.{prec}"
        f.put(f"{p}.tokens_per_s", j["tokens_per_s"], cmd)
        f.put(f"{p}.critical_lane", j["critical_lane"], cmd)
    for batch, cmd in PLAN_8B.items():
        j = logs.last_json(cmd, "step_s")
        if not j or j.get("step_s") is None:
            continue
        p = f"predict.8b.b{batch}"
        f.put(f"{p}.tokens_per_s", j["tokens_per_s"], cmd)
        f.put(f"{p}.lower_bound_s", j["lower_bound_s"], cmd)
        tokens = j["tokens_per_s"] * j["step_s"]  # per step: batch x seq
        f.put(f"{p}.bound_tokens_per_s", tokens / j["lower_bound_s"], cmd)
        f.put(f"{p}.overlap_efficiency", j["overlap_efficiency"], cmd)
        f.put(f"{p}.critical_lane", j["critical_lane"], cmd)
        # The plan's choice of kept activations (--activations auto).
        if "saved_layers" in j:
            f.put(f"{p}.saved_layers", j["saved_layers"], cmd)
            f.put(f"{p}.saved_host_gib", j["saved_host_bytes"] / GIB, cmd)
            f.put(f"{p}.host_gib", j["host_pinned_bytes"] / GIB, cmd)
            m = next((re.search(r"(\d+) layers", w) for w in j.get("why", []) if "blocks:" in w), None)
            if m:
                f.put("predict.8b.layers", int(m.group(1)), cmd)
        if batch == 8:
            f.put(f"{p}.optimizer_s", j["lane_busy_s"]["optimizer"], cmd)
            f.put(f"{p}.host_gib", j["host_pinned_bytes"] / GIB, cmd)
            f.put("predict.8b.unit_gib", j["unit_bytes"] / GIB, cmd)
            f.put("predict.8b.vocab_shards", j["vocab_shards"], cmd)
            m = next((re.search(r"\((\d+) parameters", w) for w in j.get("why", []) if "cache units" in w), None)
            if m:
                f.put("predict.8b.unit_params", int(m.group(1)), cmd)
    cmd = "plan-8b-b8-clip0"
    j = logs.last_json(cmd, "step_s")
    if j and j.get("step_s") is not None:
        f.put("predict.8b.b8.clip0.tokens_per_s", j["tokens_per_s"], cmd)
        f.put("predict.8b.b8.clip0.overlap_efficiency", j["overlap_efficiency"], cmd)
        f.put("predict.8b.b8.clip0.host_gib", j["host_pinned_bytes"] / GIB, cmd)
    for (model, clip), cmd in PLAN_NVME.items():
        j = logs.last_json(cmd, "step_s")
        if not j or j.get("step_s") is None:
            continue
        p = f"predict.{model}.nvme.{clip}"
        f.put(f"{p}.tokens_per_s", j["tokens_per_s"], cmd)
        f.put(f"{p}.step_s", j["step_s"], cmd)
        f.put(f"{p}.overlap_efficiency", j["overlap_efficiency"], cmd)
        if clip == "clip1":
            f.put(f"{p}.lower_bound_s", j["lower_bound_s"], cmd)
            f.put(f"{p}.critical_lane", j["critical_lane"], cmd)
            f.put(f"{p}.nvme_write_s", j["lane_busy_s"]["nvme write"], cmd)
            f.put(f"{p}.nvme_blocks", len(j["nvme_blocks"]), cmd)
            m = re.match(r"(\d+) blocks", (j.get("why") or [""])[0])
            if m:
                f.put(f"{p}.blocks", int(m.group(1)), cmd)
            f.put(f"{p}.host_gib", j["host_pinned_bytes"] / GIB, cmd)
            f.put(f"{p}.nvme_gib", j["nvme_bytes"] / GIB, cmd)
    for model, cmd in PLAN_Q8.items():
        j = logs.last_json(cmd, "step_s")
        if not j or j.get("step_s") is None:
            continue
        m = re.search(r"([\d.]+)B parameters", j.get("model", ""))
        params = float(m.group(1)) * 1e9 if m else None
        p = f"predict.{model}.q8"
        f.put(f"{p}.tokens_per_s", j["tokens_per_s"], cmd)
        f.put(f"{p}.critical_lane", j["critical_lane"], cmd)
        f.put(f"{p}.host_gib", j["host_bytes"] / GIB, cmd)
        f.put(f"{p}.nvme_blocks", len(j["nvme_blocks"]), cmd)
        f.put(f"{p}.nvme_write_s", j["lane_busy_s"]["nvme write"], cmd)
        fp32 = next((o for o in j.get("other_formats", []) if o["optimizer_state"] == "fp32"), None)
        if params:
            f.put(f"{p}.host_bytes_per_param", j["host_bytes"] / params, cmd)
            if fp32:
                f.put(f"{p}.fp32_host_bytes_per_param", fp32["host_bytes"] / params, cmd)
        if fp32:
            f.put(f"{p}.fp32_nvme_blocks", fp32["nvme_blocks"], cmd)
    for (model, kind), cmd in PLAN_LORA.items():
        j = logs.last_json(cmd, "step_s")
        if not j or j.get("step_s") is None:
            continue
        p = f"predict.{model}.{kind}"
        f.put(f"{p}.tokens_per_s", j["tokens_per_s"], cmd)
        f.put(f"{p}.step_s", j["step_s"], cmd)
        f.put(f"{p}.host_gib", j["host_pinned_bytes"] / GIB, cmd)
        f.put(f"{p}.saved_host_gib", j.get("saved_host_bytes", 0) / GIB, cmd)
        f.put(f"{p}.unit_gib", j["unit_bytes"] / GIB, cmd)
        f.put(f"{p}.nvme_gib", j["nvme_bytes"] / GIB, cmd)
    j = logs.last_json(PLAN_LORA_REFUSED, "feasible")
    if j and j.get("feasible") is False:
        m = re.search(r"needs ([\d.]+) GiB of pinned host RAM, ([\d.]+) GiB of it the frozen base", j.get("reason", ""))
        if m:
            f.put("refused.70b.lora.ram_needed_gib", float(m.group(1)), PLAN_LORA_REFUSED)
            f.put("refused.70b.lora.base_gib", float(m.group(2)), PLAN_LORA_REFUSED)
    for model, cmd in PLAN_REFUSED.items():
        j = logs.last_json(cmd, "feasible")
        # A refusal is the figure: infeasible, with the RAM it needs in its reason.
        if j and j.get("feasible") is False:
            m = re.search(r"needs ([\d.]+) GiB of pinned host RAM", j.get("reason", ""))
            if m:
                f.put(f"refused.{model}.ram_needed_gib", float(m.group(1)), cmd)


def predict_figures(logs, f):
    for name in PREDICT_BLOCKS:
        f.put(f"block.{name}", blocks(logs.text(name) or "").get(name, "").strip("\n") or None, name)


def profile_figures(logs, f):
    j = logs.last_json("profile", "command")
    if not j:
        return
    c = "profile"
    f.put("profile.step_s", j["step_s"], c)
    for lane in ("compute", "h2d", "d2h", "optimizer"):
        f.put(f"profile.{lane}_pct", 100 * j["lanes"][lane]["busy_fraction"], c)
    f.put("profile.critical_lane", j["critical_lane"], c)
    f.put("profile.overlap_efficiency", j["overlap_efficiency"], c)
    f.put("profile.model_gflops", j["model_flops_per_s"] / 1e9, c)
    f.put("profile.executed_gflops", j["executed_flops_per_s"] / 1e9, c)
    f.put("profile.params", j["params"], c)


def demo_text_figures(text):
    """The demo's figures that `strider finetune` prints only as text."""
    pats = {
        "demo.eval_loss_before": (r"eval loss before training: ([\d.]+)", float),
        "demo.device_budget_mib": (r"^\s*device: .* of ([\d.]+) MiB$", float),
        "demo.window": (r"window K = (\d+)", int),
        "demo.blocks": (r"^\s*(\d+) blocks:", int),
    }
    out = {}
    for name, (pat, conv) in pats.items():
        m = re.search(pat, text, re.M)
        if m:
            out[name] = conv(m.group(1))
    return out


def demo_figures(logs, f):
    c = "demo"
    text = logs.text(c)
    if text is None:
        return
    for name, v in demo_text_figures(text).items():
        f.put(name, v, c)
    steps = logs.json_lines("demo-metrics.jsonl")
    if not steps:
        return
    f.put("demo.steps", len(steps), c)
    f.put("demo.train_loss_first", steps[0]["loss"], c)
    f.put("demo.train_loss_last", steps[-1]["loss"], c)
    evals = [s["eval_loss"] for s in steps if "eval_loss" in s]
    if evals:
        f.put("demo.eval_loss_last", evals[-1], c)
    tps = [s["tokens_per_s"] for s in steps]
    f.put("demo.tokens_per_s_min", min(tps), c)
    f.put("demo.tokens_per_s_median", statistics.median(tps), c)
    f.put("demo.tokens_per_s_max", max(tps), c)
    f.put("demo.peak_device_mib", max(s["peak_device_bytes"] for s in steps) / MIB, c)
    if c in logs.commands:
        f.put("demo.wall_s", logs.commands[c]["wall_s"], c)


def step_figures(logs, f):
    c = "bench_step"
    j = logs.last_json(c, "bench")
    if not j:
        return
    f.put("step.offload_over_resident", j["offload_over_resident"], c)
    f.put("step.overlap_efficiency", j["overlap_efficiency"], c)
    f.put("step.critical_lane", j["critical_lane"], c)


def calibrate_figures(logs, f):
    c = "bench_calibrate"
    j = logs.last_json(c, "bench")
    if not j:
        return
    ratios = [x["ratio"] for x in j["configs"]]
    f.put("calibrate.ratio", j["ratio"], c)
    f.put("calibrate.ratio_min", min(ratios), c)
    f.put("calibrate.ratio_max", max(ratios), c)
    f.put("calibrate.accumulations", [x["accumulation"] for x in j["configs"]], c)


def adam_figures(logs, f):
    c = "bench_adam"
    j = logs.last_json(c, "bench")
    if not j:
        return
    runs = j["runs"]
    f.put("adam.isa", j["isa"], c)
    f.put("adam.roofline_ratio_min", j["roofline_ratio"], c)
    f.put("adam.roofline_ratio_max", max(r["roofline_ratio"] for r in runs), c)
    f.put("adam.vs_torch_min", j["vs_torch"], c)
    f.put("adam.vs_torch_max", max(r["vs_torch"] for r in runs), c)
    f.put("adam.q8_mparams_min", min(r["q8_params_per_s"] for r in runs) / 1e6, c)
    f.put("adam.q8_mparams_max", max(r["q8_params_per_s"] for r in runs) / 1e6, c)
    f.put("adam.fp32_mparams_min", min(r["ours_params_per_s"] for r in runs) / 1e6, c)
    f.put("adam.fp32_mparams_max", max(r["ours_params_per_s"] for r in runs) / 1e6, c)
    f.put("adam.q8_roofline_min", j["q8_roofline_ratio"], c)
    f.put("adam.q8_roofline_max", max(r["q8_roofline_ratio"] for r in runs), c)
    f.put("adam.q8_speedup_min", j["q8_speedup"], c)
    f.put("adam.q8_speedup_max", max(r["q8_speedup"] for r in runs), c)
    f.put("adam.q8_loops_mparams_min", min(r["q8_loops_params_per_s"] for r in runs) / 1e6, c)
    f.put("adam.q8_loops_mparams_max", max(r["q8_loops_params_per_s"] for r in runs) / 1e6, c)
    f.put("adam.params_m", sorted({round(r["params"] / 1e6) for r in runs}), c)
    f.put("adam.threads", sorted({r["threads"] for r in runs}), c)
    if "deepspeed" in j:
        f.put("adam.deepspeed", j["deepspeed"], c)
        f.put("adam.vs_deepspeed_min", j["vs_deepspeed"], c)
        f.put("adam.vs_deepspeed_max", max(r["vs_deepspeed"] for r in runs if "vs_deepspeed" in r), c)
    else:
        f.put("adam.deepspeed_error", j.get("deepspeed_error", "this bench_adam predates DeepSpeed's columns"), c)


def nvme_figures(logs, f):
    c = "bench_nvme"
    j = logs.last_json(c, "bench")
    if not j:
        return
    cfgs = j["configs"]
    f.put("nvme.write_vs_fio", j["write_vs_fio"], c)
    f.put("nvme.read_vs_fio", j["read_vs_fio"], c)
    f.put("nvme.write_median_max", max(x["write"]["ratio"] for x in cfgs), c)
    f.put("nvme.read_median_max", max(x["read"]["ratio"] for x in cfgs), c)
    f.put("nvme.fio_write_max_over_min", j["fio_write_max_over_min"], c)
    f.put("nvme.fio_read_max_over_min", j["fio_read_max_over_min"], c)
    f.put("nvme.size_gib", j["size_bytes"] / GIB, c)
    f.put("nvme.pairs", j["pairs"], c)
    f.put("nvme.configs", len(cfgs), c)
    f.put("nvme.chunks_mib", sorted({x["chunk_mib"] for x in cfgs}), c)
    f.put("nvme.depths", sorted({x["depth"] for x in cfgs}), c)
    # The compute-copy pattern: a layer's extent of many chunks read one visit ahead.
    c = "bench_nvme_extents"
    j = logs.last_json(c, "bench")
    if not j:
        return
    x = j["configs"][0]
    f.put("nvme_extents.read_vs_fio", x["read"]["ratio"], c)
    f.put("nvme_extents.write_vs_fio", x["write"]["ratio"], c)
    f.put("nvme_extents.store_read_gbs", x["read"]["store_gbs"]["median"], c)
    f.put("nvme_extents.fio_read_gbs", x["read"]["fio_gbs"]["median"], c)
    f.put("nvme_extents.extent_mib", x["extent_bytes"] / (1 << 20), c)
    f.put("nvme_extents.inflight", x["inflight_extents"], c)
    f.put("nvme_extents.chunk_mib", x["chunk_mib"], c)
    f.put("nvme_extents.depth", x["depth"], c)
    f.put("nvme_extents.pairs", j["pairs"], c)


def torch_figures(logs, f):
    c = "bench_vs_torch"
    j = logs.last_json(c, "bench")
    if not j:
        return
    for k in ("strider_over_torch", "torch_tokens_per_s", "strider_tokens_per_s", "loss_max_rel_diff", "rounds",
              "steps", "threads", "seq", "micro_batch", "accumulation", "window"):
        f.put(f"torch.{k}", j[k], c)
    f.put("torch.params_m", j["params"] / 1e6, c)
    f.put("torch.ratio_min", min(j["ratios"]), c)
    f.put("torch.ratio_max", max(j["ratios"]), c)
    f.put("torch.torch_rss_gib", j["torch_peak_rss_bytes"] / 2**30, c)
    f.put("torch.strider_rss_gib", j["strider_peak_rss_bytes"] / 2**30, c)


EXTRACT = {"plan": plan_figures, "predict": predict_figures, "profile": profile_figures, "demo": demo_figures,
           "step": step_figures, "torch": torch_figures, "calibrate": calibrate_figures, "adam": adam_figures,
           "nvme": nvme_figures}

