"""The default model's corpus: the Python standard library's own source, found through sysconfig
(present wherever Python is), with every 40th file held out for evaluation and benchmarks.

The training script (scripts/train_default_model.py) and the benchmarks share this one definition,
so benchmark prompts never come from files the model was trained on.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

HOLDOUT_EVERY = 40
_SKIP = {"site-packages", "test", "tests", "idlelib", "__pycache__"}


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not _SKIP & set(p.relative_to(root).parts))
    held = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY == 0]
    train = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY != 0]
    return train, held


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def heldout_prompts(tokenizer, count: int, prompt_tokens: int, reserve: int = 64, seed: int = 0) -> list[list[int]]:
    """``count`` windows of ``prompt_tokens`` tokens (BOS first) cut from the held-out files, round
    robin over the files so that a batch mixes sources; each window leaves ``reserve`` tokens of
    real continuation after it in its file."""
    _, held = corpus_files()
    rng = np.random.default_rng(seed)
    encoded = [tokenizer.encode(read(p), add_special_tokens=False) for p in held]
    encoded = [ids for ids in encoded if len(ids) >= prompt_tokens + reserve]
    if not encoded:
        raise ValueError(f"no held-out file has {prompt_tokens + reserve} tokens")
    prompts = []
    while len(prompts) < count:
        ids = encoded[len(prompts) % len(encoded)]
        start = int(rng.integers(0, len(ids) - prompt_tokens - reserve + 1))
        prompts.append([tokenizer.bos_token_id] + ids[start : start + prompt_tokens])
    return prompts
