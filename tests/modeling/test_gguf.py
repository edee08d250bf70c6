"""GGUF files: config from metadata, the loader's mapping of llama.cpp's deepseek2 tensors, split
files, the errors, weights kept quantized in memory, and ``mindspec convert`` both ways."""
import dataclasses
import logging

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from mindspec import LLM, SamplingParams
from mindspec.bench.memory import resident_weight_bytes
from mindspec.cli import main as cli_main
from mindspec.config.defaults import DEFAULT_MODEL_DIR
from mindspec.modeling.errors import (
    CheckpointError,
    MissingTensorError,
    NotACheckpointError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnsupportedCheckpointError,
)
from mindspec.modeling.gguf_convert import convert_from_gguf, convert_to_gguf, tensor_type
from mindspec.modeling.gguf_quants import GgufWeight
from mindspec.modeling.loader import checkpoint_keys, read_hf_config
from mindspec.models.deepseekv2.config import DeepseekV2Config
from mindspec.models.deepseekv2.flash_causal_deepseekv2 import FlashCausalDeepseekV2
from tests.support.checkpoints import make_checkpoint, tiny_v2_config
from tests.support.gguf_files import k_quant_config, make_model_with_tokenizer, rewrite_gguf
from tests.support.tokenizers import make_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[0, 17, 42, 9, 101], [0, 5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.fixture(scope="module")
def shipped_q8(tmp_path_factory):
    return convert_to_gguf(DEFAULT_MODEL_DIR, tmp_path_factory.mktemp("q8") / "shipped-q8_0.gguf", "q8_0")[0]


def _tokens(model, **kw):
    llm = LLM(model=str(model), dtype="float32", progress=False, cache_block_size=4, num_blocks=64, **kw)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_config_from_metadata_equals_config_json(shipped_q8):
    assert DeepseekV2Config.from_dict(read_hf_config(shipped_q8)) == DeepseekV2Config.from_model_dir(DEFAULT_MODEL_DIR)


def test_v2_config_softmax_routing_and_no_q_lora_round_trip(tmp_path):
    cfg = tiny_v2_config(vocab_size=300)
    src = make_checkpoint(tmp_path / "v2", cfg, seed=1)
    make_tokenizer(src, vocab_size=300)
    gguf = convert_to_gguf(src, tmp_path / "v2.gguf", "f32")[0]
    from_gguf, from_json = DeepseekV2Config.from_dict(read_hf_config(gguf)), DeepseekV2Config.from_model_dir(src)
    assert from_gguf.scoring == "softmax" and from_gguf.q_lora_rank is None
    assert dataclasses.replace(from_gguf, eos_token_id=None, bos_token_id=None) == dataclasses.replace(
        from_json, eos_token_id=None, bos_token_id=None)
    assert _tokens(gguf) == _tokens(src)


def test_gguf_names_map_back_onto_the_checkpoints_own(shipped_q8):
    assert checkpoint_keys(shipped_q8) == checkpoint_keys(DEFAULT_MODEL_DIR)


def test_weights_stay_quantized_in_memory(tmp_path):
    cfg = k_quant_config()
    src = make_model_with_tokenizer(tmp_path / "src", cfg, seed=3)
    cpu = __import__("mindspec.backend", fromlist=["get_backend"]).get_backend("cpu")
    bf16 = resident_weight_bytes(FlashCausalDeepseekV2.load(src, cpu, torch.bfloat16, progress=False))
    for qtype, most in (("q8_0", 0.55), ("q4_k", 0.35)):
        gguf = convert_to_gguf(src, tmp_path / f"{qtype}.gguf", qtype)[0]
        model = FlashCausalDeepseekV2.load(gguf, cpu, torch.bfloat16, progress=False)
        assert isinstance(model.embed, GgufWeight) and isinstance(model.lm_head.weight, GgufWeight)
        assert isinstance(model.layers[1].mlp.experts.w13, GgufWeight)
        ratio = resident_weight_bytes(model) / bf16
        assert ratio <= most, f"{qtype}: {ratio:.3f} of bf16"
        # the same file dequantized at load where asked (compiled steps, backends without quantized GEMMs)
        dense = FlashCausalDeepseekV2.load(gguf, cpu, torch.bfloat16, progress=False, keep_quantized=False)
        assert isinstance(dense.embed, torch.Tensor)


def test_split_gguf_loads_like_the_single_file(tmp_path, shipped_q8):
    shards = convert_to_gguf(DEFAULT_MODEL_DIR, tmp_path / "split.gguf", "q8_0", split_max_size=3_000_000)
    assert len(shards) >= 3 and shards[0].name == f"split-00001-of-{len(shards):05d}.gguf"
    assert all(s.is_file() for s in shards)
    assert _tokens(shards[0]) == _tokens(shipped_q8)
    assert _tokens(shards[-1]) == _tokens(shipped_q8)  # any shard names the set
    shards[1].unlink()
    with pytest.raises(NotACheckpointError, match=f"{shards[1].name} is missing"):
        _tokens(shards[0])


def test_gguf_round_trips_to_safetensors(tmp_path, shipped_q8):
    back = convert_from_gguf(shipped_q8, tmp_path / "back", torch.float32)
    assert (back / "tokenizer.json").is_file() and (back / "config.json").is_file()
    assert _tokens(back) == _tokens(shipped_q8)


def test_convert_cli_writes_the_type_asked_for(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert cli_main(["convert", str(DEFAULT_MODEL_DIR), str(out), "--type", "q4_0"]) == 0
    types = {t.name: t.tensor_type.name for t in GGUFReader(out).tensors}
    assert types["blk.3.ffn_up_exps.weight"] == "Q4_0" and types["blk.3.attn_norm.weight"] == "F32"
    assert types["blk.12.nextn.eh_proj.weight"] == "Q4_0"  # the MTP modules are written
    assert cli_main(["convert", str(out), str(tmp_path / "back")]) == 0  # --to safetensors from a .gguf
    assert (tmp_path / "back" / "model.safetensors").is_file()
    assert cli_main(["convert", str(DEFAULT_MODEL_DIR), str(tmp_path / "x.gguf"), "--type", "q3_k"]) != 0
    assert "q3_k" in capsys.readouterr().err


def test_k_quants_fall_back_where_rows_do_not_split_into_their_blocks():
    from gguf import GGMLQuantizationType as Q

    assert tensor_type("blk.0.ffn_down.weight", (192, 512), Q.Q4_K) == Q.Q4_K
    assert tensor_type("blk.0.attn_q_a.weight", (96, 192), Q.Q4_K) == Q.Q5_0  # llama.cpp's fallback
    assert tensor_type("blk.0.attn_q_a.weight", (96, 192), Q.Q6_K) == Q.Q8_0
    assert tensor_type("blk.0.attn_q_a.weight", (96, 200), Q.Q8_0) == Q.F16
    assert tensor_type("blk.1.ffn_gate_inp.weight", (6, 192), Q.Q8_0) == Q.F32


# ---- what users get wrong -----------------------------------------------------------------------
def _broken(tmp_path, src, **kw):
    return rewrite_gguf(src, tmp_path / "broken.gguf", **kw)


def test_a_missing_tensor_is_named(tmp_path, shipped_q8):
    broken = _broken(tmp_path, shipped_q8, keep=lambda n: n != "blk.4.ffn_up_shexp.weight")
    with pytest.raises(MissingTensorError, match="model.layers.4.mlp.shared_experts.up_proj.weight"):
        _tokens(broken)


def test_half_of_a_split_kv_b_is_named(tmp_path, shipped_q8):
    broken = _broken(tmp_path, shipped_q8, keep=lambda n: n != "blk.2.attn_v_b.weight")
    with pytest.raises(MissingTensorError, match="blk.2.attn_k_b.weight but not blk.2.attn_v_b.weight"):
        _tokens(broken)


def test_an_unknown_tensor_is_named(tmp_path, shipped_q8):
    broken = _broken(tmp_path, shipped_q8, rename=lambda n: "blk.0.attn_gate.weight" if n == "blk.0.attn_q_a.weight" else n)
    with pytest.raises(UnexpectedTensorError, match="blk.0.attn_gate.weight"):
        _tokens(broken)


def test_a_wrong_shape_is_named(tmp_path, shipped_q8):
    broken = _broken(tmp_path, shipped_q8, reshape={"blk.0.attn_output.weight": (96, 256)})
    with pytest.raises(ShapeMismatchError, match=r"model.layers.0.self_attn.o_proj.weight.*\[96, 256\]"):
        _tokens(broken)


def test_another_architecture_is_refused(tmp_path, shipped_q8):
    broken = _broken(tmp_path, shipped_q8, arch="llama")
    with pytest.raises(UnsupportedCheckpointError, match="GGUF architecture 'llama' is not supported"):
        _tokens(broken)


def test_missing_metadata_is_named(tmp_path, shipped_q8):
    broken = _broken(tmp_path, shipped_q8, metadata={"deepseek2.attention.kv_lora_rank": None})
    with pytest.raises(UnsupportedCheckpointError, match="deepseek2.attention.kv_lora_rank"):
        _tokens(broken)


def test_metadata_of_the_wrong_type_is_refused(tmp_path, shipped_q8):
    broken = _broken(tmp_path, shipped_q8, metadata={"deepseek2.block_count": "twelve"})
    with pytest.raises(UnsupportedCheckpointError, match="broken.gguf: unusable GGUF metadata"):
        _tokens(broken)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF-but-not-really" * 10)
    with pytest.raises(NotACheckpointError, match="not a readable GGUF file"):
        _tokens(bad)
    with pytest.raises(NotACheckpointError, match="does not exist"):
        _tokens(tmp_path / "absent.gguf")


def test_errors_are_checkpoint_errors_the_service_reports():
    for exc in (MissingTensorError, ShapeMismatchError, UnexpectedTensorError, UnsupportedCheckpointError,
                NotACheckpointError):
        assert issubclass(exc, CheckpointError)


def test_a_gguf_without_mtp_layers_serves_without_mtp_and_says_so(tmp_path, shipped_q8, caplog):
    """What llama.cpp's converter makes: no nextn layers, block_count the main layers."""
    no_mtp = _broken(tmp_path, shipped_q8, keep=lambda n: int(n.split(".")[1]) < 12 if n.startswith("blk.") else True,
                     metadata={"deepseek2.block_count": 12, "deepseek2.nextn_predict_layers": None})
    params = {"plugin_type": "mtp", "num_speculative_tokens": 2}
    with caplog.at_level(logging.WARNING):
        tokens = _tokens(no_mtp, plugin_params=params)
    assert "has no MTP (nextn) layers" in caplog.text and "serving without MTP" in caplog.text
    assert tokens == _tokens(shipped_q8)


def test_llm_reads_the_tokenizer_from_the_file(shipped_q8):
    from transformers import AutoTokenizer

    llm = LLM(model=str(shipped_q8), progress=False, num_blocks=16)
    text = "def main():\n    print('héllo wörld', 1234)\n"
    assert llm.tokenizer.encode(text) == AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR)).encode(text)
    assert np.array_equal(sorted(llm.engine.eos_token_ids), [1])


