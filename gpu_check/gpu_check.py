"""The checks of gpu_check/gpu_check.sh, after its build: runs each, keeps its log, writes the summary.

    python gpu_check/gpu_check.py --mode gpu|cpu --repo REPO --build BUILD --out OUT_DIR [--jobs N]
    python gpu_check/gpu_check.py make-model DIR --size 1b|cpu     # a random Llama checkpoint (the speed check's)

gpu_check.sh calls it once the build is done (or failed: then every check is reported as not run). Each
check's stdout/stderr goes to OUT_DIR/gpu_check_logs/<check>.log as it runs; a check that holds leaves a stamp in
BUILD/gpu-check/stamps/ keyed by the tree, bundle, torch and mode, and a later run with the same key
reports the stamped result ("cached") instead of running it again. OUT_DIR gets gpu_check.json,
gpu_check_logs/ and gpu_check_logs.tar.gz (the same logs, packed), nothing else. Exit status 0 when the build and every check hold.
"""
import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import time

# TinyLlama-1.1B's shape: the speed check's "about 1B parameters" (1.10B), made on the spot.
SPEED_MODELS = {
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048),
    "cpu": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=4000, max_position_embeddings=512),
}
# How each mode runs the speed check: `strider profile` options.
PROFILE = {
    "gpu": dict(model="1b", device="cuda", budget="24GiB", seq=1024, micro_batch=4, accumulation=2,
                skip_steps=1, steps=2),
    "cpu": dict(model="cpu", device="cpu", budget="64MiB", seq=128, micro_batch=2, accumulation=2,
                skip_steps=1, steps=2),
}
H200_DENSE_BF16_TFLOPS = 989  # gpu/device/sim_device.cpp's h200 preset (datasheet, dense)
# Each check's own limit; $STRIDER_GPU_CHECK_DEADLINE_S (seconds from gpu_check.sh's start) bounds them all,
# so that a run under a hard time limit still ends with its summary written.
TIMEOUT_S = {"cuda_tests": 120, "engine": 180, "memory": 180, "speed": 240, "precision": 200, "calibrate": 240}


class Check:
    """One check's run: its log file, the commands it ran, their outputs."""

    def __init__(self, name, ctx):
        self.name, self.ctx = name, ctx
        self.log_path = ctx.logs / f"{name}.log"
        self.log = open(self.log_path, "w")
        self.deadline = min(time.time() + TIMEOUT_S[name], ctx.deadline)

    def run(self, cmd, env=None, timeout=None):
        """Runs cmd (stdout+stderr into the log); returns (rc, output). rc None: timed out."""
        timeout = max(1.0, min(timeout or 1e9, self.deadline - time.time()))
        self.log.write(f"$ {' '.join(map(str, cmd))}\n")
        self.log.flush()
        t0 = time.time()
        try:
            p = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace", env={**os.environ, **(env or {})}, timeout=timeout)
            rc, text = p.returncode, p.stdout
        except subprocess.TimeoutExpired as e:
            rc, text = None, (e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or "")
            text += f"\n[gpu_check: timed out after {timeout:.0f} s]\n"
        self.log.write(text)
        self.log.write(f"[exit status {rc}, {time.time() - t0:.1f} s]\n\n")
        self.log.flush()
        return rc, text


