"""Prefix caching end to end on the shipped model: with MTP off, eagle and vanilla, synchronous
and async scheduling, every token equals the one the same prompt gets from an engine without the
cache, on multi-turn conversations over a shared system prompt (prefixes that end mid-block),
under a block budget so small that cached blocks are evicted and sequences preempted; and every
block is free again once the requests end."""
import pytest

from mindspec import LLM, SamplingParams
from mindspec.config.defaults import default_model_dir

BLOCK = 4
SYSTEM = ("You are a coding assistant. Answer with short Python functions and explain each step.\n"
          "def add(a, b):\n    return a + b\n")
QUESTIONS = ["How do I reverse a list?", "Write a function that sums squares.", "What does zip do?"]
FOLLOW_UPS = ["Now make it faster.", "Add a docstring.", "Show an example call."]
MODES = {
    "mtp_off": None,
    "eagle": {"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "eagle", "adaptive_speculation": False},
    "vanilla": {"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "vanilla"},
}


def make_llm(mode, cached, num_blocks=600, **kw):
    return LLM(model=str(default_model_dir()), dtype="float32", cache_block_size=BLOCK, num_blocks=num_blocks,
               progress=False, plugin_params=MODES[mode], enable_prefix_caching=cached, **kw)


def greedy(n=16):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def conversations(llm):
    """Turn 1 and turn 2 prompts (token ids) of each conversation; turn 2 carries turn 1's
    answer, as a chat client resends it."""
    tok = llm.engine.tokenizer
    turns = []
    for q, f in zip(QUESTIONS, FOLLOW_UPS):
        first = tok.encode(SYSTEM + q)
        answer = llm.generate([first], greedy())[0].token_ids
        turns.append((first, first + answer + tok.encode("\n" + f)))
    return turns


@pytest.fixture(scope="module", params=list(MODES))
def mode(request):
    return request.param


@pytest.fixture(scope="module")
def reference(mode):
    """(prompts, their tokens) from an engine without the cache, one prompt at a time."""
    llm = make_llm(mode, cached=False)
    prompts = [p for turn in conversations(llm) for p in turn]
    return prompts, [llm.generate([p], greedy())[0].token_ids for p in prompts]


def all_blocks_free(llm):
    bm = llm.engine.block_manager
    return bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_usable_blocks and not llm.engine.requests


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_cached_prefixes_give_the_uncached_tokens(mode, reference, async_scheduling):
    prompts, want = reference
    llm = make_llm(mode, cached=True, async_scheduling=async_scheduling)
    solo = [llm.generate([p], greedy())[0] for p in prompts]
    assert [o.token_ids for o in solo] == want
    # the system prompt is cached after the first request; a turn 2 finds its whole turn 1
    assert solo[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= len(llm.engine.tokenizer.encode(SYSTEM)) - 2 * BLOCK for o in solo[1:])
    assert all(solo[i + 1].num_cached_tokens > solo[i].num_cached_tokens for i in range(0, len(prompts), 2))
    batched = llm.generate(prompts, greedy())  # hits and fresh prompts in one go
    assert [o.token_ids for o in batched] == want
    if async_scheduling:
        llm.engine.async_stepper.drain()
    assert all_blocks_free(llm)
    stats = llm.engine.block_manager.prefix_cache.stats
    assert stats.hit_tokens > 0 and 0 < stats.token_hit_rate < 1


def test_evictions_and_preemptions_under_a_tiny_budget_stay_lossless(mode, reference):
    prompts, want = reference
    longest = max(len(p) for p in prompts) + 16 + 8
    llm = make_llm(mode, cached=True, num_blocks=longest // BLOCK + 8)
    outs = llm.generate(prompts, greedy())
    assert [o.token_ids for o in outs] == want
    assert any(o.num_preemptions for o in outs)
    again = llm.generate(prompts[::-1], greedy())  # cached blocks are evicted to make room
    assert [o.token_ids for o in again] == want[::-1]
    assert llm.engine.block_manager.prefix_cache.stats.evictions > 0
    assert all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
def test_cached_blocks_are_never_written(mode):
    """Every cache layer's rows of a block (main and MTP) keep the bytes they had when the block
    was registered: while its own sequence goes on decoding (drafts, catch-up, rollbacks), and
    while later requests find it, prefill after it and decode."""
    import torch

    llm = make_llm(mode, cached=True)
    engine, bm, caches = llm.engine, llm.engine.block_manager, llm.engine.model_wrapper.caches
    state = engine.add_request(SYSTEM + QUESTIONS[0], greedy(40))
    seen = {}
    while not state.seq.is_finished:
        engine.step()
        for b in bm.prefix_cache.registered_blocks():
            seen.setdefault(b, [(c.c_kv[b].clone(), c.k_pe[b].clone()) for c in caches])
    assert len(seen) > 10
    outs = llm.generate([SYSTEM + q for q in QUESTIONS] + [SYSTEM + QUESTIONS[0] + FOLLOW_UPS[0]], greedy(24))
    assert all(o.num_cached_tokens > 0 for o in outs)
    assert set(seen) <= set(bm.prefix_cache.registered_blocks())  # none was evicted
    for b, rows in seen.items():
        assert all(torch.equal(kv, c.c_kv[b]) and torch.equal(pe, c.k_pe[b]) for (kv, pe), c in zip(rows, caches)), b


def test_prompt_logprobs_requests_compute_every_position():
    prompt = SYSTEM + QUESTIONS[0]
    llm = make_llm("mtp_off", cached=True)
    llm.generate([prompt], greedy())
    plain = make_llm("mtp_off", cached=False)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0)
    got = llm.generate([prompt], params)[0]
    assert got.num_cached_tokens == 0
    assert got.prompt_logprobs == pytest.approx(plain.generate([prompt], params)[0].prompt_logprobs, abs=1e-4)


def test_reset_forgets_the_cache():
    prompt = SYSTEM + QUESTIONS[1]
    llm = make_llm("mtp_off", cached=True)
    first = llm.generate([prompt], greedy())[0]
    assert llm.generate([prompt], greedy())[0].num_cached_tokens > 0
    assert llm.engine.reset_prefix_cache() > 0
    out = llm.generate([prompt], greedy())[0]
    assert out.num_cached_tokens == 0 and out.token_ids == first.token_ids
    assert all_blocks_free(llm) and llm.engine.block_manager.num_idle_blocks > 0