def test_a_mindie_config_serves_a_gguf_file_with_mtp(tmp_path, shipped_q8):
    import json

    from mindspec.config.defaults import default_config_dict

    config = default_config_dict(str(shipped_q8))  # plugin_params: MTP, 3 speculative tokens
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(config=str(tmp_path / "config.json"), progress=False)
    out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert len(out.token_ids) == 16 and out.spec_decode.num_accepted_tokens > 0


def test_generate_cli_runs_a_gguf_file(shipped_q8, capsys):
    assert cli_main(["generate", "--model", str(shipped_q8), "--prompt", "import os", "--max-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip()


def test_an_older_file_with_kv_b_whole_loads_the_same(tmp_path, shipped_q8):
    from tests.support.gguf_files import with_whole_kv_b

    older = with_whole_kv_b(shipped_q8, tmp_path / "kv_b.gguf")
    names = {t.name for t in GGUFReader(older).tensors}
    assert "blk.0.attn_kv_b.weight" in names and "blk.0.attn_k_b.weight" not in names
    assert _tokens(older) == _tokens(shipped_q8)


def test_the_cpu_thread_default_reads_a_gguf_files_hidden_size(shipped_q8):
    from mindspec.engine.args import EngineArgs

    assert EngineArgs(model=str(shipped_q8)).model_hidden_size() == 192
