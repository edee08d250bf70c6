"""Decoding speed of mindspec configurations against transformers ``generate``, side by side.

Every configuration is a separate ``LLM`` on the same checkpoint, all in this one process, and the
runs are interleaved round by round (A, B, C, ..., A, B, C, ...): a noisy shared machine then slows
every configuration alike, and the median over rounds is reported. Greedy decoding of held-out
prompts. Reported per configuration and batch size: output tokens per second, latency per output
token of one sequence, the mean number of tokens a step yields per sequence (accepted drafts + 1),
the acceptance rate per draft position, the share of steps that speculated (adaptive speculation),
whether the tokens equal MTP off (lossless), and per request (from ``RequestOutput.metrics``) the
time in the queue, to the first token (TTFT: the prefill, with MTP's) and per output token after it
(TPOT: decode alone), each request's TPOT speed-up over MTP off included.

"batch b" means one of two things (``batching``):

* static: ``max(b, min_prompts)`` prompts in groups of b, one ``generate`` call per group, each
  running until its slowest sequence is done. With speculation sequences finish at different
  steps, so the tail of every group runs with fewer than b sequences. Latency per token: the mean
  over groups of (group time / max_tokens).
* continuous: ``max(WAVES * b, min_prompts)`` prompts in ONE ``generate`` call with the scheduler
  limited to b running sequences, so a waiting prompt is admitted as soon as one finishes (what a
  server sees; vLLM's ``benchmark_throughput`` does the same with its max-running limit). Only the
  end of the run has fewer than b sequences. Latency per token: wall time * b / output tokens, the
  time between one running slot's tokens (equal to the static measure when every slot is busy).
  transformers ``generate`` has no continuous batching: it runs the same prompts in static groups
  of b.

Output lengths are fixed (every sequence ``max_tokens``, EOS ignored) unless a range ratio r is
given: then each prompt's length is drawn once, uniformly from [n (1 - r), n (1 + r)] (vLLM's
``--random-range-ratio``), the same for every configuration and round. Fixed lengths are the worst
case for speculation under continuous batching: MTP off finishes a whole batch in one step and
refills it with one big prefill, while speculating sequences finish at different steps and are
refilled in small groups (see SchedulerConfig.waiting_served_ratio); with varied lengths both do.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np
import torch

from mindspec.llm import LLM
from mindspec.text_generator.sampling.params import SamplingParams

BATCHING = ("static", "continuous")
BASELINE = "mtp off"  # what every speed-up and token identity is measured against
# Continuous batching: prompts per run = WAVES x the running limit, so the end-of-run tail (fewer
# than b sequences left) is amortised over 4 waves of admissions instead of dominating the run.
WAVES = 4


@dataclass
class Config:
    name: str
    plugin_params: Optional[dict] = None
    # True: compiled decode steps on cpu (AOTInductor packages); None: the backend's default (CUDA graphs on a
    # GPU, eager on cpu). False would turn a GPU's graphs off.
    decode_graphs: Optional[bool] = None
    async_scheduling: bool = False  # host post-processing overlaps the next step
    compile_prefill: bool = True  # with decode_graphs on cpu: prefills run compiled too (prefill_padding.py)
    lossless: bool = True  # relaxed acceptance trades exactness for speed
    split_fuse: bool = False  # prompts prefilled in chunks inside decode steps
    model: Optional[str] = None  # another checkpoint than the run's (--also-model)

    @property
    def speculative(self) -> bool:
        return self.plugin_params is not None


SUFFIX = {"plugin_type": "suffix", "num_speculative_tokens": 8}


def mtp(k: int, mode: str, adaptive: bool = False, **extra) -> dict:
    return {"plugin_type": "mtp", "num_speculative_tokens": k, "mtp_mode": mode,
            "adaptive_speculation": adaptive, **extra}


# Draft trees measured with --trees: dynamic (EAGLE-2) trees as (depth, tree_topk, num_draft_tokens)
# for MTP Eagle (any depth), and for MTP Vanilla (depth = its modules) a dynamic and a static one.
EAGLE_TREES = ((4, 2, 6), (4, 3, 10), (5, 3, 12), (5, 4, 16))
VANILLA_STATIC_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0]]


def tree(depth: int, mode: str, topk: int, nodes: int, adaptive: bool = False) -> dict:
    return {"plugin_type": "mtp", "mtp_mode": mode, "tree": "dynamic", "num_speculative_tokens": depth,
            "tree_topk": topk, "num_draft_tokens": nodes, "adaptive_speculation": adaptive}


def tree_configs(mtp_modules: int, medusa: bool = False) -> list[Config]:
    """Draft trees; ``medusa``: the checkpoint has Medusa heads, measured with their default tree
    and as a chain of their first choices."""
    out = [Config(f"eagle tree d{d} k{t} n{n}", tree(d, "eagle", t, n)) for d, t, n in EAGLE_TREES]
    d, t, n = EAGLE_TREES[0]  # the adaptive choice of tree or plain steps, on the smallest tree
    out.append(Config(f"eagle tree d{d} k{t} n{n} adaptive", tree(d, "eagle", t, n, adaptive=True)))
    if mtp_modules >= 3:
        out += [Config("vanilla tree d3 k3 n8", tree(3, "vanilla", 3, 8)),
                Config("vanilla tree static 10", {"plugin_type": "mtp", "mtp_mode": "vanilla",
                                                  "tree_choices": VANILLA_STATIC_TREE, "adaptive_speculation": False})]
    if medusa:
        out += [Config("medusa tree", {"plugin_type": "medusa"}),
                Config("medusa chain 3", {"plugin_type": "medusa", "tree_choices": [[0], [0, 0], [0, 0, 0]]})]
    return out


def default_configs(ks: list[int], mtp_modules: int, bos: int, eos: int, compiled: bool,
                    asynchronous: bool = True, split_fuse: bool = False, trees: bool = False,
                    medusa: bool = False) -> list[Config]:
    """MTP off; vanilla (K up to the checkpoint's modules) and eagle at fixed K; K=3 adaptive (both modes);
    relaxed acceptance; with ``asynchronous``, async scheduling of MTP off and K=3; with
    ``compiled``, the compiled decode step for the main ones; with ``split_fuse``, SplitFuse for
    MTP off and K=3 adaptive (both modes); with ``trees``, draft trees (tree_configs)."""
    out = [Config(BASELINE)]
    for k in [k for k in ks if k <= mtp_modules]:
        out.append(Config(f"vanilla K={k}", mtp(k, "vanilla")))
    for k in ks:
        out.append(Config(f"eagle K={k}", mtp(k, "eagle")))
    best = "vanilla" if 3 <= mtp_modules else "eagle"
    # Adaptive speculation: vanilla chooses K or a plain step, eagle any draft count 0..K.
    out += [Config(f"{mode} K=3 adaptive", mtp(3, mode, adaptive=True)) for mode in dict.fromkeys([best, "eagle"])]
    # Relaxed acceptance applies inside a thinking span; this code model has none, so the whole
    # output is declared one (from BOS to EOS) to measure what relaxed acceptance buys.
    out.append(Config(f"{best} K=3 relaxed", mtp(3, best, decoding_policy="relaxed", relaxed_topk=3, relaxed_delta=0.2,
                                                 think_start_token_id=bos, think_end_token_id=eos), lossless=False))
    out.append(Config("suffix K=8", SUFFIX))  # no draft weights: matches in the sequence's own tokens
    # MTP with suffix drafts per sequence, where they promise more (up to 8)
    out += [Config(f"{mode} K=3 adaptive +suffix", mtp(3, mode, adaptive=True, suffix_drafting=True))
            for mode in dict.fromkeys([best, "eagle"])]
    if asynchronous:
        out += [Config("mtp off +async", async_scheduling=True),
                Config(f"{best} K=3 +async", mtp(3, best), async_scheduling=True)]
    if split_fuse:
        out += [Config("mtp off +splitfuse", split_fuse=True)]
        out += [Config(f"{mode} K=3 adaptive +splitfuse", mtp(3, mode, adaptive=True), split_fuse=True)
                for mode in dict.fromkeys([best, "eagle"])]
    if trees:
        out += tree_configs(mtp_modules, medusa)
    if compiled:
        out.append(Config("mtp off +compile", decode_graphs=True))
        for mode in dict.fromkeys([best, "eagle"]):  # both modes compiled: their steps cost differently
            out += [Config(f"{mode} K=3 +compile", mtp(3, mode), decode_graphs=True),
                    Config(f"{mode} K=3 adaptive +compile", mtp(3, mode, adaptive=True), decode_graphs=True)]
        # what the compiled prefill is worth, side by side
        out += [Config("mtp off +compile +eager prefill", decode_graphs=True, compile_prefill=False),
                Config(f"{best} K=3 +compile +eager prefill", mtp(3, best), decode_graphs=True, compile_prefill=False),
                Config(f"{best} K=3 adaptive +compile +eager prefill", mtp(3, best, adaptive=True), decode_graphs=True,
                       compile_prefill=False)]
    if compiled and asynchronous:  # the host's work beside the package (no adaptive speculation under async)
        out += [Config("mtp off +compile +async", decode_graphs=True, async_scheduling=True),
                Config(f"{best} K=3 +compile +async", mtp(3, best), decode_graphs=True, async_scheduling=True)]
    if compiled and trees:  # the smallest trees compiled, beside the compiled chains of both modes
        out += [Config(f"{c.name} +compile", c.plugin_params, decode_graphs=True) for c in tree_configs(mtp_modules)
                if c.name in ("eagle tree d4 k2 n6", "vanilla tree d3 k3 n8")]
    return out


def simulated(configs: list[Config], rates: list[float]) -> list[Config]:
    """The configurations for a random-weights model: speculation accepts drafts at ``rates``
    (the MTP plugin's simulated_acceptance); relaxed acceptance and draft trees, which need real targets,
    are dropped."""
    out = []
    for c in configs:
        if not c.speculative or c.plugin_params["plugin_type"] != "mtp":  # suffix, medusa: verified for real
            out.append(c)
            continue
        k = c.plugin_params["num_speculative_tokens"]
        if c.plugin_params.get("decoding_policy") == "relaxed" or "tree" in c.plugin_params \
                or "tree_choices" in c.plugin_params:  # trees pick paths by their real targets
            continue
        if k > len(rates):
            raise ValueError(f"{c.name} needs {k} simulated acceptance rates, {len(rates)} given")
        out.append(replace(c, plugin_params={**c.plugin_params, "simulated_acceptance": rates[:k]}, lossless=False))
    return out


def on_model(configs: list[Config], model: str, label: str) -> list[Config]:
    """Each configuration again on checkpoint ``model``, named "<name> @<label>"."""
    return [replace(c, name=f"{c.name} @{label}", model=model) for c in configs]


def select_configs(configs: list[Config], names: str) -> list[Config]:
    """The configurations named in ``names`` (comma-separated), in their usual order, and always
    the baseline (every speed-up and the token identity are against it); an unknown name is an
    error that lists the known ones."""
    wanted = [n.strip() for n in names.split(",") if n.strip()] + [BASELINE]
    known = {c.name for c in configs}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"unknown configuration(s) {', '.join(map(repr, unknown))}; choose from {', '.join(sorted(known))}")
    return [c for c in configs if c.name in wanted]


@dataclass
class Measurement:
    tokens_per_s: list[float] = field(default_factory=list)
    latency_per_token_ms: list[float] = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    spec: dict = field(default_factory=dict)
    group_seconds: list[list[float]] = field(default_factory=list)  # per round: each static group's wall time
    # per round, per request in prompt order (RequestOutput.metrics): queueing, time to first
    # token (prefill included) and time per output token after the first (decode speed)
    queue_s: list[list[float]] = field(default_factory=list)
    ttft_s: list[list[float]] = field(default_factory=list)
    tpot_s: list[list[Optional[float]]] = field(default_factory=list)  # None: a one-token output


def prompt_count(batch: int, min_prompts: int, batching: str) -> int:
    """Prompts measured per configuration, round and batch size."""
    return max(WAVES * batch if batching == "continuous" else batch, min_prompts)


def output_lengths(count: int, new_tokens: int, range_ratio: float = 0.0, seed: int = 0) -> list[int]:
    """Each prompt's output length: ``new_tokens``, or with ``range_ratio`` r > 0 a seeded uniform
    draw from [n (1 - r), n (1 + r)]."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"the output length range ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, round(new_tokens * (1 - range_ratio)))
    hi = max(lo, round(new_tokens * (1 + range_ratio)))
    return np.random.default_rng(seed).integers(lo, hi + 1, size=count).tolist()


MAX_WARM_UP_RUNS = 4


def captured_graphs(llm: LLM) -> int:
    """Decode graphs the LLM holds (0 without a graph runner)."""
    runner = llm.engine.model_wrapper.graph_runner
    return 0 if runner is None else runner.num_graphs


def run_mindspec(llm: LLM, groups: list[list[list[int]]], params: list[list[SamplingParams]], m: Measurement) -> None:
    """Static batching: one ``generate`` per group (``params``: per group, per prompt)."""
    outs, latencies, seconds = [], [], []
    start = time.perf_counter()
    for group, group_params in zip(groups, params):
        t = time.perf_counter()
        res = llm.generate(group, group_params)
        seconds.append(time.perf_counter() - t)
        latencies.append(seconds[-1] / max(p.max_tokens for p in group_params))
        outs += res
    _record(m, outs, time.perf_counter() - start, statistics.mean(latencies))
    m.group_seconds.append(seconds)


def run_continuous(llm: LLM, prompts: list[list[int]], batch: int, params: list[SamplingParams],
                   m: Measurement) -> None:
    """Continuous batching: every prompt in one ``generate``, at most ``batch`` running; the
    scheduler admits a waiting prompt as soon as a running one finishes."""
    with max_running(llm, batch):
        start = time.perf_counter()
        outs = llm.generate(prompts, params)  # outputs in prompt order, as the static runs
        seconds = time.perf_counter() - start
    _record(m, outs, seconds, seconds * batch / sum(len(o.token_ids) for o in outs))


@contextmanager
def max_running(llm: LLM, batch: int):
    """The scheduler's running-sequence limit (read every step) set to ``batch`` for a run; restored
    after, so later runs on the same LLM (the profile) see the limit it was built with."""
    config = llm.engine.scheduler.config
    saved, config.max_batch_size = config.max_batch_size, batch
    try:
        yield
    finally:
        config.max_batch_size = saved


def _record(m: Measurement, outs: list, seconds: float, latency_s: float) -> None:
    tokens = sum(len(o.token_ids) for o in outs)
    m.tokens_per_s.append(tokens / seconds)
    m.latency_per_token_ms.append(1e3 * latency_s)
    m.token_ids = [o.token_ids for o in outs]
    m.spec = spec_summary([o.spec_decode for o in outs], tokens, len(outs))
    timed = [o.metrics for o in outs]
    if all(t is not None for t in timed):
        m.queue_s.append([t.time_in_queue for t in timed])
        m.ttft_s.append([t.time_to_first_token for t in timed])
        m.tpot_s.append([t.time_per_output_token(len(o.token_ids)) for t, o in zip(timed, outs)])


def spec_summary(stats, total_tokens: int, num_seqs: int) -> dict:
    """Mean tokens per speculative step (accepted drafts + 1), over all steps and per request
    (worst, median), acceptance per draft position, and the share of a sequence's decode steps
    that speculated."""
    stats = [s for s in stats if s is not None and s.num_steps]
    if not stats:
        return {}
    steps = sum(s.num_steps for s in stats)
    accepted = np.sum([s.accepted_per_position for s in stats], axis=0)
    drafted = np.maximum(np.sum([s.drafted_per_position for s in stats], axis=0), 1)
    spec_tokens = sum(s.num_accepted_tokens for s in stats) + steps
    decode_tokens = total_tokens - num_seqs  # the first token of each sequence comes from prefill
    plain_steps = max(0, decode_tokens - spec_tokens)
    per_request = [(s.num_accepted_tokens + s.num_steps) / s.num_steps for s in stats]
    return {
        "mean_accepted_length": round(spec_tokens / steps, 4),
        # Speculation must pay per request: the worst request's tokens per step, not only the mean.
        "accepted_length_per_request": {"worst": round(min(per_request), 4),
                                        "median": round(statistics.median(per_request), 4)},
        "acceptance_per_position": (accepted / drafted).round(4).tolist(),
        "mean_drafts_per_step": round(sum(s.num_draft_tokens for s in stats) / steps, 4),
        "speculative_step_share": round(steps / (steps + plain_steps), 4),
    }


def run_hf(model, groups: list[list[list[int]]], lengths: list[list[int]], m: Measurement) -> None:
    """transformers greedy ``generate`` on the main model; prompts of a group have equal length,
    so no padding is involved. A static group runs to its longest output; only the tokens each
    prompt asked for count."""
    tokens, latencies = 0, []
    start = time.perf_counter()
    for group, group_lengths in zip(groups, lengths):
        ids, new_tokens = torch.tensor(group, device=getattr(model, "device", "cpu")), max(group_lengths)
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False)
        latencies.append((time.perf_counter() - t) / new_tokens)
        tokens += sum(group_lengths)
    m.tokens_per_s.append(tokens / (time.perf_counter() - start))
    m.latency_per_token_ms.append(1e3 * statistics.mean(latencies))


