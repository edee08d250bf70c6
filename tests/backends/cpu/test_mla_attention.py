import pytest
import torch

import op_references as ref
from mindspec.backends.cpu import CpuBackend

H, DN, DV, R, P, BS, NB = 3, 8, 6, 16, 4, 4, 32
SCALE = (DN + P) ** -0.5


def _weights(g):
    return torch.randn(H, DN, R, generator=g) * 0.3, torch.randn(H, DV, R, generator=g) * 0.3


def _setup(seq_lens, q_lens, seed=0, skip_slots=(), tree_mask=None, is_prefill=False):
    """Random latents for every token of each sequence; context written to the cache up front,
    new tokens written through meta.slots (so skipped slots stay zero in the cache)."""
    be = CpuBackend()
    g = torch.Generator().manual_seed(seed)
    meta, all_slots = ref.paged_metadata(seq_lens, q_lens, BS, NB, seed=seed, skip_slots=skip_slots,
                                         tree_mask=tree_mask, is_prefill=is_prefill)
    cache = be.allocate_latent_cache(NB, BS, R, P, torch.float32)
    seqs = []
    for s, q, slots in zip(seq_lens, q_lens, all_slots):
        c_kv, k_pe = torch.randn(s, R, generator=g), torch.randn(s, P, generator=g)
        be.write_latent_cache(cache, c_kv[: s - q], k_pe[: s - q], torch.tensor(slots[: s - q]))
        seqs.append((c_kv, k_pe))
    new_c = torch.cat([c[s - q:] for (c, _), s, q in zip(seqs, seq_lens, q_lens)])
    new_pe = torch.cat([k[s - q:] for (_, k), s, q in zip(seqs, seq_lens, q_lens)])
    be.write_latent_cache(cache, new_c, new_pe, meta.slots)
    T = sum(q_lens)
    q_nope, q_pe = torch.randn(T, H, DN, generator=g), torch.randn(T, H, P, generator=g)
    # What the reference sees: a skipped token's latent was never stored, so its cache row is zero.
    t0 = 0
    for b, (s, q) in enumerate(zip(seq_lens, q_lens)):
        for i in range(q):
            if (t0 + i) in skip_slots:
                seqs[b][0][s - q + i] = 0
                seqs[b][1][s - q + i] = 0
        t0 += q
    return be, cache, meta, seqs, q_nope, q_pe


def _absorbed(be, cache, meta, q_nope, q_pe, w_uk, w_uv):
    q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)
    o_lat = be.mla_attention(q_lat, q_pe, cache, meta, SCALE)
    assert o_lat.shape == q_lat.shape and o_lat.dtype == q_lat.dtype
    return torch.einsum("thr,hvr->thv", o_lat, w_uv)


def _reference(meta, seqs, q_nope, q_pe, w_uk, w_uv):
    outs, t0 = [], 0
    for b, (s, q) in enumerate(zip(meta.seq_lens_host, meta.q_lens_host)):
        tree = None if meta.tree_mask is None else meta.tree_mask[b, :q, :q]
        mask = ref.causal_end_mask(q, s, tree)
        c_kv, k_pe = seqs[b]
        outs.append(ref.expanded_mla(q_nope[t0:t0 + q], q_pe[t0:t0 + q], c_kv, k_pe, w_uk, w_uv, SCALE, mask))
        t0 += q
    return torch.cat(outs)


@pytest.mark.parametrize("q_len", [1, 4])
def test_absorbed_matches_expanded(q_len):
    seq_lens = [3, 9, 17]
    q_lens = [min(q_len, s) for s in seq_lens]
    be, cache, meta, seqs, q_nope, q_pe = _setup(seq_lens, q_lens, seed=q_len)
    w_uk, w_uv = _weights(torch.Generator().manual_seed(10))
    out = _absorbed(be, cache, meta, q_nope, q_pe, w_uk, w_uv)
    torch.testing.assert_close(out.double(), _reference(meta, seqs, q_nope, q_pe, w_uk, w_uv), atol=1e-5, rtol=1e-5)


