"""The torch_npu reference refuses what the documented ops refuse (so a backend that passes it
passes the real checks), and models only what it claims to. Each case starts from arguments the op
accepts and changes one thing."""
import pytest
import torch

from tests.support.torch_npu_reference import NotModelled, OpRefused

BF = torch.bfloat16


def _mask():
    return torch.triu(torch.ones(2048, 2048, dtype=torch.int8), diagonal=1)


def _fia_v2(**change):
    """Valid MLA decode: 2 requests, 4 query tokens each, 32 heads, paged cache of 16-token blocks."""
    args = dict(query=torch.randn(8, 32, 512).to(BF), key=torch.randn(6, 16, 512).to(BF))
    args["value"] = args["key"]
    kw = dict(query_rope=torch.randn(8, 32, 64).to(BF), key_rope=torch.randn(6, 16, 64).to(BF), atten_mask=_mask(),
              actual_seq_qlen=[4, 8], actual_seq_kvlen=[10, 20], block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
              num_query_heads=32, num_key_value_heads=1, softmax_scale=0.1, input_layout="TND", sparse_mode=3,
              block_size=16)
    for k, v in change.items():
        (args if k in args else kw)[k] = v
    return args, kw


def _fia_v1(**change):
    """Valid TND prefill: D 128 + rope 64, bfloat16, cumulative lengths."""
    t = lambda *s: torch.randn(*s).to(BF)  # noqa: E731
    args = dict(query=t(6, 4, 128), key=t(6, 4, 128), value=t(6, 4, 128))
    kw = dict(query_rope=t(6, 4, 64), key_rope=t(6, 4, 64), atten_mask=_mask(), actual_seq_lengths=[2, 6],
              actual_seq_lengths_kv=[2, 6], num_heads=4, num_key_value_heads=4, scale=0.1, input_layout="TND",
              sparse_mode=3)
    for k, v in change.items():
        (args if k in args else kw)[k] = v
    return args, kw


FIA_V2_REFUSED = {
    "query fp32": (dict(query=torch.randn(8, 32, 512), query_rope=torch.randn(8, 32, 64)), "dtype"),
    "16 heads": (dict(query=torch.randn(8, 16, 512).to(BF), query_rope=torch.randn(8, 16, 64).to(BF), num_query_heads=16),
                 "32, 64 or 128 query heads"),
    "kv heads 2": (dict(num_key_value_heads=2), "1 key/value head"),
    "int64 block table": (dict(block_table=torch.tensor([[0, 1], [2, 3]])), "int32"),
    "no block table": (dict(block_table=None), "page attention"),
    "block size 32": (dict(key=torch.randn(3, 32, 512).to(BF), value=None, key_rope=torch.randn(3, 32, 64).to(BF),
                           block_size=32), "block_size must be 16 or 128"),
    "tensor lengths": (dict(actual_seq_kvlen=torch.tensor([10, 20])), "host list"),
    "non-cumulative q": (dict(actual_seq_qlen=[4, 3]), "cumulative"),
    "q ends short": (dict(actual_seq_qlen=[4, 7]), "token count"),
    "17 queries": (dict(query=torch.randn(17, 32, 512).to(BF), query_rope=torch.randn(17, 32, 64).to(BF),
                        actual_seq_qlen=[17], actual_seq_kvlen=[20], block_table=torch.tensor([[0, 1]], dtype=torch.int32)),
                   "1..16 query tokens"),
    "kv shorter than q": (dict(actual_seq_kvlen=[3, 20]), "only 3 key tokens"),
    "kv beyond table": (dict(actual_seq_kvlen=[40, 20]), "blocks"),
    "cumulative kv count": (dict(actual_seq_kvlen=[10]), "per request"),
    "no mask for K+1": (dict(atten_mask=None), "2048"),
    "sparse 0 for K+1": (dict(sparse_mode=0), "sparse_mode 3"),
    "small mask": (dict(atten_mask=_mask()[:512, :512]), "2048 x 2048"),
    "float mask": (dict(atten_mask=_mask().float()), "atten_mask dtype"),
    "lower mask": (dict(atten_mask=_mask().T.contiguous()), "triu"),
    "rope alone": (dict(key_rope=None), "together"),
    "non-contiguous q": (dict(query=torch.randn(32, 8, 512).to(BF).transpose(0, 1)), "contiguous"),
    "lse with D 512": (dict(return_softmax_lse=True), "lse"),
}