def summarise(results: dict[str, Measurement], baseline: str = BASELINE, peers: tuple[str, ...] = ()) -> dict:
    """Per configuration: medians over rounds, and the speed-up over the baseline two ways: the
    ratio of medians, and per round against the baseline's run of the same round (paired: a slow
    spell of the machine that hits one round hits both runs of it more than runs rounds apart).
    ``peers``: other engines (llama.cpp), against which every mindspec row also gets its paired
    speed-up per round and, where both timed each request, per request (``vs_peer``)."""
    base_rounds = results[baseline].tokens_per_s
    base = statistics.median(base_rounds)
    reference = results[baseline].token_ids
    out = {}
    for name, m in results.items():
        tps = statistics.median(m.tokens_per_s)
        paired = [v / b for v, b in zip(m.tokens_per_s, base_rounds)]
        row = {
            "tokens_per_s_median": round(tps, 2),
            "tokens_per_s_rounds": [round(v, 2) for v in m.tokens_per_s],
            "latency_per_token_ms_median": round(statistics.median(m.latency_per_token_ms), 3),
            "speedup_vs_mtp_off": round(tps / base, 3),
            "speedup_vs_mtp_off_rounds": [round(r, 3) for r in paired],
            "speedup_vs_mtp_off_paired_median": round(statistics.median(paired), 3),
            **m.spec,
        }
        if m.token_ids:
            row["identical_to_mtp_off"] = m.token_ids == reference
        if m.group_seconds and results[baseline].group_seconds:
            row["speedup_per_group"] = per_group_speedup(m.group_seconds, results[baseline].group_seconds)
        row.update(request_latencies(m, results[baseline]))
        sync = name.removesuffix(" +async")
        if sync != name and sync in results:  # the host-overlap gain, same run, same rounds
            row["speedup_vs_sync"] = round(tps / statistics.median(results[sync].tokens_per_s), 3)
        if name not in peers:
            row.update(vs_peer(m, {p: results[p] for p in peers}))
        out[name] = row
    return out


