"""The training script end to end: a few steps on a few files save a checkpoint that mindspec and
transformers load; and it reproduces the shipped checkpoint's tokenizer and config from scratch."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from mindspec import LLM, SamplingParams
from mindspec.config.defaults import DEFAULT_MODEL_DIR

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_default_model.py"


def _script():
    spec = importlib.util.spec_from_file_location("train_default_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(train, out, **kw):
    argv = ["--out", str(out), "--steps", "2", "--batch", "2", "--seq-len", "32", "--log-every", "1"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return train.parse_args(argv)


def test_short_training_saves_a_loadable_checkpoint(tmp_path):
    train = _script()
    metrics = train.train(_args(train, tmp_path, max_files=8))
    assert len(metrics["mtp_top1_agreement"]) == 3 and metrics["heldout_loss"] > 0
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["num_nextn_predict_layers"] == 3
    llm = LLM(model=str(tmp_path), dtype="float32", cache_block_size=16, num_blocks=32, progress=False,
              plugin_params={"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "vanilla"})
    out = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, experts_implementation="eager")
    ref = hf.generate(torch.tensor([out.prompt_token_ids]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert ref[0, len(out.prompt_token_ids):].tolist() == out.token_ids


@pytest.mark.slow
def test_script_reproduces_the_shipped_tokenizer_and_config(tmp_path):
    train = _script()
    train.train(_args(train, tmp_path, steps=1, batch=1))
    for name in ("tokenizer.json", "config.json"):
        assert (tmp_path / name).read_text() == (DEFAULT_MODEL_DIR / name).read_text(), name