@pytest.mark.parametrize("case", sorted(FIA_V2_REFUSED))
def test_fia_v2_refuses(npu_ref, case):
    change, message = FIA_V2_REFUSED[case]
    args, kw = _fia_v2(**change)
    if args["value"] is None:
        args["value"] = args["key"]
    with pytest.raises(OpRefused, match=message):
        npu_ref.npu_fused_infer_attention_score_v2(**args, **kw)


def test_fia_v2_single_token_takes_no_mask(npu_ref):
    one = dict(query=torch.randn(2, 32, 512).to(BF), query_rope=torch.randn(2, 32, 64).to(BF), actual_seq_qlen=[1, 2])
    args, kw = _fia_v2(**one)
    with pytest.raises(OpRefused, match="sparse_mode 0 and no mask"):
        npu_ref.npu_fused_infer_attention_score_v2(**args, **kw)
    args, kw = _fia_v2(**one, sparse_mode=0, atten_mask=None)
    out, _ = npu_ref.npu_fused_infer_attention_score_v2(**args, **kw)
    assert out.shape == (2, 32, 512)


def test_fia_accepts_the_valid_calls(npu_ref):
    args, kw = _fia_v2()
    assert npu_ref.npu_fused_infer_attention_score_v2(**args, **kw)[0].shape == (8, 32, 512)
    args, kw = _fia_v2(input_layout="TND_NTD")
    assert npu_ref.npu_fused_infer_attention_score_v2(**args, **kw)[0].shape == (32, 8, 512)
    args, kw = _fia_v1(softmax_lse_flag=True)
    out, lse = npu_ref.npu_fused_infer_attention_score(**args, **kw)
    assert out.shape == (6, 4, 128) and lse.shape == (6, 4, 1) and lse.dtype == torch.float32


FIA_V1_REFUSED = {
    "fp16 prefill": (dict(query=torch.randn(6, 4, 128).half()), "dtype"),
    "D 64": (dict(query=torch.randn(6, 4, 64).to(BF)), "D must be 512 or 128"),
    "paged prefill": (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), "page attention is not supported"),
    "ratio above 64": (dict(query=torch.randn(6, 130, 128).to(BF), query_rope=torch.randn(6, 130, 64).to(BF),
                            key=torch.randn(6, 2, 128).to(BF), value=torch.randn(6, 2, 128).to(BF),
                            key_rope=torch.randn(6, 2, 64).to(BF), num_heads=130, num_key_value_heads=2), "ratio <= 64"),
    "kv shorter": (dict(actual_seq_lengths=[3, 6], actual_seq_lengths_kv=[2, 6]), "query length <= key length"),
    "sparse 2": (dict(sparse_mode=2), "sparse_mode 0 or 3"),
    "sparse 0 with mask": (dict(sparse_mode=0), "takes no mask"),
    "uneven lists": (dict(actual_seq_lengths_kv=[6]), "one entry per request"),
}


@pytest.mark.parametrize("case", sorted(FIA_V1_REFUSED))
def test_fia_v1_refuses(npu_ref, case):
    change, message = FIA_V1_REFUSED[case]
    args, kw = _fia_v1(**change)
    with pytest.raises(OpRefused, match=message):
        npu_ref.npu_fused_infer_attention_score(**args, **kw)


def test_fia_not_modelled_modes(npu_ref):
    args, kw = _fia_v2(input_layout="BSND")
    with pytest.raises(NotModelled):
        npu_ref.npu_fused_infer_attention_score_v2(**args, **kw)
    args, kw = _fia_v2(query_rope=None, key_rope=None)
    with pytest.raises(NotModelled):
        npu_ref.npu_fused_infer_attention_score_v2(**args, **kw)


def _kv_cache_args(**change):
    kv = dict(kv=torch.randn(3, 1, 1, 576).to(BF), gamma=torch.ones(512).to(BF), cos=torch.randn(3, 1, 1, 64).to(BF),
              sin=torch.randn(3, 1, 1, 64).to(BF), index=torch.tensor([0, 5, -1]),
              k_cache=torch.zeros(2, 16, 1, 64).to(BF), ckv_cache=torch.zeros(2, 16, 1, 512).to(BF))
    kv.update(change)
    return kv