def request_latencies(m: Measurement, base: Measurement) -> dict:
    """Per request (medians over rounds), median and worst: ``queue_ms``, ``ttft_ms`` and
    ``tpot_ms``; and ``tpot_speedup_vs_mtp_off_per_request``, each request's time per output token
    under the baseline over its own: the decode speed-up without the prefill (``speedup_per_group``).
    Nothing for an engine without request metrics or a round with a one-token output."""
    row = {}
    for key, rounds in (("queue_ms", m.queue_s), ("ttft_ms", m.ttft_s), ("tpot_ms", m.tpot_s)):
        if _complete(rounds):
            per_request = 1e3 * np.median(np.array(rounds), axis=0)
            row[key] = {"median": round(float(np.median(per_request)), 3), "worst": round(float(per_request.max()), 3)}
    if _complete(m.tpot_s) and _complete(base.tpot_s):
        row["tpot_speedup_vs_mtp_off_per_request"] = per_group_speedup(m.tpot_s, base.tpot_s)
    return row


def _complete(rounds: list[list[Optional[float]]]) -> bool:
    """Every round timed every request."""
    return bool(rounds) and all(v is not None for r in rounds for v in r)


def vs_peer(m: Measurement, peers: dict[str, Measurement]) -> dict:
    """``speedup_vs_<peer>_rounds`` (paired per round), its median, ``..._per_request`` when
    both timed each static group (at batch 1: each request), and ``..._ttft_per_request`` /
    ``..._tpot_per_request`` when both timed each request's first token and the tokens after it."""
    row = {}
    for peer, theirs in peers.items():
        slug = "speedup_vs_" + peer.replace(".", "_").replace(" ", "_")
        paired = [v / b for v, b in zip(m.tokens_per_s, theirs.tokens_per_s)]
        row[f"{slug}_rounds"] = [round(r, 3) for r in paired]
        row[f"{slug}_paired_median"] = round(statistics.median(paired), 3)
        if m.group_seconds and theirs.group_seconds:
            row[f"{slug}_per_request"] = per_group_speedup(m.group_seconds, theirs.group_seconds)
        for kind, mine, other in (("ttft", m.ttft_s, theirs.ttft_s), ("tpot", m.tpot_s, theirs.tpot_s)):
            if _complete(mine) and _complete(other):  # prefill and decode apart
                row[f"{slug}_{kind}_per_request"] = per_group_speedup(mine, other)
    return row


