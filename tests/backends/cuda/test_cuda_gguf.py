"""A GGUF model on the cuda backend (under Triton's interpreter on CPU, natively on a GPU): the
backend runs no quantized GEMMs, so the loader dequantizes every weight at load; the tokens are
the cpu backend's, which keeps the same file's weights quantized and dequantizes per call."""
import numpy as np
import pytest

from mindspec import LLM, SamplingParams
from mindspec.modeling.gguf_convert import convert_to_gguf
from tests.support.checkpoints import make_checkpoint, tiny_v3_config
from tests.support.tokenizers import make_tokenizer

pytestmark = pytest.mark.slow  # about half a minute under the interpreter on 2 cores


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_gguf_greedy_equals_cpu(tmp_path, device, qtype):
    cfg = tiny_v3_config(initializer_range=0.2)
    src = make_checkpoint(tmp_path / "src", cfg, seed=4)
    make_tokenizer(src, vocab_size=cfg.vocab_size)
    gguf = convert_to_gguf(src, tmp_path / f"m-{qtype}.gguf", qtype)[0]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, cfg.vocab_size, int(n)).tolist() for n in (6, 11)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    params = {"plugin_type": "mtp", "num_speculative_tokens": 1}
    runs = [[o.token_ids for o in LLM(model=str(gguf), dtype="float32", backend=backend, device=dev, progress=False,
                                      cache_block_size=4, num_blocks=64, plugin_params=params).generate(prompts, greedy)]
            for backend, dev in (("cpu", None), ("cuda", device))]
    assert runs[1] == runs[0]