@pytest.mark.parametrize("change,message", [
    (dict(index=torch.tensor([0, 5, -1], dtype=torch.int32)), "int64"),
    (dict(index=torch.tensor([0, 5, 5])), "repeated"),
    (dict(index=torch.tensor([0, 5, 32])), "beyond the cache"),
    (dict(kv=torch.randn(3, 1, 1, 576)), "dtype"),
    (dict(kv=torch.randn(3, 1, 1, 320).to(BF)), "576"),
    (dict(cos=torch.randn(3, 1, 1, 64)), "cos dtype"),
    (dict(k_cache=torch.zeros(2, 16, 64).to(BF)), "k_cache must be"),
    (dict(ckv_cache=torch.zeros(2, 16, 1, 1024).to(BF)[..., :512]), "contiguous"),
])
def test_kv_rmsnorm_rope_cache_refuses(npu_ref, change, message):
    with pytest.raises(OpRefused, match=message):
        npu_ref.npu_kv_rmsnorm_rope_cache(**_kv_cache_args(**change), cache_mode="PA", is_output_kv=True)


def test_kv_rmsnorm_rope_cache_skips_negative_slots(npu_ref):
    args = _kv_cache_args()
    _, _, k_embed, y = npu_ref.npu_kv_rmsnorm_rope_cache(**args, cache_mode="PA", is_output_kv=True)
    flat = args["ckv_cache"].view(-1, 512)
    assert torch.equal(flat[0], y[0, 0, 0]) and torch.equal(flat[5], y[1, 0, 0])
    assert int((flat.abs().sum(-1) > 0).sum()) == 2  # the -1 token wrote nowhere
    with pytest.raises(NotModelled):
        npu_ref.npu_kv_rmsnorm_rope_cache(**args, cache_mode="PA_NZ")


@pytest.mark.parametrize("change,message", [
    (dict(x=torch.randn(4, 256, dtype=torch.float64)), "dtype"),
    (dict(k_group=2), "k_group 4"),
    (dict(bias=None), "bias"),
    (dict(k=40), "k <= 32"),
    (dict(x=torch.randn(4, 128), bias=torch.randn(128)), "256 experts"),
    (dict(group_count=3), "groups of more than 2"),
    (dict(renorm=1), "renorm must be 0"),
    (dict(bias=torch.randn(256).half()), "bias must be"),
])
def test_gating_top_k_refuses(npu_ref, change, message):
    kw = dict(x=torch.randn(4, 256), k=8, bias=torch.randn(256), k_group=4, group_count=8, group_select_mode=1,
              norm_type=1)
    kw.update(change)
    with pytest.raises(OpRefused, match=message):
        npu_ref.npu_moe_gating_top_k(kw.pop("x"), kw.pop("k"), **kw)


def test_gating_softmax_is_not_modelled(npu_ref):
    with pytest.raises(NotModelled):
        npu_ref.npu_moe_gating_top_k(torch.randn(2, 256), 8, bias=torch.randn(256), k_group=4, group_count=8, norm_type=0)


