"""Engine.step's inputs of an objective past SFT (EngineConfig.objective; docs/objectives.md), from the caller's
[rows] and [rows, length - 1] tensors to the binding's [batch] and [batch, seq] ones."""
import torch


def objective_step_args(c, input_ids, ref_logps, advantages, old_logps) -> dict:
    """The binding's objective arguments for Engine.step under EngineConfig `c`: the caller's rows, the per-row
    values ([batch]) and the per-token ones ([batch, seq], aligned with the engine's shifted labels), zero-padded;
    {} for sft without any. A value of the wrong shape, or one the objective does not take, is a ValueError."""
    objective = c.objective
    shape = torch.as_tensor(input_ids).shape
    rows, length = (1, shape[0]) if len(shape) == 1 else tuple(shape)
    grpo = objective == "grpo"
    per_row = advantages if grpo else ref_logps
    tokens_ref = ref_logps if grpo else None
    if objective == "sft":
        given = [n for n, v in (("ref_logps", ref_logps), ("advantages", advantages), ("old_logps", old_logps))
                 if v is not None]
        if given:
            raise ValueError(f"step: {', '.join(given)} given, but the engine's objective is sft; make it with "
                             "EngineConfig(objective='dpo', ...) (or simpo, orpo, grpo)")
        return {}
    if not grpo and (advantages is not None or old_logps is not None):
        raise ValueError(f"step: advantages and old_logps are grpo's; the engine's objective is {objective}")

    def row_values(name, v):
        t = torch.as_tensor(v, dtype=torch.float32).detach().reshape(-1).cpu()
        if t.numel() != rows:
            raise ValueError(f"step: {name} has {t.numel()} values; input_ids has {rows} rows")
        out = torch.zeros(c.batch, dtype=torch.float32)
        out[:rows] = t
        return out

    def token_values(name, v):
        t = torch.as_tensor(v, dtype=torch.float32).detach().cpu()
        if t.dim() == 1:
            t = t.unsqueeze(0)
        if tuple(t.shape) != (rows, length - 1):
            raise ValueError(f"step: {name} has shape {tuple(t.shape)}; per-token values are [rows, length - 1] "
                             f"= [{rows}, {length - 1}] (as logprobs(per_token=True) gives them)")
        out = torch.zeros(c.batch, c.seq, dtype=torch.float32)
        out[:rows, :length - 1] = t
        return out

    extra = {"rows": rows}
    if per_row is not None:
        extra["row"] = row_values("advantages" if grpo else "ref_logps", per_row)
    if old_logps is not None:
        extra["old_logps"] = token_values("old_logps", old_logps)
    if tokens_ref is not None:
        extra["ref_logps"] = token_values("ref_logps", tokens_ref)
    return extra
