"""The shipped default model: loads in transformers with identical greedy output, MTP (K = 3) on
held-out code is lossless and accepts >= 2.4 tokens per step, and a new user's first command works."""
import shutil
import subprocess
import sys

import pytest
import torch

from mindspec import LLM, SamplingParams
from mindspec.bench.corpus import heldout_prompts
from mindspec.config.defaults import DEFAULT_MODEL_DIR

GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    llm = LLM(model=str(DEFAULT_MODEL_DIR), dtype="float32", num_blocks=256, cache_block_size=16, progress=False)
    return heldout_prompts(llm.tokenizer.hf_tokenizer, 8, 64), llm


def test_shipped_model_matches_transformers_greedy(prompts):
    from transformers import AutoModelForCausalLM

    ps, llm = prompts
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32, experts_implementation="eager").eval()
    outs = llm.generate(ps[:5], GREEDY)
    for p, o in zip(ps[:5], outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=64, do_sample=False, eos_token_id=None)
        assert ref[0, len(p):].tolist() == o.token_ids


@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
def test_mtp_k3_is_lossless_and_accepts_well(prompts, mode):
    ps, llm = prompts
    expected = [o.token_ids for o in llm.generate(ps, GREEDY)]
    mtp = LLM(model=str(DEFAULT_MODEL_DIR), dtype="float32", num_blocks=256, cache_block_size=16, progress=False,
              plugin_params={"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": mode,
                             "adaptive_speculation": False})
    outs = mtp.generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == expected
    stats = mtp.engine.spec_stats
    if mode == "vanilla":
        assert stats.mean_accepted_length >= 2.4


@pytest.mark.parametrize("plugin_params, floor", [
    ({"plugin_type": "mtp", "tree": "dynamic", "num_speculative_tokens": 5, "tree_topk": 3, "num_draft_tokens": 12,
      "mtp_mode": "eagle", "adaptive_speculation": False}, 4.0),
    ({"plugin_type": "medusa"}, 1.8),
], ids=["eagle_tree", "medusa"])
def test_trees_are_lossless_and_accept_well(prompts, plugin_params, floor):
    """On held-out prompts: an MTP tree accepts more than the K=3 chain can emit (4 tokens a
    step), and the shipped Medusa heads' drafts are accepted too; output as without speculation."""
    ps, llm = prompts
    expected = [o.token_ids for o in llm.generate(ps, GREEDY)]
    tree = LLM(model=str(DEFAULT_MODEL_DIR), dtype="float32", num_blocks=256, cache_block_size=16, progress=False,
               plugin_params=plugin_params)
    assert [o.token_ids for o in tree.generate(ps, GREEDY)] == expected
    assert tree.engine.spec_stats.mean_accepted_length >= floor


def test_first_command_prints_python():
    exe = shutil.which("mindspec")
    cmd = [exe] if exe else [sys.executable, "-m", "mindspec.cli"]
    res = subprocess.run(cmd + ["generate", "--prompt", "def fibonacci(n):"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    text = res.stdout
    assert len(text.strip()) > 20 and any(s in text for s in ("return", "if ", "=", "(")), text


def test_shipped_chat_template_joins_messages_as_a_code_prompt():
    """The shipped code model's chat template: BOS, then the messages' text joined by newlines."""
    from mindspec.text_generator.tokenizer import load_tokenizer

    tok = load_tokenizer(DEFAULT_MODEL_DIR)
    messages = [{"role": "system", "content": "# math helpers"},
                {"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}]}]
    text = tok.render_chat_template(messages)
    assert text == "<｜begin▁of▁sentence｜># math helpers\ndef add(a, b):"
    assert tok.apply_chat_template(messages) == tok.encode("# math helpers\ndef add(a, b):")  # encode adds BOS