def test_moe_routing_contracts(npu_ref):
    x, ids = torch.randn(3, 8), torch.tensor([[2, 0], [1, 2], [0, 3]], dtype=torch.int32)
    ok = dict(active_num=6, expert_num=4, expert_tokens_num_type=1, expert_tokens_num_flag=True,
              active_expert_range=[0, 4], quant_mode=-1)
    ex, row_idx, counts, _ = npu_ref.npu_moe_init_routing_v2(x, ids, **ok)
    # stable sort by expert of flat pairs [2,0,1,2,0,3] -> order [1,4,2,0,3,5]; gather index is its inverse
    assert row_idx.tolist() == [3, 0, 2, 4, 1, 5] and counts.tolist() == [2, 1, 2, 1]
    assert torch.equal(ex, x[torch.tensor([1, 4, 2, 0, 3, 5]) // 2])
    _, scatter_idx, _, _ = npu_ref.npu_moe_init_routing_v2(x, ids, **ok, row_idx_type=1)
    assert scatter_idx.tolist() == [1, 4, 2, 0, 3, 5]
    for change, message in [(dict(active_num=5), "active_num"), (dict(expert_tokens_num_flag=False), "flag"),
                            (dict(drop_pad_mode=1), "drop_pad_mode"), (dict(expert_tokens_num_type=0), "1 or 2"),
                            (dict(active_expert_range=[0, 5]), "active_expert_range")]:
        with pytest.raises(OpRefused, match=message):
            npu_ref.npu_moe_init_routing_v2(x, ids, **{**ok, **change})
    with pytest.raises(OpRefused, match="int32"):
        npu_ref.npu_moe_init_routing_v2(x, ids.long(), **ok)
    with pytest.raises(OpRefused, match="expert ids"):
        npu_ref.npu_moe_init_routing_v2(x, ids + 2, **ok)


def test_grouped_matmul_and_unpermute_contracts(npu_ref):
    x, w = torch.randn(5, 4), torch.randn(3, 4, 6)
    counts = torch.tensor([2, 0, 3])
    (out,) = npu_ref.npu_grouped_matmul([x], [w], group_list=counts, split_item=2, group_type=0, group_list_type=1)
    torch.testing.assert_close(out, torch.cat([x[:2] @ w[0], x[2:] @ w[2]]))
    (out_cum,) = npu_ref.npu_grouped_matmul([x], [w], group_list=counts.cumsum(0), split_item=2, group_type=0)
    torch.testing.assert_close(out_cum, out)
    for kw, message in [(dict(group_list=counts.int()), "int64"), (dict(group_list=torch.tensor([2, 0, 4])), "fit in M"),
                        (dict(group_list=torch.tensor([2, -1, 3])), ">= 0")]:
        with pytest.raises(OpRefused, match=message):
            npu_ref.npu_grouped_matmul([x], [w], split_item=2, group_type=0, group_list_type=1, **kw)
    with pytest.raises(OpRefused, match="weight dtype"):
        npu_ref.npu_grouped_matmul([x], [w.half()], group_list=counts, split_item=2, group_type=0, group_list_type=1)
    rows, probs = torch.randn(6, 3), torch.rand(3, 2)
    idx = torch.tensor([5, 0, 2, 1, 4, 3], dtype=torch.int32)
    out = npu_ref.npu_moe_token_unpermute(rows, idx, probs=probs)
    torch.testing.assert_close(out[1], probs[1, 0] * rows[2] + probs[1, 1] * rows[1])
    for bad, message in [(idx.long(), "int32"), (torch.tensor([5, 0, 2, 1, 4, 4], dtype=torch.int32), "repeated")]:
        with pytest.raises(OpRefused, match=message):
            npu_ref.npu_moe_token_unpermute(rows, bad, probs=probs)
    with pytest.raises(OpRefused, match="probs dtype"):
        npu_ref.npu_moe_token_unpermute(rows, idx, probs=probs.half())


def test_small_op_contracts(npu_ref):
    with pytest.raises(OpRefused, match="D must be 64"):
        npu_ref.npu_interleave_rope(torch.randn(2, 1, 1, 32).half(), torch.randn(2, 1, 1, 32).half(),
                                    torch.randn(2, 1, 1, 32).half())
    with pytest.raises(OpRefused, match="dtype"):
        npu_ref.npu_interleave_rope(torch.randn(2, 1, 1, 64), torch.randn(2, 1, 1, 64), torch.randn(2, 1, 1, 64))
    with pytest.raises(OpRefused, match="gamma dtype"):
        npu_ref.npu_rms_norm(torch.randn(2, 8).half(), torch.ones(8))
    with pytest.raises(OpRefused, match="odd"):
        npu_ref.npu_swiglu(torch.randn(2, 7))
    logits = torch.randn(2, 2000)
    with pytest.raises(OpRefused, match="1024"):
        npu_ref.npu_top_k_top_p(logits, torch.ones(2), torch.tensor([5, 1500], dtype=torch.int32))
    with pytest.raises(OpRefused, match="int32"):
        npu_ref.npu_top_k_top_p(logits, torch.ones(2), torch.tensor([5, 10]))
    with pytest.raises(OpRefused, match="slot_mapping"):
        npu_ref.npu_scatter_pa_kv_cache(torch.randn(2, 1, 8).half(), torch.randn(2, 1, 4).half(),
                                        torch.zeros(2, 4, 1, 8).half(), torch.zeros(2, 4, 1, 4).half(),
                                        torch.tensor([0.0, 1.0]))