def last_json(text):
    for line in reversed((text or "").strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def status_of(rc, holds):
    if rc is None:
        return "timed out"
    return "passed" if holds else "failed"


# ---- the checks ---------------------------------------------------------------------------------------------

def check_cuda_tests(c, ctx):
    rc, text = c.run([ctx.build / "tests/gpu/gpu_test", "[cuda]", "-d", "yes"])
    skipped = "skipped: no GPU" in text
    summary = next((l for l in reversed(text.splitlines()) if "test cases" in l or "No tests ran" in l), "")
    res = {"rc": rc, "skipped": skipped, "summary": summary.strip()}
    if ctx.mode == "cpu":  # no GPU here: every [cuda] case must say so and pass as skipped
        res["holds"] = rc == 0 and skipped
        res["status"] = "skipped (no GPU, as expected in --cpu)" if res["holds"] else status_of(rc, False)
    else:
        res["holds"] = rc == 0 and not skipped
        res["status"] = ("failed: the [cuda] tests skipped, no GPU usable" if rc == 0 and skipped
                         else status_of(rc, res["holds"]))
    return res


def check_engine(c, ctx):
    rc, text = c.run([ctx.python, ctx.repo / "gpu_check/gpu_engine_check.py", "--device", ctx.device],
                     env={"STRIDER_BUILD_DIR": str(ctx.build)})
    j = last_json(text) or {}
    res = {"rc": rc, "holds": rc == 0 and bool(j.get("ok")), "result": j}
    res["status"] = status_of(rc, res["holds"])
    return res


def check_memory(c, ctx):
    rc, text = c.run([ctx.python, ctx.repo / "gpu_check/gpu_memory_check.py", "--device", ctx.device,
                      "--strider", ctx.build / "strider"], env={"STRIDER_BUILD_DIR": str(ctx.build)})
    j = last_json(text) or {}
    res = {"rc": rc, "holds": rc == 0 and bool(j.get("ok")), "findings": j.get("findings", []), "result": j}
    res["status"] = status_of(rc, res["holds"])
    if res["holds"] and res["findings"]:
        res["status"] = "passed, with findings"
    return res


def check_speed(c, ctx):
    p = PROFILE[ctx.mode]
    work = ctx.state / "work" / "speed"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    res = {"holds": False, "profile_options": p}
    try:
        rc, _ = c.run([ctx.python, pathlib.Path(__file__).resolve(), "make-model", work / "model",
                       "--size", p["model"]])
        if rc != 0:
            res.update(status=status_of(rc, False), error="could not write the random model (see speed.log)")
            return res
        rc, text = c.run([ctx.build / "strider", "profile", "--model", work / "model", "--data", "builtin",
                          "--device", p["device"], "--device-budget", p["budget"], "--seq", p["seq"],
                          "--micro-batch", p["micro_batch"], "--accumulation", p["accumulation"],
                          "--skip-steps", p["skip_steps"], "--steps", p["steps"], "--no-png", "--json",
                          "--out", work / "profile", "--work-dir", work / "data"])
        prof = last_json(text)
        res["profile_rc"] = rc
        if prof:
            trace = prof.pop("trace", None)
            if trace and os.path.exists(trace):
                shutil.copy(trace, ctx.logs / "speed_trace.json")
            res["profile"] = prof
            res["blocks"] = SPEED_MODELS[p["model"]]["num_hidden_layers"] + 2  # embedding, layers, head
            res["offloaded"] = prof["window"] < res["blocks"]
            peak = H200_DENSE_BF16_TFLOPS * 1e12 if "H200" in ctx.gpu_name else None
            res["mfu_6nt"] = prof["model_flops_per_s"] / peak if peak else None
            res["mfu_peak_tflops"] = H200_DENSE_BF16_TFLOPS if peak else None
            print(f"  profile: {prof['params'] / 1e6:.1f}M params, K {prof['window']} of {res['blocks']} blocks, "
                  f"{prof['step_s']:.3f} s/step, {prof['tokens_per_s']:.0f} tokens/s, "
                  f"critical {prof['critical_lane']}, overlap "
                  f"{prof['overlap_efficiency']:.3f}, {prof['model_flops_per_s'] / 1e12:.3g} TFLOP/s by 6NT"
                  + (f", MFU {res['mfu_6nt']:.3f}" if res["mfu_6nt"] is not None else ""))
        transfer = ctx.build / "bench/bench_transfer"
        if transfer.exists():
            rc_t, text_t = c.run([transfer, "--out", work / "transfer.json"], timeout=150)
            res["transfer_rc"], res["transfer"] = rc_t, last_json(text_t)
        else:
            res["transfer_rc"], res["transfer"] = None, "not built (no CUDA toolkit)"
        # strider against plain PyTorch on the same model and batches (a figure, never pass/fail on speed):
        # on the GPU its default 135M Llama; the CPU twin its --toy cut (about 10 s on 2 cores), so that the
        # speed check's time goes to the profile.
        vs_cmd = [ctx.python, ctx.repo / "bench/bench_vs_torch.py", "--device", ctx.device]
        if ctx.mode == "cpu":
            vs_cmd.append("--toy")
        rc_v, text_v = c.run(vs_cmd, env={"STRIDER_BUILD_DIR": str(ctx.build)}, timeout=150)
        res["vs_torch_rc"], res["vs_torch"] = rc_v, last_json(text_v)
        if isinstance(res["vs_torch"], dict):
            v = res["vs_torch"]
            print(f"  vs torch: strider/torch {v['strider_over_torch']:.3f} (median of {v['rounds']} rounds; "
                  f"{v['strider_tokens_per_s']:.0f} vs {v['torch_tokens_per_s']:.0f} tokens/s), "
                  f"losses within {v['loss_max_rel_diff']:.1e}")
        transfer_ok = (isinstance(res["transfer"], dict) and res["transfer_rc"] == 0 and
                       (ctx.mode == "cpu" or not res["transfer"].get("skipped")))
        if ctx.mode == "cpu" and res["transfer_rc"] is None:
            transfer_ok = True  # nothing to run without CUDA: said above
        res["holds"] = (rc == 0 and prof is not None and bool(res.get("offloaded")) and transfer_ok and
                        res["vs_torch_rc"] == 0)
        res["status"] = status_of(rc, res["holds"])
    finally:
        shutil.rmtree(work / "model", ignore_errors=True)  # gigabytes of random weights
    return res


def check_precision(c, ctx):
    """fp16 with loss scaling on the speed check's model (the same steps, data and seed): its losses and
    speed with fp32 accumulation in the GEMMs and with fp16 accumulation (--matmul-accumulate fp16), next to
    bf16's. On the GPU that is the quality figure fp16 accumulation lacks (a figure, not pass/fail); on the
    CPU device fp16 accumulation must be refused, naming the device."""
    p = PROFILE[ctx.mode]
    work = ctx.state / "work" / "precision"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    res = {"holds": False}
    try:
        rc, _ = c.run([ctx.python, pathlib.Path(__file__).resolve(), "make-model", work / "model", "--size", p["model"]])
        if rc != 0:
            res.update(status=status_of(rc, False), error="could not write the random model (see precision.log)")
            return res
        runs = {"bf16": ["--dtype", "bf16"], "fp16": ["--dtype", "fp16"],
                "fp16_accumulate": ["--dtype", "fp16", "--matmul-accumulate", "fp16"]}
        for name, flags in runs.items():
            rc, text = c.run([ctx.build / "strider", "profile", "--model", work / "model", "--data", "builtin",
                              "--device", p["device"], "--device-budget", p["budget"], "--seq", p["seq"],
                              "--micro-batch", p["micro_batch"], "--accumulation", p["accumulation"],
                              "--skip-steps", 0, "--steps", 3, "--no-png", "--json", *flags,
                              "--out", work / f"profile-{name}", "--work-dir", work / "data"])
            prof = last_json(text)
            res[name] = {"rc": rc, "losses": [s["loss"] for s in prof["per_step"]] if prof else None,
                         "tokens_per_s": prof["tokens_per_s"] if prof else None,
                         "refused": "is CUDA only" in text}
        acc, base = res["fp16_accumulate"], res["fp16"]
        if ctx.mode == "cpu":
            res["holds"] = base["rc"] == 0 and res["bf16"]["rc"] == 0 and acc["rc"] != 0 and acc["refused"]
        else:
            res["holds"] = all(r["rc"] == 0 and r["losses"] for r in (res["bf16"], base, acc))
            if res["holds"]:
                res["fp16_accumulate_loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(acc["losses"], base["losses"]))
                print(f"  precision: losses bf16 {res['bf16']['losses']}, fp16 {base['losses']}, fp16 accumulation "
                      f"{acc['losses']} (max relative difference to fp32 accumulation "
                      f"{res['fp16_accumulate_loss_rel_diff']:.2e}); tokens/s {res['bf16']['tokens_per_s']:.0f}, "
                      f"{base['tokens_per_s']:.0f}, {acc['tokens_per_s']:.0f}")
        res["status"] = status_of(0, res["holds"])
    finally:
        shutil.rmtree(work / "model", ignore_errors=True)
    return res


def check_calibrate(c, ctx):
    cmd = [ctx.build / "bench/bench_calibrate", "--device", ctx.device]
    if ctx.mode == "cpu":
        cmd += ["--rounds", "4"]  # the CPU twin: fewer rounds of the same measurement
    rc, text = c.run(cmd)
    j = last_json(text)
    res = {"rc": rc, "result": j}
    if j and "ratio" in j:
        res["ratio"] = j["ratio"]
        res["within_15pct"] = abs(j["ratio"] - 1) <= 0.15
        # What a later session puts into gpu/device/sim_device.cpp's h200 preset: this device's fitted costs.
        res["measured_cost_model"] = j.get("cost_model")
    if ctx.mode == "gpu":
        res["holds"] = rc == 0 and bool(res.get("within_15pct"))
    else:
        # The CPU twin exercises the calibration, but the 15% is the GPU's to meet: on the shared 2-core
        # development machine other work moves the CPU device's step time by +-30% between rounds (one
        # dry run: 1.94-3.35 s for the same step), so there it is reported, not required.
        res["holds"] = rc == 0 and "ratio" in res
        if res["holds"] and not res["within_15pct"]:
            res["findings"] = [f"predicted/measured {res['ratio']:.3f}: not within 15% on the CPU device (noisy "
                               "machine; required on the GPU only)"]
    res["status"] = status_of(rc, res["holds"])
    if rc == 0 and j and not res["holds"]:
        res["status"] = "failed: predicted/measured not within 15%"
    elif res.get("findings"):
        res["status"] = "passed, with findings"
    return res


CHECKS = [("cuda_tests", check_cuda_tests), ("engine", check_engine), ("memory", check_memory),
          ("speed", check_speed), ("precision", check_precision), ("calibrate", check_calibrate)]


# ---- the run ------------------------------------------------------------------------------------------------

class Context:
    def __init__(self, a):
        self.mode = a.mode
        self.repo, self.build, self.out = pathlib.Path(a.repo), pathlib.Path(a.build), pathlib.Path(a.out)
        self.device = "cuda" if self.mode == "gpu" else "cpu"
        self.state = self.build / "gpu-check"
        self.logs = self.out / "gpu_check_logs"  # written there as they go (gpu_check.sh's $logs)
        self.stamps = self.state / "stamps"
        self.python = sys.executable
        self.t0 = float(os.environ.get("STRIDER_GPU_CHECK_T0") or time.time())
        limit = os.environ.get("STRIDER_GPU_CHECK_DEADLINE_S")
        self.deadline = self.t0 + float(limit) if limit else float("inf")
        key_file = self.state / "key"
        self.key = f"{key_file.read_text().strip() if key_file.exists() else 'no-key'} mode-{self.mode}"
        self.gpu_name = ""
        try:
            self.gpu_name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass


def environment(ctx):
    env = {"python": ctx.python, "python_version": sys.version.split()[0], "gpu": ctx.gpu_name or None}
    try:
        import torch
        env.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                   cuda_available=torch.cuda.is_available())
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        env["torch"] = f"cannot import: {e}"
    cache = ctx.build / "CMakeCache.txt"
    if cache.exists():
        for line in cache.read_text(errors="replace").splitlines():
            for k in ("CMAKE_CXX_COMPILER:", "CMAKE_CUDA_COMPILER:", "CMAKE_COMMAND:"):
                if line.startswith(k):
                    env[k.rstrip(":").lower()] = line.split("=", 1)[1]
    return env


def run_checks(ctx, build, write_summary):
    """Runs (or takes from its stamp) each check in turn; the summary is rewritten after each one, so a run
    stopped from outside still leaves what it did in OUT_DIR."""
    results = {name: {"status": "not run yet", "holds": False} for name, _ in CHECKS}
    ctx.stamps.mkdir(parents=True, exist_ok=True)
    for name, fn in CHECKS:
        stamp = ctx.stamps / f"{name}.json"
        if build["status"] not in ("built", "cached"):
            results[name] = {"status": "not run: the build failed", "holds": False}
            continue
        if stamp.exists():
            saved = json.loads(stamp.read_text())
            if saved.get("key") == ctx.key and saved["result"].get("holds"):
                results[name] = {**saved["result"], "cached": True,
                                 "status": saved["result"]["status"] + " (cached: an earlier run, same key)"}
                print(f"gpu_check: {name}: {results[name]['status']}", flush=True)
                continue
        stamp.unlink(missing_ok=True)
        if time.time() >= ctx.deadline - 5:
            results[name] = {"status": "not run: past STRIDER_GPU_CHECK_DEADLINE_S", "holds": False}
            continue
        print(f"gpu_check: {name} ...", flush=True)
        t0 = time.time()
        c = Check(name, ctx)
        try:
            res = fn(c, ctx)
        except Exception as e:  # noqa: BLE001 - a broken check is reported, the others still run
            import traceback
            c.log.write(traceback.format_exc())
            res = {"status": f"error: {type(e).__name__}: {e}", "holds": False}
        finally:
            c.log.close()
        res["seconds"] = round(time.time() - t0, 1)
        res["log"] = c.log_path.name
        results[name] = res
        print(f"gpu_check: {name}: {res['status']} ({res['seconds']} s)", flush=True)
        if res.get("holds"):
            stamp.write_text(json.dumps({"key": ctx.key, "result": res}, default=str))
        write_summary(results, complete=False)
    return results


def main_checks(a):
    ctx = Context(a)
    ctx.logs.mkdir(parents=True, exist_ok=True)
    ctx.out.mkdir(parents=True, exist_ok=True)
    build_file = ctx.state / "build.json"
    build = (json.loads(build_file.read_text()) if build_file.exists()
             else {"status": "failed", "message": "no build.json"})
    if "t0" in build and "t1" in build:
        build["seconds"] = round(float(build.pop("t1")) - float(build.pop("t0")), 1)
    env = environment(ctx)
    notes = ["No GPU has run this check yet: every figure in a --cpu summary comes from the CPU device."
             if ctx.mode == "cpu" else "A GPU run: these are this machine's figures."]
    if ctx.mode == "cpu":
        notes.append("--cpu: the memory and speed checks use smaller models than on the GPU (gpu_check/gpu_memory_check.py "
                     "CPU_MODEL; gpu_check.py SPEED_MODELS['cpu']), calibration runs 4 rounds.")

    def write_summary(results, complete):
        built = build["status"] in ("built", "cached")
        summary = {"gpu_check": 1, "mode": ctx.mode, "complete": complete,
                   "ok": complete and built and all(r.get("holds") for r in results.values()),
                   "elapsed_s": round(time.time() - ctx.t0, 1), "key": ctx.key, "build": build, "environment": env,
                   "checks": results,
                   "findings": [f"{n}: {f}" for n, r in results.items() for f in r.get("findings", [])], "notes": notes}
        tmp = ctx.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1, default=str) + "\n")
        shutil.copy(tmp, ctx.logs / "gpu_check.json")
        tmp.replace(ctx.out / "gpu_check.json")
        with tarfile.open(ctx.out / "gpu_check_logs.tar.gz.tmp", "w:gz") as tar:
            tar.add(ctx.logs, arcname="gpu_check_logs")
        (ctx.out / "gpu_check_logs.tar.gz.tmp").replace(ctx.out / "gpu_check_logs.tar.gz")
        return summary

    write_summary({name: {"status": "not run yet", "holds": False} for name, _ in CHECKS}, complete=False)
    results = run_checks(ctx, build, write_summary)
    summary = write_summary(results, complete=True)
    print(f"gpu_check: {'ALL HOLD' if summary['ok'] else 'NOT ALL HOLD'} in {summary['elapsed_s']} s; "
          + ", ".join(f"{n} {r.get('status')}" for n, r in results.items()))
    print(f"gpu_check: wrote {ctx.out / 'gpu_check.json'} and {ctx.out / 'gpu_check_logs.tar.gz'}")
    return 0 if summary["ok"] else 1


def make_model(directory, size):
    """A random Llama checkpoint (config.json + model.safetensors, bf16) that `strider --model` loads; the
    weights are drawn by torch (on the GPU when there is one), far faster than the engine's serial init."""
    import torch
    import transformers
    from safetensors.torch import save_file
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = transformers.LlamaConfig(**SPEED_MODELS[size], rms_norm_eps=1e-5, tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in transformers.AutoModelForCausalLM.from_config(cfg).named_parameters()}
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(1)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=g, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()
        tensors[name] = t
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(directory)
    n = sum(t.numel() for t in tensors.values())
    print(f"make-model: {directory}: {n / 1e9:.3f}B parameters ({size}), bf16")
    return 0


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "make-model":
        ap = argparse.ArgumentParser(prog="gpu_check.py make-model")
        ap.add_argument("dir")
        ap.add_argument("--size", choices=sorted(SPEED_MODELS), required=True)
        a = ap.parse_args(sys.argv[2:])
        return make_model(a.dir, a.size)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["gpu", "cpu"], required=True)
    ap.add_argument("--repo", required=True)
    ap.add_argument("--build", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=0)
    return main_checks(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
