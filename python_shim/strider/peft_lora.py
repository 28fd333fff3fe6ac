"""A PEFT LoRA model as the engine sees it (engine/model/lora.h): its base model, the adapters' options as
EngineConfig.lora's text, and its parameters under the engine's names.

    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    engine = strider.Engine(peft_model, config)     # trains the adapters in place; the base stays frozen

The engine keeps one copy of every tensor: the base's frozen weights as the compute copy (no master, no
gradient, no Adam state), the adapters (and the modules in modules_to_save) with their fp32 masters and
moments. PEFT's own parameters are rebound to that compute copy, as a plain model's are, so after
engine.finish() `peft_model.save_pretrained(dir)` writes the trained adapter. What strider does not
implement is refused by name before any work: DoRA, a dropout mask (lora_dropout > 0: strider's must match
torch's), bias training, LoRA on some layers only or on other modules than a decoder layer's linear ones,
rank or alpha patterns, several adapters.
"""
import re

# The decoder layer's linear modules strider can adapt (engine/model/lora.h, kLinearModules), in layer order.
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The modules strider trains in full beside adapters (engine/model/lora.h, kFullModules).
FULL_MODULES = ("embed_tokens", "lm_head")


def is_peft_model(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _refuse(what):
    raise ValueError(f"strider.Engine: {what}")


def _check_options(config, adapter):
    """Refuses, by name, each PEFT option strider does not implement."""
    kind = str(getattr(config, "peft_type", ""))
    if not kind.endswith("LORA"):
        _refuse(f"PEFT adapter '{adapter}' is {kind}; strider trains LoRA adapters only")
    unsupported = [
        ("use_dora", bool(getattr(config, "use_dora", False)), "DoRA"),
        ("lora_dropout", float(getattr(config, "lora_dropout", 0.0) or 0.0) != 0.0,
         "a dropout mask on the adapters' input (strider's would not be torch's); set lora_dropout=0"),
        ("bias", getattr(config, "bias", "none") != "none", "training biases"),
        ("lora_bias", bool(getattr(config, "lora_bias", False)), "a bias on lora_B"),
        ("fan_in_fan_out", bool(getattr(config, "fan_in_fan_out", False)), "transposed (Conv1D) weights"),
        ("rank_pattern", bool(getattr(config, "rank_pattern", None)), "a rank per module"),
        ("alpha_pattern", bool(getattr(config, "alpha_pattern", None)), "an alpha per module"),
        ("layers_to_transform", getattr(config, "layers_to_transform", None) is not None, "LoRA on some layers only"),
        ("layer_replication", getattr(config, "layer_replication", None) is not None, "replicated layers"),
        ("trainable_token_indices", getattr(config, "trainable_token_indices", None) is not None,
         "training some tokens' embeddings"),
        ("target_parameters", bool(getattr(config, "target_parameters", None)), "LoRA on parameters"),
        ("use_qalora", bool(getattr(config, "use_qalora", False)), "QALoRA"),
    ]
    for name, bad, what in unsupported:
        if bad:
            _refuse(f"the LoRA option {name}={getattr(config, name)!r} ({what}) is not supported")
    for m in list(getattr(config, "modules_to_save", None) or []):
        if m not in FULL_MODULES:
            _refuse(f"modules_to_save names '{m}'; strider trains {', '.join(FULL_MODULES)} in full beside adapters")


def engine_view(model):
    """(base model, EngineConfig.lora text, {engine name: the model's parameter name}) of a PEFT LoRA model.
    Refuses, by name, what strider does not implement."""
    adapters = list(model.peft_config)
    if len(adapters) != 1:
        _refuse(f"the PEFT model has {len(adapters)} adapters ({', '.join(adapters)}); strider trains one")
    adapter = adapters[0]
    config = model.peft_config[adapter]
    _check_options(config, adapter)
    base = model.get_base_model()
    layers = base.model.layers

    # What the modules hold: a LoRA layer has lora_A; its rank, alpha and scale must be the spec's.
    def targets_of(layer):
        found = []
        for m in LINEAR_MODULES:
            owner = layer.self_attn if m in LINEAR_MODULES[:4] else layer.mlp
            if hasattr(getattr(owner, m), "lora_A"):
                found.append(m)
        return found
    targets = targets_of(layers[0])
    if not targets:
        _refuse("the PEFT model has no LoRA adapter on a decoder layer's linear modules")
    for i, layer in enumerate(layers):
        if targets_of(layer) != targets:
            _refuse(f"LoRA targets {targets_of(layer)} in layer {i} but {targets} in layer 0; strider adapts the "
                    "same modules in every layer")
    first = getattr(layers[0].self_attn if targets[0] in LINEAR_MODULES[:4] else layers[0].mlp, targets[0])
    r, alpha, scale = first.r[adapter], first.lora_alpha[adapter], first.scaling[adapter]
    rslora = bool(getattr(config, "use_rslora", False))
    expected = alpha / (r ** 0.5 if rslora else r)
    if abs(scale - expected) > 1e-12 * max(1.0, abs(expected)):
        _refuse(f"the adapters' scaling {scale} is not lora_alpha / {'sqrt(r)' if rslora else 'r'} = {expected}")
    adapted = {f"model.layers.{i}.{'self_attn' if m in LINEAR_MODULES[:4] else 'mlp'}.{m}"
               for i in range(len(layers)) for m in targets}
    for name, module in base.named_modules():
        if (hasattr(module, "lora_A") or hasattr(module, "lora_embedding_A")) and name not in adapted:
            _refuse(f"LoRA on '{name}' is not supported (strider adapts decoder layers' linear modules; train "
                    "the LM head or the embedding in full with modules_to_save)")
        if (hasattr(module, "lora_A") and (len(module.r) != 1 or module.r[adapter] != r
                                           or module.lora_alpha[adapter] != alpha)):
            _refuse(f"'{name}' has rank {dict(module.r)} and alpha {dict(module.lora_alpha)}; strider gives every "
                    f"module one rank and alpha ({r}, {alpha})")
    train = [m for m in FULL_MODULES if m in (getattr(config, "modules_to_save", None) or [])]
    text = f"r={r},alpha={alpha},targets={'+'.join(targets)}"
    if rslora:
        text += ",rslora=1"
    if train:
        text += f",train={'+'.join(train)}"

    names = {}
    for name, _ in model.named_parameters():
        n = re.sub(r"^base_model\.model\.", "", name)
        if ".original_module." in n:  # modules_to_save's frozen original: PEFT's own copy, not the engine's
            continue
        n = n.replace(".base_layer.", ".").replace(f".modules_to_save.{adapter}.", ".")
        n = n.replace(f".lora_A.{adapter}.", ".lora_A.").replace(f".lora_B.{adapter}.", ".lora_B.")
        names[n] = name
    return base, text, names