def test_prefill_chunks_beside_decode_rows_attend_in_groups():
    """SplitFuse batches: sequences with more than GROUP_ROWS new tokens (chunks after cached
    context, one from position 0) attend apart from the decode rows; same result as the expanded
    reference, sequence by sequence."""
    from backends.cpu.attention_plan import GROUP_ROWS, attention_groups

    seq_lens, q_lens = [7, 40, 3, 30, 20], [1, 20, 3, GROUP_ROWS + 1, 20]
    be, cache, meta, seqs, q_nope, q_pe = _setup(seq_lens, q_lens, seed=8)
    groups = attention_groups(meta, torch.device("cpu"))
    assert [g.meta.q_lens_host for g in groups] == [[1, 3], [20], [17], [20]]
    w_uk, w_uv = _weights(torch.Generator().manual_seed(12))
    be.prepare(meta)
    out = _absorbed(be, cache, meta, q_nope, q_pe, w_uk, w_uv)
    torch.testing.assert_close(out.double(), _reference(meta, seqs, q_nope, q_pe, w_uk, w_uv), atol=1e-5, rtol=1e-5)


def test_mixed_q_lens_and_skipped_slots():
    seq_lens, q_lens = [5, 9, 17, 1], [1, 4, 3, 1]
    skip = (2, 7)  # a new token of sequence 1 and of sequence 2 are not written
    be, cache, meta, seqs, q_nope, q_pe = _setup(seq_lens, q_lens, seed=5, skip_slots=skip)
    w_uk, w_uv = _weights(torch.Generator().manual_seed(11))
    out = _absorbed(be, cache, meta, q_nope, q_pe, w_uk, w_uv)
    torch.testing.assert_close(out.double(), _reference(meta, seqs, q_nope, q_pe, w_uk, w_uv), atol=1e-5, rtol=1e-5)
    # the skipped tokens' rows really are empty in the cache
    _, all_slots = ref.paged_metadata(seq_lens, q_lens, BS, NB, seed=5)
    for t in skip:
        s = meta.slots.tolist()
        assert s[t] == -1
    flat_slots = [sl for b, (sq, q) in enumerate(zip(seq_lens, q_lens)) for sl in all_slots[b][sq - q:]]
    for t in skip:
        slot = flat_slots[t]
        assert torch.count_nonzero(cache.c_kv[slot // BS, slot % BS]) == 0


def test_tree_mask():
    seq_lens, q_lens = [9, 17, 6], [4, 3, 4]
    g = torch.Generator().manual_seed(3)
    tree = torch.rand(3, 4, 4, generator=g) < 0.5
    tree |= torch.eye(4, dtype=torch.bool)
    tree[1, :, 3] = True  # entries past q_len must be ignored (padding)
    tree[:, 0, 1:] = False
    be, cache, meta, seqs, q_nope, q_pe = _setup(seq_lens, q_lens, seed=7, tree_mask=tree)
    w_uk, w_uv = _weights(torch.Generator().manual_seed(12))
    out = _absorbed(be, cache, meta, q_nope, q_pe, w_uk, w_uv)
    expected = _reference(meta, seqs, q_nope, q_pe, w_uk, w_uv)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # and a tree mask that is plain causal gives the causal result
    # (a changed mask on the same metadata is followed: the plan adds the mask's part on the device)
    meta.tree_mask = torch.tril(torch.ones(3, 4, 4, dtype=torch.bool))
    causal = _absorbed(be, cache, meta, q_nope, q_pe, w_uk, w_uv)
    assert not torch.allclose(causal, out)
    meta.tree_mask = None
    meta.scratch.clear()  # a forward without a tree mask plans again
    torch.testing.assert_close(causal, _absorbed(be, cache, meta, q_nope, q_pe, w_uk, w_uv), atol=1e-6, rtol=1e-6)


def test_prefill_equals_absorbed_attention():
    seq_lens = [3, 9, 17]
    be, cache, meta, seqs, q_nope, q_pe = _setup(seq_lens, seq_lens, seed=9, is_prefill=True)
    w_uk, w_uv = _weights(torch.Generator().manual_seed(13))
    c_kv = torch.cat([c for c, _ in seqs])
    k_pe = torch.cat([k for _, k in seqs])
    k_nope = torch.einsum("tr,hdr->thd", c_kv, w_uk)
    v = torch.einsum("tr,hvr->thv", c_kv, w_uv)
    out = be.mla_prefill(q_nope, q_pe, k_nope, k_pe, v, meta, SCALE)
    assert out.shape == (sum(seq_lens), H, DV)
    expected = _reference(meta, seqs, q_nope, q_pe, w_uk, w_uv)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, _absorbed(be, cache, meta, q_nope, q_pe, w_uk, w_uv), atol=1e-5, rtol=1e-5)


def test_bf16_close_to_fp32():
    seq_lens, q_lens = [9, 17], [4, 1]
    be, cache, meta, seqs, q_nope, q_pe = _setup(seq_lens, q_lens, seed=4)
    q_lat = torch.einsum("thd,hdr->thr", q_nope, _weights(torch.Generator().manual_seed(1))[0])
    ref32 = be.mla_attention(q_lat, q_pe, cache, meta, SCALE)
    cache16 = be.allocate_latent_cache(NB, BS, R, P, torch.bfloat16)
    cache16.c_kv.copy_(cache.c_kv)
    cache16.k_pe.copy_(cache.k_pe)
    out = be.mla_attention(q_lat.bfloat16(), q_pe.bfloat16(), cache16, meta, SCALE)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref32, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("q_lens, tree", [([1, 1, 1], False), ([4, 4, 4], False), ([4, 1, 3], False),
                                          ([4, 3, 4], True)])
def test_plan_computed_from_step_tensors_equals_the_host_plan(q_lens, tree):
    """An exported step binds its metadata to step_tensors and computes the plan from the lengths
    and block tables inside: the same mask, cache rows and attention as the plan built on the host."""
    from backends.cpu.attention_plan import PLAN_KEY, ROWS_KEY, attention_plan, cache_rows

    seq_lens = [9, 17, 6]
    mask = None
    if tree:
        mask = (torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(5)) < 0.5) | torch.eye(4, dtype=torch.bool)
    be, cache, meta, seqs, q_nope, q_pe = _setup(seq_lens, q_lens, seed=4, tree_mask=mask)
    meta.block_size = BS  # what an engine's metadata carries (the exported step's cache rows need it)
    tensors = [t for t, _ in be.step_tensors(meta, "m")]
    bound = be.bind_step_tensors(meta, tensors)
    assert PLAN_KEY in bound.scratch and not meta.scratch  # nothing was planned on the host
    host, traced = attention_plan(meta, meta.slots.device), attention_plan(bound, meta.slots.device)
    assert torch.equal(traced.bias, host.bias)
    assert torch.equal(cache_rows(bound, BS, meta.slots.device), cache_rows(meta, BS, meta.slots.device))
    assert (traced.tok_seq is None) == (len(set(q_lens)) == 1)
    w_uk, w_uv = _weights(torch.Generator().manual_seed(2))
    out = _absorbed(be, cache, bound, q_nope, q_pe, w_uk, w_uv)
    torch.testing.assert_close(out.double(), _reference(meta, seqs, q_nope, q_pe, w_uk, w_uv), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [4, 4, 4], [4, 1, 3]])
def test_compiled_attention_equals_the_expanded_reference(q_lens):
    """Inside a compiled step (Inductor, the packages' compiler) the attention binds its metadata
    from step tensors and takes its traced branch: the same attention as the expanded reference."""
    seq_lens = [9, 17, 6]
    be, cache, meta, seqs, q_nope, q_pe = _setup(seq_lens, q_lens, seed=6)
    meta.block_size = BS
    w_uk, w_uv = _weights(torch.Generator().manual_seed(7))
    q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)
    tensors = [t for t, _ in be.step_tensors(meta, "m")]

    def step(q_lat, q_pe, *tensors):
        return be.mla_attention(q_lat, q_pe, cache, be.bind_step_tensors(meta, list(tensors)), SCALE)

    torch._dynamo.reset()
    o_lat = torch.compile(step, backend="inductor", fullgraph=True, dynamic=False)(q_lat, q_pe, *tensors)
    out = torch.einsum("thr,hvr->thv", o_lat, w_uv)
    torch.testing.assert_close(out.double(), _reference(meta, seqs, q_nope, q_pe, w_uk, w_uv), atol=1e-5, rtol=1e-5)
