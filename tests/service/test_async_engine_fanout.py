"""AsyncEngine.generate(share_prefix_with=...): n > 1 completions over the one engine loop, the
children on the parent's prompt blocks, each stream equal to the request run alone."""
import asyncio

import pytest

from mindspec import LLM, SamplingParams
from mindspec.service.async_engine import AsyncEngine

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n"


@pytest.fixture(scope="module")
def llm():
    return LLM(progress=False, cache_block_size=4)  # the shipped default: MTP K = 3


@pytest.fixture
def engine(llm):
    """Not started: the solo reference runs step the same engine first, from this thread."""
    eng = AsyncEngine(llm.engine)
    yield eng
    if eng._thread.ident is not None:  # started by the test
        eng.shutdown()


async def collect(stream):
    outs = [o async for o in stream]
    return outs[-1], "".join(o.new_text for o in outs)


def test_children_share_the_parents_prompt_and_stream_the_solo_tokens(llm, engine):
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=20, ignore_eos=True) for s in (7, 8, 9)]
    alone = [llm.generate([PROMPT], p)[0] for p in params]
    engine.start()

    async def fan_out():
        parent = engine.generate(PROMPT, params[0], "n-0")
        children = [engine.generate(PROMPT, p, f"n-{i}", share_prefix_with="n-0") for i, p in enumerate(params[1:], 1)]
        # the parent's stream is started first, so its request reaches the engine first
        first = asyncio.ensure_future(collect(parent))
        await asyncio.sleep(0)
        return await asyncio.gather(first, *(collect(c) for c in children))

    results = asyncio.run(fan_out())
    for (final, text), want in zip(results, alone):
        assert final.finished and final.token_ids == want.token_ids and text == want.text
    assert results[0][0].num_shared_prompt_tokens == 0
    assert all(final.num_shared_prompt_tokens > 0 for final, _ in results[1:])
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_unknown_parent_still_answers_with_a_full_prefill(llm, engine):
    params = SamplingParams(temperature=0, max_tokens=12)
    want = llm.generate([PROMPT], params)[0]
    engine.start()

    async def one():
        return await collect(engine.generate(PROMPT, params, "lonely", share_prefix_with="gone-long-ago"))

    final, text = asyncio.run(one())
    assert final.token_ids == want.token_ids and final.num_shared_prompt_tokens == 0
