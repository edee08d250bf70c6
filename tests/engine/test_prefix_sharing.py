"""n > 1 completions sharing the prompt's KV blocks (LLMEngine.add_request(share_prefix_with=...)):
the children take the parent's final prompt blocks and compute only the prompt's tail, and every
token is the one the same request produces alone, with MTP off, eagle and vanilla."""
import pytest

from mindspec import LLM, SamplingParams
from mindspec.config.defaults import default_model_dir
from mindspec.text_generator.step import StepBatch

BLOCK = 4
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n"
MODES = {
    "mtp_off": None,
    "eagle": {"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "eagle", "adaptive_speculation": False},
    "vanilla": {"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "vanilla", "adaptive_speculation": False},
}


def make_llm(mode, num_blocks=400, **kw):
    return LLM(model=str(default_model_dir()), dtype="float32", cache_block_size=BLOCK, num_blocks=num_blocks,
               progress=False, plugin_params=MODES[mode], **kw)


@pytest.fixture(scope="module", params=list(MODES))
def llm(request):
    return make_llm(request.param)


def greedy(n=30):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def solo(llm, params, prompt=PROMPT):
    return llm.generate([prompt], params)[0]


def run_family(engine, params_list, share=True, prompt=PROMPT):
    """Parent then children sharing its prefix; steps to the end. (outputs, peak used blocks)."""
    states = [engine.add_request(prompt, params_list[0], request_id="p")]
    for i, params in enumerate(params_list[1:]):
        states.append(engine.add_request(prompt, params, request_id=f"c{i}", share_prefix_with="p" if share else None))
    finals, peak = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        peak = max(peak, engine.block_manager.num_used_blocks)
    return [finals[s.request_id] for s in states], peak


def all_blocks_free(engine):
    bm = engine.block_manager
    return bm.num_free_blocks == bm.num_usable_blocks and bm.num_used_blocks == 0 and not engine.requests


def expected_shared(llm):
    n = len(llm.engine.encode(PROMPT))
    k = llm.engine.plugin_manager.num_lookahead_tokens
    return (n - 1 - k) // BLOCK * BLOCK


def test_greedy_children_equal_the_solo_run_and_use_fewer_blocks(llm):
    engine = llm.engine
    alone = solo(llm, greedy())
    outs, peak = run_family(engine, [greedy()] * 3)
    assert [o.token_ids for o in outs] == [alone.token_ids] * 3
    assert [o.num_shared_prompt_tokens for o in outs] == [0] + [expected_shared(llm)] * 2
    assert expected_shared(llm) >= 4 * BLOCK
    assert all_blocks_free(engine)
    unshared, peak_unshared = run_family(engine, [greedy()] * 3, share=False)
    assert [o.token_ids for o in unshared] == [alone.token_ids] * 3
    assert all(o.num_shared_prompt_tokens == 0 for o in unshared)
    # each child holds the parent's shared blocks instead of its own copies
    assert peak <= peak_unshared - 2 * (expected_shared(llm) // BLOCK) + 2
    assert peak < peak_unshared
    if alone.spec_decode is not None:  # the children's MTP caches hold the prompt as a full prefill leaves them
        assert all(o.spec_decode.num_accepted_tokens == alone.spec_decode.num_accepted_tokens for o in outs)
    assert all_blocks_free(engine)


def test_block_tables_share_the_prompt_blocks_while_all_run(llm):
    engine = llm.engine
    states = [engine.add_request(PROMPT, greedy(), request_id="p")]
    states += [engine.add_request(PROMPT, greedy(), request_id=f"c{i}", share_prefix_with="p") for i in range(2)]
    engine.step()  # the parent's prefill (the children wait for it)
    assert states[0].seq.num_output_tokens == 1 and all(not s.seq.block_table for s in states[1:])
    engine.step()  # the children's prefill, on the parent's blocks
    shared = expected_shared(llm) // BLOCK
    tables = [s.seq.block_table for s in states]
    assert tables[1][:shared] == tables[2][:shared] == tables[0][:shared]
    assert [engine.block_manager.ref_count(b) for b in tables[0][:shared]] == [3] * shared
    distinct = set().union(*map(set, tables))
    assert engine.block_manager.num_used_blocks == len(distinct) == sum(map(len, tables)) - 2 * shared
    engine.run(states)
    assert all_blocks_free(engine)


def test_seeded_children_equal_their_solo_runs(llm):
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=25, ignore_eos=True) for s in (1, 2, 3, 4)]
    alone = [solo(llm, p).token_ids for p in params]
    assert len({tuple(a) for a in alone}) > 1  # different seeds, different texts
    outs, _ = run_family(llm.engine, params)
    assert [o.token_ids for o in outs] == alone
    assert all(o.num_shared_prompt_tokens == expected_shared(llm) for o in outs[1:])
    assert all_blocks_free(llm.engine)


@pytest.mark.parametrize("victim", ["p", "c0"])
def test_aborting_one_side_mid_way_leaves_the_other_correct(llm, victim):
    engine = llm.engine
    alone = solo(llm, greedy()).token_ids
    states = [engine.add_request(PROMPT, greedy(), request_id="p"),
              engine.add_request(PROMPT, greedy(), request_id="c0", share_prefix_with="p"),
              engine.add_request(PROMPT, greedy(), request_id="c1", share_prefix_with="p")]
    finals = {}
    for _ in range(4):  # both prefills and a couple of decode steps
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert states[1].seq.shared_prefix_tokens == expected_shared(llm)
    aborted = engine.abort(victim)
    assert aborted.finish_reason == "abort"
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    for rid in {"p", "c0", "c1"} - {victim}:
        assert finals[rid].token_ids == alone
    assert all_blocks_free(engine)


def test_parent_gone_or_other_prompt_falls_back_to_a_full_prefill(llm):
    engine = llm.engine
    alone = solo(llm, greedy()).token_ids
    engine.run([engine.add_request(PROMPT, greedy(), request_id="done")])
    late = engine.add_request(PROMPT, greedy(), request_id="late", share_prefix_with="done")
    unknown = engine.add_request(PROMPT, greedy(), request_id="unknown", share_prefix_with="no-such-request")
    other = engine.add_request(PROMPT + "x = 1\n", greedy(), request_id="other", share_prefix_with="late")
    outs = engine.run([late, unknown, other])
    assert outs[0].token_ids == outs[1].token_ids == alone
    assert outs[2].token_ids == solo(llm, greedy(), PROMPT + "x = 1\n").token_ids
    assert [o.num_shared_prompt_tokens for o in outs] == [0, 0, 0]
    assert all_blocks_free(engine)


def test_parent_finishing_at_its_prefill_leaves_the_child_a_full_prefill(llm):
    engine = llm.engine
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    outs, _ = run_family(engine, [one, greedy()])
    assert outs[1].token_ids == solo(llm, greedy()).token_ids and outs[1].num_shared_prompt_tokens == 0
    assert all_blocks_free(engine)


@pytest.mark.parametrize("mode", ["mtp_off", "eagle"])
def test_preemption_of_parents_and_children_stays_correct(mode):
    # 30 usable 4-token blocks for two families of three 24-token prompts growing by 30 tokens:
    # sequences are preempted (their shared blocks stay with the others) and recomputed in full.
    llm = make_llm(mode, num_blocks=31)
    prompts = [PROMPT, PROMPT.replace("argv", "args")]
    alone = [solo(llm, greedy(), p).token_ids for p in prompts]
    engine = llm.engine
    states = []
    for f, prompt in enumerate(prompts):
        states.append(engine.add_request(prompt, greedy(), request_id=f"p{f}"))
        states += [engine.add_request(prompt, greedy(), request_id=f"p{f}c{i}", share_prefix_with=f"p{f}") for i in range(2)]
    outs = engine.run(states)
    assert [o.token_ids for o in outs] == [alone[0]] * 3 + [alone[1]] * 3
    assert sum(o.num_preemptions for o in outs) > 0
    assert any(o.num_shared_prompt_tokens for o in outs)
    assert all_blocks_free(engine)


def test_async_scheduling_waits_for_the_parents_prefill_in_flight():
    llm = make_llm("eagle", async_scheduling=True)
    alone = solo(llm, greedy()).token_ids
    outs, _ = run_family(llm.engine, [greedy()] * 3)
    assert [o.token_ids for o in outs] == [alone] * 3
    assert [o.num_shared_prompt_tokens for o in outs] == [0] + [expected_shared(llm)] * 2
    assert all_blocks_free(llm.engine)


def test_children_get_the_parents_prompt_logprobs_for_the_shared_positions(llm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=2)
    alone = solo(llm, params)
    outs, _ = run_family(llm.engine, [params] * 2 + [SamplingParams(max_tokens=0, prompt_logprobs=2)])
    assert [o.num_shared_prompt_tokens for o in outs] == [0] + [expected_shared(llm)] * 2
    assert outs[2].token_ids == [] and outs[2].finish_reason == "length"
    for out in outs:
        assert out.prompt_logprobs[0] is None and None not in out.prompt_logprobs[1:]
        assert out.prompt_logprobs[1:] == pytest.approx(alone.prompt_logprobs[1:], abs=1e-4)
        for got, want in zip(out.prompt_top_logprobs[1:], alone.prompt_top_logprobs[1:]):
            assert set(got) == set(want) and list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)
    assert outs[1].token_ids == alone.token_ids
    # a child asking for other prompt logprobs than its parent's is prefilled in full
    other, _ = run_family(llm.engine, [greedy(5), params])
    assert other[1].num_shared_prompt_tokens == 0
    assert other[1].prompt_logprobs[1:] == pytest.approx(alone.prompt_logprobs[1:], abs=1e-4)
    assert all_blocks_free(llm.engine)


def test_children_and_fresh_prompts_are_prefilled_in_separate_batches(llm):
    engine = llm.engine
    other = "def add(a, b):\n    return a + b\n"
    alone = [solo(llm, greedy(), p).token_ids for p in (PROMPT, other)]
    parent = engine.add_request(PROMPT, greedy(), request_id="p")
    engine.step()
    child = engine.add_request(PROMPT, greedy(), request_id="c", share_prefix_with="p")
    fresh = engine.add_request(other, greedy(), request_id="fresh")
    batch = engine.scheduler.schedule()  # what the next step runs: the child alone
    assert batch.is_prefill and batch.seqs == [child.seq] and child.seq.num_cached_tokens == expected_shared(llm)
    outputs = engine.plugin_manager.generate_token(StepBatch(batch.seqs, True, BLOCK))
    engine.finish_step(batch, outputs)
    outs = engine.run([parent, child, fresh])
    assert [o.token_ids for o in outs] == [alone[0], alone[0], alone[1]]
    assert all_blocks_free(engine)
