"""The tiny checkpoint builders and HF reference helpers in tests/support behave as documented."""
import json

import pytest
import torch
from safetensors import safe_open

from tests.support.checkpoints import (
    checkpoint_shapes,
    load_hf_model,
    make_checkpoint,
    read_tensors,
    tiny_v2_config,
    tiny_v3_config,
)
from tests.support.hf_reference import (
    _block_state_dict,
    hf_logits,
    load_mtp_block,
    main_hidden_reference,
    mtp_reference,
)

TOKENS = [5, 9, 2, 200, 17, 33, 4, 101]


def _expected_mtp_shapes(cfg, layer, with_embed_and_head=True, v3=True):
    H, E, I = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    p = f"model.layers.{layer}."
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    nh = cfg.num_attention_heads
    s = {
        "enorm.weight": (H,),
        "hnorm.weight": (H,),
        "eh_proj.weight": (H, 2 * H),
        "shared_head.norm.weight": (H,),
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        "self_attn.kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H),
        "self_attn.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        "self_attn.o_proj.weight": (H, nh * cfg.v_head_dim),
        "mlp.gate.weight": (E, H),
        "mlp.shared_experts.gate_proj.weight": (I * cfg.n_shared_experts, H),
        "mlp.shared_experts.up_proj.weight": (I * cfg.n_shared_experts, H),
        "mlp.shared_experts.down_proj.weight": (H, I * cfg.n_shared_experts),
    }
    if cfg.q_lora_rank is None:
        s["self_attn.q_proj.weight"] = (nh * qk, H)
    else:
        s["self_attn.q_a_proj.weight"] = (cfg.q_lora_rank, H)
        s["self_attn.q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        s["self_attn.q_b_proj.weight"] = (nh * qk, cfg.q_lora_rank)
    if v3:
        s["mlp.gate.e_score_correction_bias"] = (E,)
    if with_embed_and_head:
        s["embed_tokens.weight"] = (cfg.vocab_size, H)
        s["shared_head.head.weight"] = (cfg.vocab_size, H)
    for e in range(E):
        s[f"mlp.experts.{e}.gate_proj.weight"] = (I, H)
        s[f"mlp.experts.{e}.up_proj.weight"] = (I, H)
        s[f"mlp.experts.{e}.down_proj.weight"] = (H, I)
    return {p + k: v for k, v in s.items()}


@pytest.fixture(scope="module")
def v3_ckpt(tmp_path_factory):
    cfg = tiny_v3_config()
    return make_checkpoint(tmp_path_factory.mktemp("v3"), cfg, seed=0), cfg


@pytest.fixture(scope="module")
def v3_sharded(tmp_path_factory):
    cfg = tiny_v3_config()
    return make_checkpoint(tmp_path_factory.mktemp("v3s"), cfg, seed=0, max_shard_size="100KB"), cfg


@pytest.fixture(scope="module")
def v2_ckpt(tmp_path_factory):
    cfg = tiny_v2_config()
    return make_checkpoint(tmp_path_factory.mktemp("v2"), cfg, seed=0, num_mtp_modules=1), cfg


def test_v3_config_json(v3_ckpt):
    path, cfg = v3_ckpt
    cj = json.loads((path / "config.json").read_text())
    assert cj["model_type"] == "deepseek_v3"
    assert cj["num_nextn_predict_layers"] == 1
    assert cj["rope_parameters"]["rope_type"] == "yarn"
    assert cj["rope_parameters"]["factor"] == 40.0
    assert cj["rope_parameters"]["mscale_all_dim"] == 1.0
    assert cj["max_position_embeddings"] == 163840
    assert cj["rope_interleave"] is True
    assert cj["q_lora_rank"] == 48 and cj["n_group"] == 2 and cj["topk_group"] == 1


def test_v3_single_file_has_main_and_mtp_keys(v3_ckpt):
    path, cfg = v3_ckpt
    assert not (path / "model.safetensors.index.json").exists()
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    shapes = checkpoint_shapes(path)
    expected = _expected_mtp_shapes(cfg, cfg.num_hidden_layers)
    mtp = {k: v for k, v in shapes.items() if k.startswith(f"model.layers.{cfg.num_hidden_layers}.")}
    assert mtp == expected
    # Main MoE layer has the same block layout as the MTP block (minus MTP-only keys).
    last = {k.split(".", 3)[3]: v for k, v in shapes.items() if k.startswith(f"model.layers.{cfg.num_hidden_layers - 1}.")}
    block = {k.split(".", 3)[3]: v for k, v in mtp.items()}
    for extra in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight", "shared_head.head.weight"):
        block.pop(extra)
    assert block == last
    # embed/head copies equal the main model's
    t = read_tensors(path, lambda k: "embed_tokens" in k or "head" in k)
    n = cfg.num_hidden_layers
    assert torch.equal(t[f"model.layers.{n}.embed_tokens.weight"], t["model.embed_tokens.weight"])
    assert torch.equal(t[f"model.layers.{n}.shared_head.head.weight"], t["lm_head.weight"])


def test_v3_sharded_mtp_in_own_shard(v3_sharded, v3_ckpt):
    path, cfg = v3_sharded
    index = json.loads((path / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    n = cfg.num_hidden_layers
    mtp_keys = [k for k in wm if k.startswith(f"model.layers.{n}.")]
    assert mtp_keys and {wm[k] for k in mtp_keys} == {"model-mtp.safetensors"}
    assert all(wm[k] != "model-mtp.safetensors" for k in wm if not k.startswith(f"model.layers.{n}."))
    assert len({v for v in wm.values()}) > 2
    for f in set(wm.values()):
        assert (path / f).exists()
    assert checkpoint_shapes(path) == checkpoint_shapes(v3_ckpt[0])
    # same seed -> same tensors, sharded or not
    a = read_tensors(path)
    b = read_tensors(v3_ckpt[0])
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_hf_loads_without_missing_keys_and_logits_vary(v3_ckpt):
    path, cfg = v3_ckpt
    model, info = __import__("transformers").AutoModelForCausalLM.from_pretrained(
        str(path), attn_implementation="eager", experts_implementation="eager", output_loading_info=True
    )
    assert info["missing_keys"] in (set(), [])
    unexpected = set(info["unexpected_keys"])
    assert all(k.startswith(f"model.layers.{cfg.num_hidden_layers}.") for k in unexpected)
    hf = load_hf_model(path)
    logits = hf_logits(hf, TOKENS)
    assert logits.shape == (len(TOKENS), cfg.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert logits.std(dim=-1).min() > 1e-2  # not constant across the vocabulary
    assert (logits[0] - logits[1]).abs().max() > 1e-2  # nor across positions
    hidden = main_hidden_reference(hf, TOKENS)
    assert hidden.shape == (len(TOKENS), cfg.hidden_size)
    assert torch.allclose(hidden @ hf.lm_head.weight.T, logits, atol=1e-5)


def test_randomised_norms_and_bias(v3_ckpt):
    path, cfg = v3_ckpt
    t = read_tensors(path)
    assert not torch.allclose(t["model.norm.weight"], torch.ones(cfg.hidden_size))
    bias = t["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().max() > 0


def test_bf16_checkpoint_keeps_bias_fp32(tmp_path):
    cfg = tiny_v3_config()
    path = make_checkpoint(tmp_path, cfg, dtype=torch.bfloat16)
    t = read_tensors(path)
    n = cfg.num_hidden_layers
    assert t["model.layers.1.self_attn.q_a_proj.weight"].dtype == torch.bfloat16
    assert t[f"model.layers.{n}.eh_proj.weight"].dtype == torch.bfloat16
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert t[f"model.layers.{n}.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_mtp_options(tmp_path):
    cfg = tiny_v3_config()
    path = make_checkpoint(tmp_path / "a", cfg, num_mtp_modules=2, mtp_with_embed_and_head=False)
    shapes = checkpoint_shapes(path)
    n = cfg.num_hidden_layers
    for j in range(2):
        exp = _expected_mtp_shapes(cfg, n + j, with_embed_and_head=False)
        assert {k: v for k, v in shapes.items() if k.startswith(f"model.layers.{n + j}.")} == exp
    assert not any(k.startswith(f"model.layers.{n + 2}.") for k in shapes)
    path0 = make_checkpoint(tmp_path / "b", cfg, num_mtp_modules=0)
    assert not any(k.startswith(f"model.layers.{n}.") for k in checkpoint_shapes(path0))


def test_determinism_and_seed(tmp_path, v3_ckpt):
    cfg = tiny_v3_config()
    a = read_tensors(make_checkpoint(tmp_path / "a", cfg, seed=0))
    b = read_tensors(v3_ckpt[0])
    c = read_tensors(make_checkpoint(tmp_path / "c", cfg, seed=1))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.3.eh_proj.weight"], c["model.layers.3.eh_proj.weight"])
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_global_rng_untouched(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_checkpoint(tmp_path, tiny_v3_config(num_hidden_layers=2), seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_v2_saves_q_proj_and_runs(v2_ckpt):
    path, cfg = v2_ckpt
    cj = json.loads((path / "config.json").read_text())
    assert cj["model_type"] == "deepseek_v2" and cj["q_lora_rank"] is None
    assert cj["rope_parameters"]["mscale"] == 0.707 and cj["rope_parameters"]["mscale_all_dim"] == 0.707
    shapes = checkpoint_shapes(path)
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (cfg.num_attention_heads * qk, cfg.hidden_size)
    assert not any("q_a_proj" in k or "q_b_proj" in k for k in shapes)
    assert not any("e_score_correction_bias" in k for k in shapes)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (cfg.intermediate_size, cfg.hidden_size)
    n = cfg.num_hidden_layers
    assert {k: v for k, v in shapes.items() if k.startswith(f"model.layers.{n}.")} == _expected_mtp_shapes(cfg, n, v3=False)
    hf = load_hf_model(path)
    logits = hf_logits(hf, TOKENS)
    assert logits.shape == (len(TOKENS), cfg.vocab_size) and logits.std(dim=-1).min() > 1e-2


@pytest.mark.parametrize("which", ["v3", "v2"])
def test_mtp_reference_shapes_and_determinism(which, v3_ckpt, v2_ckpt):
    path, cfg = v3_ckpt if which == "v3" else v2_ckpt
    hf = load_hf_model(path)
    hidden = main_hidden_reference(hf, TOKENS[:-1])
    shifted = TOKENS[1:]
    pos = list(range(1, len(TOKENS)))
    logits, block = mtp_reference(path, 0, shifted, hidden, pos)
    assert logits.shape == (len(shifted), cfg.vocab_size) and block.shape == (len(shifted), cfg.hidden_size)
    assert torch.isfinite(logits).all() and logits.std(dim=-1).min() > 1e-2
    logits2, block2 = mtp_reference(path, 0, shifted, hidden, pos)
    assert torch.equal(logits, logits2) and torch.equal(block, block2)
    # embedding-first (DeepSeek) vs hidden-first must differ
    logits_hf, _ = mtp_reference(path, 0, shifted, hidden, pos, hidden_first=True)
    assert (logits - logits_hf).abs().max() > 1e-3
    # causal: a prefix gives the same rows
    lp, bp = mtp_reference(path, 0, shifted[:4], hidden[:4], pos[:4])
    assert torch.allclose(lp, logits[:4], atol=1e-5) and torch.allclose(bp, block[:4], atol=1e-5)
    # relative RoPE: a uniform position offset leaves the result unchanged (up to fp32 rounding)
    lo, _ = mtp_reference(path, 0, shifted, hidden, [p - 1 for p in pos])
    assert torch.allclose(lo, logits, atol=1e-4)
    # different positions pattern does change it
    lr, _ = mtp_reference(path, 0, shifted, hidden, pos[::-1])
    assert (lr - logits).abs().max() > 1e-4


@pytest.mark.parametrize("which", ["v3", "v2"])
def test_mtp_block_machinery_matches_hf_main_layer(which, v3_ckpt, v2_ckpt):
    """The standalone HF layer + mask + rope used by mtp_reference, loaded with the main model's last
    layer weights, reproduces HF's own last layer (compared after the final norm)."""
    path, cfg = v3_ckpt if which == "v3" else v2_ckpt
    hf = load_hf_model(path)
    with torch.no_grad():
        out = hf.model(input_ids=torch.tensor([TOKENS]), output_hidden_states=True, use_cache=False)
    layer, rope, c, _ = load_mtp_block(path, 0)
    n = cfg.num_hidden_layers
    prefix = f"model.layers.{n - 1}."
    main = {k[len(prefix):]: v for k, v in read_tensors(path, lambda k: k.startswith(prefix)).items()}
    missing, unexpected = layer.load_state_dict(_block_state_dict(main, c), strict=False)
    assert not unexpected and all(k.endswith("e_score_correction_bias") for k in missing)
    L = len(TOKENS)
    pos = torch.arange(L)[None]
    x = out.hidden_states[n - 1]
    mask = torch.full((L, L), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        y = hf.model.norm(layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope(x, pos)))
    assert (y - out.last_hidden_state).abs().max() < 1e-5


def test_mtp_reference_uses_module_embed_when_present(tmp_path):
    """Without embed/head copies in the module the main ones are used: same result as with copies."""
    cfg = tiny_v3_config()
    a = make_checkpoint(tmp_path / "a", cfg, seed=4)
    b = make_checkpoint(tmp_path / "b", cfg, seed=4, mtp_with_embed_and_head=False)
    hidden = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    la, ba = mtp_reference(a, 0, [1, 2, 3, 4, 5], hidden, [1, 2, 3, 4, 5])
    lb, bb = mtp_reference(b, 0, [1, 2, 3, 4, 5], hidden, [1, 2, 3, 4, 5])
    assert torch.equal(la, lb) and torch.equal(ba, bb)
    with pytest.raises(KeyError):
        mtp_reference(a, 1, [1, 2], hidden[:2], [0, 1])
