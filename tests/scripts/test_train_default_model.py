"""The training script end to end: a few steps on a few files save a checkpoint that mindspec and
transformers load; the MTP self-distillation changes only the MTP modules; and it reproduces the
shipped checkpoint's tokenizer and config from scratch."""
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


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short training run (2 steps on 8 files) shared by the tests that read its checkpoint
    or start from it: -> (checkpoint directory, the metrics train() returned)."""
    train = _script()
    out = tmp_path_factory.mktemp("trained")
    return out, train.train(_args(train, out, max_files=8))


def test_short_training_saves_a_loadable_checkpoint(trained):
    tmp_path, metrics = trained
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


def test_script_writes_the_shipped_chat_template(tmp_path):
    from mindspec.text_generator.tokenizer import load_tokenizer

    train = _script()
    train.train_tokenizer([SCRIPT], vocab_size=300).save_pretrained(str(tmp_path))
    shipped = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())["chat_template"]
    assert shipped == train.CHAT_TEMPLATE
    messages = [{"role": "user", "content": "import os"}, {"role": "user", "content": "x = 1"}]
    assert load_tokenizer(tmp_path).render_chat_template(messages) == load_tokenizer(DEFAULT_MODEL_DIR).render_chat_template(messages)


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_load_reads_back_what_save_wrote(trained, tmp_path):
    train, (checkpoint, _) = _script(), trained
    model, tokenizer = train.load(checkpoint)
    train.save(model, checkpoint, tmp_path / "again")
    first, again = _tensors(checkpoint), _tensors(tmp_path / "again")
    assert first.keys() == again.keys() and all(first[k].equal(again[k]) for k in first)
    assert tokenizer.get_vocab() == json.loads((checkpoint / "tokenizer.json").read_text())["model"]["vocab"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (checkpoint / name).read_bytes()


def test_distillation_trains_only_the_mtp_modules(trained, tmp_path):
    train, (pre, _) = _script(), trained
    out = tmp_path / "distilled"
    metrics = train.main(_args(train, out, max_files=8, distill_from=pre, distill_steps=3, distill_sequences=4,
                               distill_prompt_tokens=8))
    d = metrics["mtp_distillation"]
    assert len(d["mtp_top1_agreement_greedy"]) == 3 and d["distill"]["steps"] == 3
    assert metrics["steps"] == 2  # the pre-training record is kept
    assert json.loads((out / "training_metrics.json").read_text()) == json.loads(json.dumps(metrics))
    before, after = _tensors(pre), _tensors(out)
    assert before.keys() == after.keys()
    mtp_layers = ("model.layers.12.", "model.layers.13.", "model.layers.14.")
    for name in before:
        if name.startswith(mtp_layers):
            continue
        assert before[name].equal(after[name]), f"{name} changed: the main model must stay frozen"
    changed = [n for n in before if n.startswith(mtp_layers) and not before[n].equal(after[n])]
    assert {n.split(".")[2] for n in changed} == {"12", "13", "14"}
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (out / name).read_bytes() == (pre / name).read_bytes()
    prompt = "def f(x):"
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(model=str(out), dtype="float32", cache_block_size=16, num_blocks=32, progress=False)
    mtp = LLM(model=str(out), dtype="float32", cache_block_size=16, num_blocks=32, progress=False,
              plugin_params={"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "vanilla"})
    assert mtp.generate(prompt, greedy)[0].token_ids == plain.generate(prompt, greedy)[0].token_ids


def test_distillation_rejects_a_prompt_longer_than_the_window(trained, tmp_path):
    train, (pre, _) = _script(), trained
    with pytest.raises(ValueError, match="--distill-prompt-tokens"):
        train.distill(_args(train, tmp_path / "out", max_files=8, distill_prompt_tokens=64), pre, tmp_path / "out")
