"""Train Medusa heads (seed 002, Medusa-1) for a checkpoint whose backbone stays frozen.

    python scripts/train_medusa_heads.py --model mindspec/assets/default_model

Head i reads the main model's last hidden state h(t) (after the final norm) at position t and is
trained towards the main model's own prediction for token t+i+2: the argmax of its logits at
position t+i+1 (self-distillation: greedy verification accepts a draft exactly when it equals
that argmax). Each head is one residual SiLU block ``x + SiLU(W x + b)`` (W, b zero at start, so a
head starts as the model's own next-token head) read out by the model's lm_head, which stays
frozen and is shared: only the blocks are saved, as ``medusa_lm_head.safetensors``
(mindspec/modeling/medusa_heads.py reads it).

Data, as for the MTP modules' self-distillation: the main model's greedy continuations (generated
by mindspec, MTP on) of 64-token prompts cut from the training files, plus plain training text;
the held-out files stay unseen. Features and targets come from mindspec's own forward of the
frozen model. Deterministic for a seed; writes metrics to ``medusa_metrics.json``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mindspec import LLM, SamplingParams
from mindspec.bench.corpus import corpus_files, read
from mindspec.modeling.forward_metadata import build_model_inputs, to_device
from mindspec.modeling.loader import MEDUSA_HEADS_FILE
from mindspec.modeling.model_wrapper import ModelWrapper

CHUNK = 256  # tokens per feature forward


def windows(tokenizer, files: list[Path], count: int, length: int, rng) -> list[list[int]]:
    """``count`` token windows of ``length`` from ``files`` (BOS first), round robin over files."""
    encoded = [tokenizer.encode(read(f), add_special_tokens=False) for f in files]
    encoded = [ids for ids in encoded if len(ids) > length + 1]
    out = []
    while len(out) < count:
        ids = encoded[int(rng.integers(len(encoded)))]
        start = int(rng.integers(0, len(ids) - length))
        out.append([tokenizer.bos_token_id] + ids[start : start + length - 1])
    return out


@torch.inference_mode()
def features(wrapper: ModelWrapper, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Per token of every sequence: hidden state [T, H], the model's argmax [T], and the index of
    the sequence it belongs to [T] (targets never cross sequences)."""
    hidden, argmax, owner = [], [], []
    block = wrapper.cache_config.block_size
    table = list(range(-(-CHUNK // block)))
    for s, seq in enumerate(sequences):
        for start in range(0, len(seq), CHUNK):  # each chunk alone: contexts of up to CHUNK tokens
            chunk = seq[start : start + CHUNK]
            inputs = build_model_inputs([chunk], [0], [table], block, lm_head_indices=np.arange(len(chunk)))
            out = wrapper.forward(to_device(inputs, wrapper.device))
            hidden.append(out.hidden_states.float())
            argmax.append(out.logits.argmax(dim=-1))
            owner.append(np.full(len(chunk), s * 10_000 + start // CHUNK))
    return torch.cat(hidden), torch.cat(argmax), np.concatenate(owner)


def head_targets(argmax: torch.Tensor, owner: np.ndarray, num_heads: int) -> torch.Tensor:
    """[T, heads]: head i at t targets argmax[t + i + 1] (-100 past the end of t's chunk)."""
    t = len(argmax)
    out = torch.full((t, num_heads), -100, dtype=torch.long)
    own = torch.from_numpy(owner)
    for i in range(num_heads):
        shift = i + 1
        same = own[:-shift] == own[shift:]
        out[:-shift, i] = torch.where(same, argmax[shift:], torch.full_like(argmax[shift:], -100))
    return out


class Heads(torch.nn.Module):
    def __init__(self, num_heads: int, hidden: int, lm_head: torch.Tensor):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(num_heads, hidden, hidden))
        self.b = torch.nn.Parameter(torch.zeros(num_heads, hidden))
        self.register_buffer("lm_head", lm_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] -> [N, heads, V]
        y = x[:, None, :] + F.silu(torch.einsum("nh,kgh->nkg", x, self.w) + self.b)
        return y @ self.lm_head.T


def evaluate(heads: Heads, x: torch.Tensor, y: torch.Tensor) -> tuple[list[float], list[float]]:
    losses, accs = [], []
    with torch.no_grad():
        logits = torch.cat([heads(x[i : i + 4096]) for i in range(0, len(x), 4096)])
    for i in range(y.shape[1]):
        keep = y[:, i] >= 0
        losses.append(float(F.cross_entropy(logits[keep, i], y[keep, i])))
        accs.append(float((logits[keep, i].argmax(-1) == y[keep, i]).float().mean()))
    return losses, accs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mindspec/assets/default_model")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--prompts", type=int, default=768, help="64-token prompts continued greedily by the model")
    p.add_argument("--new-tokens", type=int, default=192)
    p.add_argument("--text-windows", type=int, default=512, help="plain training-text windows of 256 tokens")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    started = time.time()
    model_dir = Path(args.model)
    llm = LLM(model=str(model_dir), dtype="float32", progress=False,
              plugin_params={"plugin_type": "mtp", "num_speculative_tokens": 3}, max_batch_size=64)
    tokenizer = llm.engine.tokenizer
    train, held = corpus_files()
    prompts = windows(tokenizer, train, args.prompts, 64, rng)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True))
    continued = [p + o.token_ids for p, o in zip(prompts, outs)]
    text = windows(tokenizer, train, args.text_windows, 256, rng)
    held_prompts = windows(tokenizer, held, 64, 64, np.random.default_rng(1))
    held_outs = llm.generate(held_prompts, SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True))
    held_seqs = [p + o.token_ids for p, o in zip(held_prompts, held_outs)]
    del llm
    print(f"data: {len(continued)} continuations, {len(text)} text windows ({time.time() - started:.0f} s)", flush=True)

    wrapper = ModelWrapper(model_dir, backend="cpu", dtype="float32", num_mtp_modules=0, progress=False)
    wrapper.allocate_cache(-(-CHUNK // 16) + 2, 16)
    x, argmax, owner = features(wrapper, continued + text)
    y = head_targets(argmax, owner, args.heads)
    hx, hargmax, howner = features(wrapper, held_seqs)
    hy = head_targets(hargmax, howner, args.heads)
    print(f"features: {len(x)} train rows, {len(hx)} held-out rows ({time.time() - started:.0f} s)", flush=True)

    heads = Heads(args.heads, x.shape[1], wrapper.model.lm_head.weight.float())
    before = evaluate(heads, hx, hy)
    opt = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=0.0)
    batch = 2048
    steps = args.epochs * (len(x) // batch)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    step = 0
    for epoch in range(args.epochs):
        order = torch.randperm(len(x))
        for i in range(0, len(x) - batch + 1, batch):
            idx = order[i : i + batch]
            logits = heads(x[idx])  # [N, heads, V]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[idx].reshape(-1), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
        losses, accs = evaluate(heads, hx, hy)
        print(f"epoch {epoch + 1}: held-out loss {[round(v, 3) for v in losses]}, top-1 {[round(v, 3) for v in accs]} "
              f"({time.time() - started:.0f} s)", flush=True)

    from safetensors.torch import save_file

    tensors = {}
    for i in range(args.heads):
        tensors[f"medusa_head.{i}.0.linear.weight"] = heads.w[i].detach().to(torch.bfloat16).contiguous()
        tensors[f"medusa_head.{i}.0.linear.bias"] = heads.b[i].detach().to(torch.bfloat16).contiguous()
    save_file(tensors, str(model_dir / MEDUSA_HEADS_FILE))
    metrics = {"heads": args.heads, "train_rows": len(x), "heldout_rows": len(hx), "epochs": args.epochs,
               "seconds": round(time.time() - started), "seed": args.seed,
               "heldout_loss_before": before[0], "heldout_top1_before": before[1],
               "heldout_loss": losses, "heldout_top1": accs,
               "command": "python scripts/train_medusa_heads.py " + " ".join(
                   f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())}
    (model_dir / "medusa_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(json.dumps(metrics, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
