"""llama.cpp side by side, where llama-cpp-python and a llama.cpp source tree ($LLAMA_CPP_SRC)
are installed (not in CI: building llama.cpp takes longer than the suite): the shipped model
converted by llama.cpp's own converter decodes the same greedy tokens as mindspec."""
import importlib.util
import os

import pytest

from mindspec import LLM, SamplingParams
from mindspec.bench import llama_cpp
from mindspec.bench.speed import Measurement
from mindspec.config.defaults import default_model_dir

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None or not os.environ.get(llama_cpp.SRC_ENV),
    reason="needs llama-cpp-python and $LLAMA_CPP_SRC (a llama.cpp source tree)",
)


@pytest.mark.slow
def test_llama_cpp_decodes_the_shipped_models_greedy_tokens(tmp_path):
    gguf = llama_cpp.convert(str(default_model_dir()), tmp_path / "model.gguf", llama_cpp.converter_dir(None))
    llm = LLM(dtype="float32", progress=False, plugin_params=None, cpu_threads=1)
    prompts = [llm.tokenizer.encode(t) for t in ("def fibonacci(n):\n", "import os\nimport sys\n\nclass ")]
    expected = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]
    one, both = Measurement(), Measurement()
    runner = llama_cpp.LlamaCppRunner(gguf, 1, 256)
    try:
        llama_cpp.run_llama_cpp(runner, prompts, [24, 24], one)
        llama_cpp.run_llama_cpp(runner, prompts, [24, 16], both, batch=2)  # parallel sequences of one context
    finally:
        runner.close()
    assert one.token_ids == [list(e) for e in expected]
    assert one.tokens_per_s[0] > 0 and len(one.latency_per_token_ms) == 1
    for m, n in ((one, [24, 24]), (both, [24, 16])):  # per request: the first token early, the last within its group
        last = [first + (k - 1) * tpot for first, tpot, k in zip(m.ttft_s[0], m.tpot_s[0], n)]
        assert all(0 < first < 0.5 * end for first, end in zip(m.ttft_s[0], last))
        assert max(last) <= sum(m.group_seconds[0])
    assert both.token_ids == [list(expected[0]), list(expected[1][:16])]


def test_a_gguf_llama_cpp_cannot_load_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(llama_cpp.LlamaCppError, match="llama.cpp could not load"):
        llama_cpp.LlamaCppRunner(bad, 1, 64)
