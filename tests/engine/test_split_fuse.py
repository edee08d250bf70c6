"""SplitFuse end to end on the shipped model: prompts arriving while others decode are prefilled
in chunks inside the decode steps, and every token equals MTP off without SplitFuse, for MTP off,
vanilla (adaptive) and eagle, with and without prefix caching, with and without async
scheduling, and under a block budget that preempts; a chunked prefill leaves the MTP caches as a
whole prefill does; prompt logprobs are unchanged."""
import numpy as np
import pytest

from mindspec import LLM, SamplingParams
from mindspec.bench.corpus import heldout_prompts
from mindspec.config.defaults import default_model_dir

BLOCK = 4
CHUNK = 24
MODES = {
    "mtp_off": None,
    "vanilla": {"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "vanilla"},
    "eagle": {"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "eagle", "adaptive_speculation": False},
}


def make_llm(mode, num_blocks=800, **kw):
    return LLM(model=str(default_model_dir()), dtype="float32", cache_block_size=BLOCK, num_blocks=num_blocks,
               progress=False, plugin_params=MODES[mode], **kw)


def greedy(n=16):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    tok = make_llm("mtp_off").tokenizer.hf_tokenizer
    shared = heldout_prompts(tok, 1, 40, seed=5)[0]
    lengths = (12, 70, 9, 45, 100, 30)
    own = [heldout_prompts(tok, 1, n, seed=10 + i)[0][1:] for i, n in enumerate(lengths)]
    return [shared + o if i % 2 else o for i, o in enumerate(own)]  # half share a prefix


@pytest.fixture(scope="module")
def expected(prompts):
    llm = make_llm("mtp_off")
    return [llm.generate([p], greedy())[0].token_ids for p in prompts]


def staggered(llm, prompts, params, steps_between=2):
    """Each prompt arrives a few steps after the one before, while those decode; every step's
    batch is recorded. -> (outputs in prompt order, batches)."""
    engine, batches = llm.engine, []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        if batch is not None:
            batches.append((batch.is_mixed, [(q.seq_id, c) for q, c in zip(batch.seqs, batch.chunks or [])]))
        return batch

    engine.scheduler.schedule = recording
    states = []
    for i, p in enumerate(prompts):
        states.append(engine.add_request(p, params, request_id=str(i)))
        for _ in range(steps_between):
            engine.step()
    outs = engine.run(states)
    if engine.async_stepper is not None:
        engine.async_stepper.drain()
    engine.scheduler.schedule = schedule
    return outs, batches


def all_blocks_free(llm):
    bm = llm.engine.block_manager
    return bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_usable_blocks and not llm.engine.requests


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "prefix-cache"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_split_fuse_gives_the_tokens_of_mtp_off(prompts, expected, mode, cached, async_scheduling):
    llm = make_llm(mode, split_fuse=True, split_chunk_tokens=CHUNK, enable_prefix_caching=cached,
                   async_scheduling=async_scheduling)
    outs, batches = staggered(llm, prompts, greedy())
    assert [o.token_ids for o in outs] == expected
    mixed = [[c for _, c in rows] for is_mixed, rows in batches if is_mixed]
    assert any(0 in c and any(c) for c in mixed)  # decode rows and prefill chunks shared steps
    for c in mixed:  # within the budget (a final chunk may take lookahead + 2 rows beyond it)
        assert sum(c) + c.count(0) <= max(CHUNK, c.count(0) + 5)
    chunked = [seq_id for is_mixed, rows in batches for seq_id, c in rows if c]
    assert max(chunked.count(i) for i in set(chunked)) >= 3  # a long prompt took several steps
    if mode != "mtp_off":
        assert sum(o.spec_decode.num_accepted_tokens for o in outs) > 0
    if cached:
        assert any(o.num_cached_tokens for o in outs)
    assert all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "prefix-cache"])
def test_preemption_while_prompts_are_chunked_stays_lossless(prompts, expected, mode, cached):
    """A block budget for little more than the longest prompt: decoding sequences are preempted
    while others are chunked, and with prefix caching cached blocks are evicted too."""
    longest = max(len(p) for p in prompts) + 16 + 8
    llm = make_llm(mode, num_blocks=longest // BLOCK + 3, split_fuse=True, split_chunk_tokens=CHUNK,
                   enable_prefix_caching=cached)
    outs, _ = staggered(llm, prompts + prompts[::-1], greedy(), steps_between=1)
    assert [o.token_ids for o in outs] == expected + expected[::-1]
    assert any(o.num_preemptions for o in outs)
    if cached:
        assert llm.engine.block_manager.prefix_cache.stats.evictions > 0
    assert all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
def test_a_chunked_prefill_writes_the_caches_a_whole_prefill_writes(prompts, mode):
    """Main and MTP cache entries of every prompt position before the last K + 1 (those pair
    positions with generated tokens) equal a whole prefill's."""
    prompt = prompts[4]

    def caches_after_prefill(**kw):
        llm = make_llm(mode, **kw)
        engine = llm.engine
        state = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        table = None
        while not state.seq.is_finished:
            engine.step()
            table = list(state.seq.block_table) or table
        pos = np.arange(len(prompt) - 4)
        slots = np.asarray(table)[pos // BLOCK] * BLOCK + pos % BLOCK
        return [c.c_kv[slots // BLOCK, slots % BLOCK].clone() for c in engine.model_wrapper.caches]

    whole = caches_after_prefill()
    chunked = caches_after_prefill(split_fuse=True, split_chunk_tokens=CHUNK)
    assert len(whole) == len(chunked) > make_llm("mtp_off").engine.model_wrapper.model.cfg.num_hidden_layers
    for a, b in zip(whole, chunked):
        assert (a - b).abs().max().item() < 1e-4


def test_prompt_logprobs_under_split_fuse(prompts):
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1)
    want = make_llm("mtp_off").generate([prompts[4]], params)[0]
    llm = make_llm("vanilla", split_fuse=True, split_chunk_tokens=CHUNK)
    outs, _ = staggered(llm, [prompts[0], prompts[4]], params)
    assert outs[1].token_ids == want.token_ids
    assert outs[1].prompt_logprobs == pytest.approx(want.prompt_logprobs, abs=1e-4)


def test_plugin_type_splitfuse_turns_it_on(prompts, expected):
    llm = LLM(model=str(default_model_dir()), dtype="float32", cache_block_size=BLOCK, num_blocks=800, progress=False,
              plugin_params={"plugin_type": "mtp,splitfuse,prefix_cache", "num_speculative_tokens": 2},
              split_chunk_tokens=CHUNK)
    assert llm.engine.scheduler.config.split_fuse and llm.engine.prefix_caching
    outs, batches = staggered(llm, prompts[:3], greedy())
    assert [o.token_ids for o in outs] == expected[:3] and any(m for m, _ in batches)
