"""The plain-PyTorch optimizer strider's AdamW matches, for comparisons.

strider's weight decay spares norms and biases, as transformers' Trainer does.
`adamw_param_groups(model, weight_decay)` gives torch.optim.AdamW the parameter
groups the Trainer would (transformers' own Trainer.get_decay_parameter_names
decides), so a torch run with them is the reference a strider run tracks:

    opt = torch.optim.AdamW(adamw_param_groups(model, 0.1), lr=1e-4)

`packed_position_ids(rows)` gives the position_ids of rows that pack documents, as
transformers (and strider's packed_documents) read them.
"""


def adamw_param_groups(model, weight_decay):
    """[decayed parameters with `weight_decay`, norms and biases with 0], in the model's order."""
    import transformers

    decayed = set(transformers.Trainer.get_decay_parameter_names(None, model))  # uses no Trainer state
    params = list(model.named_parameters())
    return [{"params": [p for n, p in params if n in decayed], "weight_decay": weight_decay},
            {"params": [p for n, p in params if n not in decayed], "weight_decay": 0.0}]


def packed_position_ids(rows):
    """Rows of documents by their lengths ([[6, 6, 5], [12, 5], ...], each row the same total) -> their
    packed position_ids, an int64 tensor [rows, total]: each document's positions count from 0."""
    import torch

    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])
