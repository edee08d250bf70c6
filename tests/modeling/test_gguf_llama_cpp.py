"""GGUF files made by llama.cpp's own converter (convert_hf_to_gguf.py from the llama-cpp-python
sdist: ``export LLAMA_CPP_SRC=$(scripts/llama_cpp_converter.sh)``, as .ci/run does) load in
mindspec, and mindspec's converter writes what llama.cpp's does: the same tensors, types and
bytes, the same metadata (plus the MTP modules, which llama.cpp's converter drops)."""
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from mindspec import LLM, SamplingParams
from mindspec.bench.corpus import heldout_prompts
from mindspec.bench.llama_cpp import convert
from mindspec.config.defaults import DEFAULT_MODEL_DIR
from mindspec.modeling.gguf_convert import convert_to_gguf
from mindspec.modeling.gguf_file import read_metadata

SRC = os.environ.get("LLAMA_CPP_SRC", "")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (Path(SRC) / "convert_hf_to_gguf.py").is_file(),
                       reason="LLAMA_CPP_SRC does not hold llama.cpp's convert_hf_to_gguf.py (scripts/llama_cpp_converter.sh)"),
]
TYPES = ("f32", "bf16", "q8_0")
# Keys only one side writes: the model's display name and size label, llama.cpp's general.type,
# add_eos_token (mindspec writes llama.cpp's default, false), and the MTP layers mindspec keeps.
NOT_COMPARED = {"general.name", "general.size_label", "general.type", "tokenizer.ggml.add_eos_token",
                "deepseek2.block_count", "deepseek2.nextn_predict_layers"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama_cpp")
    return {t: (convert(str(DEFAULT_MODEL_DIR), out / f"llama-{t}.gguf", Path(SRC), t),
                convert_to_gguf(DEFAULT_MODEL_DIR, out / f"mindspec-{t}.gguf", t)[0]) for t in TYPES}


@pytest.mark.parametrize("qtype", TYPES)
def test_mindspec_writes_llama_cpps_tensors_byte_for_byte(files, qtype):
    theirs, ours = (GGUFReader(f) for f in files[qtype])
    mine = {t.name: t for t in ours.tensors}
    for t in theirs.tensors:
        assert t.name in mine, t.name
        assert (t.tensor_type, list(t.shape)) == (mine[t.name].tensor_type, list(mine[t.name].shape)), t.name
        assert np.array_equal(t.data, mine[t.name].data), t.name
    extra = set(mine) - {t.name for t in theirs.tensors}
    assert extra and all(int(n.split(".")[1]) >= 12 for n in extra)  # the MTP modules alone
    a, b = read_metadata(theirs), read_metadata(ours)
    assert {k: v for k, v in a.items() if k not in NOT_COMPARED} == {k: v for k, v in b.items() if k not in NOT_COMPARED}
    assert b["deepseek2.block_count"] == a["deepseek2.block_count"] + b["deepseek2.nextn_predict_layers"]


@pytest.mark.parametrize("qtype", ["f32", "bf16"])
def test_llama_cpps_float_files_give_the_safetensors_models_tokens(files, qtype):
    from transformers import AutoTokenizer

    prompts = heldout_prompts(AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR)), 4, 48)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = [[o.token_ids for o in LLM(model=str(m), dtype="float32", progress=False).generate(prompts, greedy)]
            for m in (DEFAULT_MODEL_DIR, files[qtype][0])]
    assert runs[0] == runs[1]


def test_llama_cpps_file_serves_without_mtp_when_mtp_is_asked_for(files, caplog):
    with caplog.at_level(logging.WARNING):
        llm = LLM(model=str(files["q8_0"][0]), progress=False, plugin_params={"plugin_type": "mtp", "num_speculative_tokens": 2})
    assert "has no MTP (nextn) layers" in caplog.text
    assert llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=4))[0].token_ids


def test_llama_cpps_tokenizer_metadata_is_ours_and_gives_the_hf_ids(files):
    from transformers import AutoTokenizer

    from mindspec.bench.corpus import corpus_files, read
    from mindspec.text_generator import gguf_tokenizer as gt
    from tests.support.tokenizer_checks import EXTRA_TEXTS, assert_same_tokenizer

    hf = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    theirs = read_metadata(GGUFReader(files["q8_0"][0]))
    ours = gt.tokenizer_metadata(hf)
    # llama.cpp leaves add_eos_token out when the post-processor adds no EOS; mindspec writes false.
    assert gt.ADD_EOS not in theirs and ours[gt.ADD_EOS] is False
    assert {k: v for k, v in theirs.items() if k.startswith("tokenizer.")} == {k: v for k, v in ours.items() if k != gt.ADD_EOS}
    tok = gt.tokenizer_from_gguf(theirs, "llama.cpp's file")
    assert_same_tokenizer(tok, hf, [read(p) for p in corpus_files()[1]] + EXTRA_TEXTS)
