"""The plain-PyTorch optimizer strider's AdamW matches, for comparisons.

strider's weight decay spares norms and biases, as transformers' Trainer does.
`adamw_param_groups(model, weight_decay)` gives torch.optim.AdamW the parameter
groups the Trainer would (transformers' own Trainer.get_decay_parameter_names
decides), so a torch run with them is the reference a strider run tracks:

    opt = torch.optim.AdamW(adamw_param_groups(model, 0.1), lr=1e-4)

`adamw_steps(model, batches, micro_loss, ...)` trains a model with torch.optim.AdamW
micro-batch by micro-batch (clipping, a linear warm-up and decay): the reference
run the tests set a strider run against.

`packed_position_ids(rows)` gives the position_ids of rows that pack documents, as
transformers (and strider's packed_documents) read them.

`quantized_round_trip(w, fmt)` is a weight matrix quantized to int8 (per row, scale
absmax / 127) or QLoRA's NF4 (blocks of 64 with an absmax) and back, in numpy, by those
formats' definitions: what a LoRA base in `--base-format int8|nf4` computes with.
"""

# QLoRA's NF4 levels (arXiv 2305.14314, appendix E), ascending.
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)


def adamw_param_groups(model, weight_decay):
    """[decayed parameters with `weight_decay`, norms and biases with 0], in the model's order."""
    import transformers

    decayed = set(transformers.Trainer.get_decay_parameter_names(None, model))  # uses no Trainer state
    params = list(model.named_parameters())
    return [{"params": [p for n, p in params if n in decayed], "weight_decay": weight_decay},
            {"params": [p for n, p in params if n not in decayed], "weight_decay": 0.0}]


def adamw_steps(model, batches, micro_loss, *, micro_batch, accumulation, lr, betas, eps, weight_decay, clip,
                warmup, total, param_groups=None):
    """transformers + torch.optim.AdamW over `batches`, each `accumulation` micro-batches of `micro_batch` rows:
    per step (loss, gradient norm before clipping). micro_loss(model, batch, rows) is one micro-batch's share of
    the step's loss (a tensor to back-propagate; `rows` the slice of the batch's rows). AdamW on
    `param_groups` (default: adamw_param_groups, the Trainer's decay), clipping at `clip`, transformers'
    linear schedule with `warmup` steps to 0 at `total`."""
    import torch
    import transformers

    groups = adamw_param_groups(model, weight_decay) if param_groups is None else param_groups
    opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    sched = transformers.get_linear_schedule_with_warmup(opt, warmup, total)
    out = []
    for batch in batches:
        opt.zero_grad()
        loss = 0.0
        for m in range(accumulation):
            part = micro_loss(model, batch, slice(m * micro_batch, (m + 1) * micro_batch))
            part.backward()
            loss += part.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        out.append((loss, norm.item()))
    return out


def packed_position_ids(rows):
    """Rows of documents by their lengths ([[6, 6, 5], [12, 5], ...], each row the same total) -> their
    packed position_ids, an int64 tensor [rows, total]: each document's positions count from 0."""
    import torch

    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])


def quantized_round_trip(w, fmt):
    """w (a float32 numpy array [out, in]) quantized in `fmt` ("int8" or "nf4") and dequantized, in fp32."""
    import numpy as np

    w = np.asarray(w, dtype=np.float32)
    if fmt == "int8":
        scale = (np.abs(w).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
        codes = np.clip(np.rint(np.divide(w, scale, out=np.zeros_like(w), where=scale > 0)), -127, 127)
        return (codes.astype(np.float32) * scale).astype(np.float32)
    if fmt != "nf4":
        raise ValueError(f"quantized_round_trip: format {fmt!r} is not int8 or nf4")
    levels = np.array(NF4_LEVELS, dtype=np.float32)
    flat = w.reshape(-1)
    blocks = np.concatenate([flat, np.zeros((-flat.size) % 64, np.float32)]).reshape(-1, 64)
    amax = np.abs(blocks).max(axis=1, keepdims=True).astype(np.float32)
    x = np.divide(blocks, amax, out=np.zeros_like(blocks), where=amax > 0)
    # The nearest level, the lower one on a tie: how many midpoints lie strictly below x.
    mids = (levels[:-1] + levels[1:]) * np.float32(0.5)
    idx = (x[..., None] > mids).sum(axis=-1)
    return (levels[idx] * amax).astype(np.float32).reshape(-1)[: flat.size].reshape(w.shape)
