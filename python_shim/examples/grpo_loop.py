"""A complete small RL loop with GRPO through strider: generate, reward, step, sync.

    python python_shim/examples/grpo_loop.py --seeds 1,2,3 --steps 40

A tiny transformers Llama (random weights, a vocabulary of 16 tokens) is the policy. Each step it samples a
group of completions per prompt with model.generate, a rule-based reward scores each completion in [0, 1]
(the share of its tokens that are even ids: 0.5 for a random policy), the advantages are the rewards
normalised within each prompt's group (TRL's scale_rewards="group"), and strider.Engine(objective="grpo")
takes one optimizer step on the rollouts (on-policy: old_logps left out). engine.sync_to_model() then hands
the generator the trained weights: the model's parameters are the engine's compute copy, so nothing is
copied. Swap in a real checkpoint, a real reward and vLLM for generation, and the loop is the same.

Prints per seed the mean reward of the first and last 10 steps, and a JSON summary as its last line.
"""
import argparse
import json
import sys
from pathlib import Path

try:
    import strider
except ImportError:  # run from a source checkout: the package is in python_shim/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import strider
import torch
import transformers

VOCAB, PROMPT, COMPLETION = 16, 4, 8


def reward(completion: torch.Tensor) -> torch.Tensor:
    """[rows, COMPLETION] token ids -> [rows] in [0, 1]: the share of even ids."""
    return (completion % 2 == 0).float().mean(dim=1)


def run(seed: int, steps: int, prompts: int, group: int, lr: float, device: str) -> list:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(cfg)
    rows = prompts * group
    engine = strider.Engine(model, strider.EngineConfig(
        seq=PROMPT + COMPLETION, micro_batch=rows // 2, accumulation=2, dtype="fp32", lr=lr, clip_norm=1.0,
        objective="grpo", loss_type="grpo", device=device))
    g = torch.Generator().manual_seed(seed)
    rewards = []
    for _ in range(steps):
        prompt = torch.randint(0, VOCAB, (prompts, PROMPT), generator=g).repeat_interleave(group, dim=0)
        with torch.no_grad():
            ids = engine.sync_to_model().generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                                                  max_new_tokens=COMPLETION, min_new_tokens=COMPLETION, top_k=0,
                                                  pad_token_id=0)
        r = reward(ids[:, PROMPT:])
        grouped = r.view(prompts, group)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
        labels = ids.clone()
        labels[:, :PROMPT] = -100  # the prompt is no target: only the completion's tokens are scored
        engine.step(ids, labels, advantages=advantages)
        rewards.append(float(r.mean()))
    engine.finish()
    return rewards


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="1,2,3", help="comma-separated seeds, one run each")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--group", type=int, default=4, help="completions sampled per prompt")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    summary = {}
    for seed in (int(s) for s in a.seeds.split(",")):
        rewards = run(seed, a.steps, a.prompts, a.group, a.lr, a.device)
        first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
        print(f"seed {seed}: mean reward of the first 10 steps {first:.3f}, of the last 10 {last:.3f}")
        summary[str(seed)] = {"first10": first, "last10": last, "rewards": rewards}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