def per_group_speedup(seconds: list[list[float]], base: list[list[float]]) -> dict:
    """Per static group (at batch 1: per request), the speed-up over the baseline's run of the
    same group: the ratio of the groups' median wall times over rounds (equal outputs: the same
    tokens in less time). Worst, median, p90 and best, and every group's value."""
    mine, theirs = np.median(np.array(seconds), axis=0), np.median(np.array(base), axis=0)
    ratios = theirs / mine
    return {"min": round(float(ratios.min()), 3), "median": round(float(np.median(ratios)), 3),
            "p90": round(float(np.percentile(ratios, 90)), 3), "max": round(float(ratios.max()), 3),
            "values": [round(float(r), 3) for r in ratios]}


def bench_batch(llms: dict[str, LLM], hf, prompts: list[list[int]], batch: int, min_prompts: int,
                rounds: int, params: SamplingParams, batching: str = "static",
                warm_up: frozenset = frozenset(), output_lens: Optional[list[int]] = None,
                others: Optional[dict] = None) -> dict:
    """``warm_up``: configurations that run once untimed first (a compiled decode step compiles
    its graphs for this batch's shapes then, not inside a timed round). ``output_lens``: each
    prompt's max_tokens (default: ``params.max_tokens`` for all). ``others``: more engines by
    name, each a function (prompts, output lengths, Measurement, batch) running one round (llama.cpp)."""
    others = others or {}
    count = prompt_count(batch, min_prompts, batching)
    if len(prompts) < count or (output_lens is not None and len(output_lens) < count):
        raise ValueError(f"batch {batch} ({batching}) needs {count} prompts and output lengths")
    prompts = prompts[:count]
    lens = output_lens[:count] if output_lens is not None else [params.max_tokens] * count
    # a seeded request's tokens depend on its seed alone: request i samples with seed + i (wrapped
    # into the seed range) in every configuration and round
    per_prompt = [replace(params, max_tokens=n, seed=None if params.seed is None else (params.seed + i) % 2**63)
                  for i, n in enumerate(lens)]
    starts = range(0, count, batch)
    groups = [prompts[i : i + batch] for i in starts]
    group_params = [per_prompt[i : i + batch] for i in starts]
    group_lens = [lens[i : i + batch] for i in starts]
    results = {name: Measurement() for name in llms}
    if hf is not None:
        results["transformers generate"] = Measurement()
    results.update({name: Measurement() for name in others})

    def run(llm: LLM, m: Measurement) -> None:
        if batching == "continuous" and batch > 1:  # at batch 1 both are one request at a time, timed each
            run_continuous(llm, prompts, batch, per_prompt, m)
        else:
            run_mindspec(llm, groups, group_params, m)

    for name in warm_up:
        # Until a run captures no new graph: adaptive speculation meets new draft counts and row
        # layouts (new graphs) for a while, and capturing must not land in a timed round.
        for _ in range(MAX_WARM_UP_RUNS):
            graphs = captured_graphs(llms[name])
            run(llms[name], Measurement())
            if captured_graphs(llms[name]) == graphs:
                break
    if hf is not None and str(getattr(hf, "device", "cpu")) != "cpu":  # CUDA context, cuBLAS handles, kernel caches
        run_hf(hf, groups[:1], [[4] * len(groups[0])], Measurement())
    for _ in range(rounds):
        for name, llm in llms.items():
            run(llm, results[name])
        if hf is not None:
            run_hf(hf, groups, group_lens, results["transformers generate"])
        for name, other in others.items():
            other(prompts, lens, results[name], batch)
    return summarise(results, peers=tuple(others))
