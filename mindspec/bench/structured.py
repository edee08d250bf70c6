"""``mindspec bench --scenario structured``: JSON-schema constrained requests with MTP on and off
(JSON + PNG).

    mindspec bench --scenario structured --threads 1 --rounds 3 --out benchmarks/results/bench_cpu_structured

Prompts: ``--prompts`` windows of ``--prompt-tokens`` tokens from the held-out corpus files (the
same kind of prompt every other scenario runs, nobody tuned on them), prompt i constrained by
schema ``i % 5`` of ``structured_schemas.SCHEMAS`` (nested object, enums, array of objects,
numbers with ranges, booleans). Configurations (``CONFIGS``; adaptive speculation at its default,
on): MTP off, eagle K=3, vanilla K=3, and eagle K=3 with ``mask_drafts`` false (drafts that ignore
the format: what draft masks buy). Each output may run to ``--max-tokens``.

1. Validity: every output of every configuration, greedy and sampled (temperature 0.8, top_p
   0.95, seed 1000 + prompt index), goes through ``json.loads`` and ``jsonschema.validate``;
   counted per configuration and mode with the finish reasons; greedy tokens are compared per
   prompt with MTP off's (speculation is lossless: no mismatch is expected), and so are the
   seeded sampled ones (``same_tokens_as_mtp_off``: a seed fixes each position's draw).
2. Speed at batch 1, one request at a time: per prompt, every configuration constrained and,
   for each distinct speculation setting, unconstrained, in a rotating order inside the prompt
   (a slow spell hits all of one prompt's runs), ``--rounds`` times; the median wall time per
   request. The unconstrained twin of a request runs as many tokens as MTP off's constrained
   output of the same prompt had (greedy, EOS ignored): both sides decode the same number of
   tokens after the same prompt. Tokens/s = output tokens / the request's wall time (prefill
   included). Speed-up = a configuration's tokens/s over MTP off's on the same prompt and mode;
   reported per request (worst, median, every value) and aggregated (all tokens over the sum of
   the per-request median times). Against the target, per MTP configuration: the gain ratio
   (constrained speed-up - 1) / (unconstrained speed-up - 1) and the speed-up ratio
   constrained / unconstrained (target: >= 0.9).
3. Mask cost: the structured output plugin's host timing (``engine.structured.timing``: rows'
   masks and the accepted-token walk, draft steps' masks) over the wall time of the same
   requests, at batch 1 (the timed requests above) and at ``--structured-batch`` (16) concurrent
   constrained requests in one ``generate`` (with their unconstrained twins for tokens/s).
4. Grammar engines (``--grammar-engines``): xgrammar (the plugin's) and llguidance (when it is
   importable; never a dependency) on the shipped tokenizer: tokenizer set-up, compile time per
   schema, and the mask-fill time per token along each schema's greedy document (the first
   mask, then the rest), with the share of positions where both engines' masks are equal.
"""
from __future__ import annotations

import functools
import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from mindspec.bench.corpus import heldout_prompts
from mindspec.bench.speed import spec_summary
from mindspec.bench.structured_schemas import SCHEMAS, schema_of
from mindspec.text_generator.sampling.params import SamplingParams

MTP = {"plugin_type": "mtp", "num_speculative_tokens": 3}
CONFIGS = {
    "mtp off": None,
    "eagle K=3": {**MTP, "mtp_mode": "eagle"},
    "vanilla K=3": {**MTP, "mtp_mode": "vanilla"},
    "eagle K=3 no draft masks": {**MTP, "mtp_mode": "eagle", "mask_drafts": False},
}
BASELINE = "mtp off"
TARGET = 0.9  # constrained requests keep >= 90% of the unconstrained MTP speed-up
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
SEED_BASE = 1000  # sampled request i: seed 1000 + i
PROMPT_SEED = 41  # heldout_prompts' window draw (other scenarios use other seeds)
MAX_INVALID_KEPT = 10


def greedy_params(schema: dict, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, json_schema=schema)


def sampled_params(schema: dict, max_tokens: int, index: int) -> SamplingParams:
    return SamplingParams(**SAMPLED, seed=SEED_BASE + index, max_tokens=max_tokens, json_schema=schema)


def unconstrained_params(length: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max(1, length), ignore_eos=True)


def unconstrained_twins(configs: dict) -> dict[str, str]:
    """Per configuration, whose unconstrained runs stand for it: mask_drafts changes nothing
    without a format, so "eagle K=3 no draft masks" uses "eagle K=3"'s (when both run)."""
    seen: dict[str, str] = {}
    out = {}
    for name, params in configs.items():
        key = json.dumps({k: v for k, v in (params or {}).items() if k != "mask_drafts"}, sort_keys=True)
        out[name] = seen.setdefault(key, name)
    return out


def check_output(text: str, schema: dict) -> Optional[str]:
    """None when ``text`` parses as JSON and validates against ``schema``; else why not."""
    import jsonschema  # a bench (and test) extra: only this scenario needs it

    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"json: {exc.msg} at character {exc.pos}"
    try:
        jsonschema.validate(doc, schema)
    except jsonschema.ValidationError as exc:
        return f"schema: {exc.message}"
    return None


class _Timed:
    """One ``generate`` on an LLM: its outputs, wall time and the structured output plugin's host
    time (rows + drafts) and constrained steps over it."""

    def __init__(self, llm, prompts: list[list[int]], params: list[SamplingParams]):
        timing = llm.engine.structured.timing
        before = (timing.row_seconds, timing.draft_seconds, timing.steps)
        start = time.perf_counter()
        self.outputs = llm.generate(prompts, params)
        self.wall = time.perf_counter() - start
        self.row_s = timing.row_seconds - before[0]
        self.draft_s = timing.draft_seconds - before[1]
        self.steps = timing.steps - before[2]
        self.tokens = sum(len(o.token_ids) for o in self.outputs)


def validity(outputs: list, prompt_schemas: list[str]) -> dict:
    """Valid / total, finish reasons, per schema (valid, total, tokens) and the first invalid ones."""
    invalid, per_schema = [], {}
    for i, (out, name) in enumerate(zip(outputs, prompt_schemas)):
        error = check_output(out.text, SCHEMAS[name])
        row = per_schema.setdefault(name, {"valid": 0, "total": 0, "tokens": []})
        row["total"] += 1
        row["tokens"].append(len(out.token_ids))
        if error is None:
            row["valid"] += 1
        elif len(invalid) < MAX_INVALID_KEPT:
            invalid.append({"prompt": i, "schema": name, "finish_reason": out.finish_reason, "error": error,
                            "tokens": len(out.token_ids), "text": out.text[:300]})
    for row in per_schema.values():
        tokens = row.pop("tokens")
        row.update(tokens_min=min(tokens), tokens_median=statistics.median(tokens), tokens_max=max(tokens))
    valid = sum(r["valid"] for r in per_schema.values())
    return {"valid": valid, "total": len(outputs), "valid_share": round(valid / max(1, len(outputs)), 4),
            "finish_reasons": dict(Counter(o.finish_reason for o in outputs)), "per_schema": per_schema,
            "invalid": invalid}


def _summary(values: list[float]) -> dict:
    a = np.array(values, dtype=float)
    return {"min": round(float(a.min()), 3), "median": round(float(np.median(a)), 3),
            "max": round(float(a.max()), 3), "values": [round(float(v), 3) for v in a]}


def _mask_row(walls: float, row_s: float, draft_s: float, steps: int) -> dict:
    mask = row_s + draft_s
    return {"mask_share": round(mask / walls, 4) if walls else None,
            "row_mask_share": round(row_s / walls, 4) if walls else None,
            "draft_mask_share": round(draft_s / walls, 4) if walls else None,
            "mask_ms_per_step": round(1e3 * mask / steps, 4) if steps else None,
            "step_ms": round(1e3 * walls / steps, 4) if steps else None, "steps": steps}


def run_batch1(llms: dict, twins: dict[str, str], prompts: list[list[int]], prompt_schemas: list[str],
               max_tokens: int, rounds: int, log=print) -> dict:
    """Greedy batch-1 runs: validity, token identity, per-request speed and the mask's share.
    ``twins``: whose unconstrained runs stand for each configuration (unconstrained_twins)."""
    runs = [(name, "constrained") for name in llms] + [(name, "unconstrained") for name in llms if twins[name] == name]
    # MTP off's constrained outputs first: they fix each unconstrained twin's length (and warm it up)
    reference = [llms[BASELINE].generate([p], greedy_params(SCHEMAS[s], max_tokens))[0]
                 for p, s in zip(prompts, prompt_schemas)]
    lengths = [len(o.token_ids) for o in reference]
    walls = {run: [[] for _ in prompts] for run in runs}
    mask = {run: [[0.0, 0.0, 0] for _ in range(rounds)] for run in runs}  # per round: row s, draft s, steps
    round_walls = {run: [0.0] * rounds for run in runs}
    outputs: dict = {run: [None] * len(prompts) for run in runs}
    mismatched_rounds: dict = {run: set() for run in runs}
    started = time.time()
    for r in range(rounds):
        for i, (prompt, schema) in enumerate(zip(prompts, prompt_schemas)):
            k = (r + i) % len(runs)
            for run in runs[k:] + runs[:k]:
                name, mode = run
                params = greedy_params(SCHEMAS[schema], max_tokens) if mode == "constrained" \
                    else unconstrained_params(lengths[i])
                t = _Timed(llms[name], [prompt], [params])
                out = t.outputs[0]
                walls[run][i].append(t.wall)
                round_walls[run][r] += t.wall
                m = mask[run][r]
                m[0] += t.row_s
                m[1] += t.draft_s
                m[2] += t.steps
                if outputs[run][i] is None:
                    outputs[run][i] = out
                elif out.token_ids != outputs[run][i].token_ids:
                    mismatched_rounds[run].add(i)
        log(f"structured batch 1: round {r + 1}/{rounds} ({time.time() - started:.0f} s)")
    report = {"constrained": {}, "unconstrained": {}, "targets": {}}
    base = {mode: [len(o.token_ids) / statistics.median(w) for o, w in zip(outputs[(BASELINE, mode)],
                                                                          walls[(BASELINE, mode)])]
            for mode in ("constrained", "unconstrained")}
    base_agg = {mode: _aggregate(outputs[(BASELINE, mode)], walls[(BASELINE, mode)]) for mode in base}
    for run in runs:
        name, mode = run
        outs = outputs[run]
        tps = [len(o.token_ids) / statistics.median(w) for o, w in zip(outs, walls[run])]
        agg = _aggregate(outs, walls[run])
        shares = [_mask_row(round_walls[run][rr], *mask[run][rr]) for rr in range(rounds)]
        row = {
            "tokens": sum(len(o.token_ids) for o in outs),
            "tokens_per_s_aggregate": round(agg, 2),
            "tokens_per_s_per_request": _summary(tps),
            "speedup_aggregate": round(agg / base_agg[mode], 3),
            "speedup_per_request": _summary([a / b for a, b in zip(tps, base[mode])]),
            "tokens_per_s_rounds": [round(sum(len(o.token_ids) for o in outs) / w, 2) for w in round_walls[run]],
            **{key: _median_of(shares, key) for key in shares[0]},
            "identical_across_rounds": not mismatched_rounds[run],
            **spec_summary([o.spec_decode for o in outs], sum(len(o.token_ids) for o in outs), len(outs)),
        }
        if mode == "constrained":
            row["validity"] = validity(outs, prompt_schemas)
            mismatches = [i for i, (o, ref) in enumerate(zip(outs, reference)) if o.token_ids != ref.token_ids]
            row["greedy_mismatches_vs_mtp_off"] = mismatches
        else:
            row["lengths_match_constrained_mtp_off"] = [len(o.token_ids) for o in outs] == lengths
        report[mode][name] = row
    for name in llms:
        if name == BASELINE:
            continue
        c, u = report["constrained"][name], report["unconstrained"][twins[name]]
        per_request = [a / b for a, b in zip(c["speedup_per_request"]["values"], u["speedup_per_request"]["values"])]
        gain = (c["speedup_aggregate"] - 1) / (u["speedup_aggregate"] - 1) if u["speedup_aggregate"] != 1 else None
        ratio = c["speedup_aggregate"] / u["speedup_aggregate"]
        report["targets"][name] = {
            "unconstrained_from": twins[name],
            "speedup_constrained": c["speedup_aggregate"], "speedup_unconstrained": u["speedup_aggregate"],
            "gain_ratio": None if gain is None else round(gain, 3),
            "speedup_ratio": round(ratio, 3),
            "speedup_ratio_per_request": _summary(per_request),
            "speedup_constrained_per_request": {k: c["speedup_per_request"][k] for k in ("min", "median", "max")},
            "speedup_unconstrained_per_request": {k: u["speedup_per_request"][k] for k in ("min", "median", "max")},
            "meets_target_gain": gain is not None and gain >= TARGET,
            "meets_target_speedup_ratio": ratio >= TARGET,
        }
    report["unconstrained_lengths"] = lengths
    return report


def _aggregate(outputs: list, walls: list[list[float]]) -> float:
    return sum(len(o.token_ids) for o in outputs) / sum(statistics.median(w) for w in walls)


def _median_of(rows: list[dict], key: str):
    values = [r[key] for r in rows if r[key] is not None]
    return round(statistics.median(values), 4) if values else None


def run_sampled(llms: dict, prompts: list[list[int]], prompt_schemas: list[str], max_tokens: int) -> dict:
    """One sampled pass per configuration, one request at a time: validity and acceptance."""
    out = {}
    outputs = {}
    for name, llm in llms.items():
        t = [_Timed(llm, [p], [sampled_params(SCHEMAS[s], max_tokens, i)])
             for i, (p, s) in enumerate(zip(prompts, prompt_schemas))]
        outs = [x.outputs[0] for x in t]
        outputs[name] = outs
        tokens = sum(len(o.token_ids) for o in outs)
        out[name] = {"validity": validity(outs, prompt_schemas),
                     "tokens_per_s_aggregate": round(tokens / sum(x.wall for x in t), 2),
                     **_mask_row(sum(x.wall for x in t), sum(x.row_s for x in t), sum(x.draft_s for x in t),
                                 sum(x.steps for x in t)),
                     **spec_summary([o.spec_decode for o in outs], tokens, len(outs))}
    for name in llms:  # a seeded request's draws depend only on (seed, position): equal with MTP on
        out[name]["same_tokens_as_mtp_off"] = sum(a.token_ids == b.token_ids
                                                  for a, b in zip(outputs[name], outputs[BASELINE]))
    return out


def run_batch(llms: dict, twins: dict[str, str], prompts: list[list[int]], prompt_schemas: list[str],
              max_tokens: int, rounds: int, batch: int) -> dict:
    """``batch`` constrained requests in one ``generate`` (prompts cycled when fewer), and their
    unconstrained twins (MTP off's constrained lengths, EOS ignored; once per distinct
    speculation setting, as at batch 1), interleaved per round."""
    group = [prompts[i % len(prompts)] for i in range(batch)]
    schemas = [prompt_schemas[i % len(prompts)] for i in range(batch)]
    constrained = [greedy_params(SCHEMAS[s], max_tokens) for s in schemas]
    reference = llms[BASELINE].generate(group, constrained)
    unconstrained = [unconstrained_params(len(o.token_ids)) for o in reference]
    runs = {(name, mode): [] for name in llms for mode in ("constrained", "unconstrained")
            if mode == "constrained" or twins[name] == name}
    for _ in range(rounds):
        for name, llm in llms.items():
            runs[(name, "constrained")].append(_Timed(llm, group, constrained))
            if (name, "unconstrained") in runs:
                runs[(name, "unconstrained")].append(_Timed(llm, group, unconstrained))
    report: dict = {"requests": batch, "constrained": {}, "unconstrained": {}}
    for (name, mode), ts in runs.items():
        tps = [t.tokens / t.wall for t in ts]
        shares = [_mask_row(t.wall, t.row_s, t.draft_s, t.steps) for t in ts]
        row = {"tokens_per_s_median": round(statistics.median(tps), 2), "tokens_per_s_rounds": [round(v, 2) for v in tps],
               **{key: _median_of(shares, key) for key in shares[0]},
               **spec_summary([o.spec_decode for o in ts[0].outputs], ts[0].tokens, batch)}
        if mode == "constrained":
            row["valid"] = sum(check_output(o.text, SCHEMAS[s]) is None for o, s in zip(ts[0].outputs, schemas))
        report[mode][name] = row
    for mode in ("constrained", "unconstrained"):
        base = report[mode][BASELINE]["tokens_per_s_median"]
        for row in report[mode].values():
            row["speedup_vs_mtp_off"] = round(row["tokens_per_s_median"] / base, 3)
    return report


def _timed_walk(fill, accept, tokens: list[int], words: int):
    """A grammar engine's masks along ``tokens``: ``fill(bitmask, row)`` timed before each token
    and after the last, ``accept(token)`` between -> (fill seconds, tokens accepted, bitmask)."""
    bitmask = torch.full((len(tokens) + 1, words), -1, dtype=torch.int32)
    times, accepted = [], 0
    for i in range(len(tokens) + 1):
        t0 = time.perf_counter()
        fill(bitmask, i)
        times.append(time.perf_counter() - t0)
        if i < len(tokens):
            if not accept(tokens[i]):
                break
            accepted += 1
    return times, accepted, bitmask


def compare_grammar_engines(hf_tokenizer, vocab_size: int, stop_token_ids: list[int],
                            documents: dict[str, list[int]], repeats: int = 3) -> dict:
    """xgrammar and (when importable) llguidance on the same tokenizer, schemas and documents:
    set-up, compile time per schema (median of ``repeats``, no cache), and the time to fill one
    token's mask along each document (the documents' tokens, EOS excluded; the mask after the
    last token, where EOS is allowed, included)."""
    import xgrammar as xgr

    report: dict = {"documents_tokens": {k: len(v) for k, v in documents.items()}, "engines": {}}
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=torch.get_num_threads(), cache_enabled=False)
    xgr_setup = time.perf_counter() - t
    words = (vocab_size + 31) // 32

    def xgr_compile(schema):
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def xgr_walk(compiled, tokens):
        matcher = xgr.GrammarMatcher(compiled)
        return _timed_walk(matcher.fill_next_token_bitmask, matcher.accept_token, tokens, words)

    engines = {"xgrammar": (xgr_setup, xgr_compile, xgr_walk)}
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as exc:
        report["llguidance"] = f"skipped: not importable ({exc})"
    else:
        t = time.perf_counter()
        lltok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=sorted(stop_token_ids))
        llg_setup = time.perf_counter() - t
        options = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}

        def llg_compile(schema):
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
            matcher = llguidance.LLMatcher(lltok, grammar)
            if matcher.is_error():
                raise RuntimeError(matcher.get_error())
            return grammar

        def llg_walk(grammar, tokens):
            matcher = llguidance.LLMatcher(lltok, grammar)
            fill = functools.partial(llguidance.torch.fill_next_token_bitmask, matcher)
            return _timed_walk(fill, matcher.consume_token, tokens, words)

        engines["llguidance"] = (llg_setup, llg_compile, llg_walk)
        report["llguidance_version"] = getattr(llguidance, "__version__", None)
    masks: dict = {}
    for engine, (setup, compile_fn, walk) in engines.items():
        row: dict = {"tokenizer_setup_s": round(setup, 4), "schemas": {}}
        all_times = []
        for name, tokens in documents.items():
            schema = SCHEMAS[name]
            compile_times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                compiled = compile_fn(schema)
                compile_times.append(time.perf_counter() - t0)
            walks = [walk(compiled, tokens) for _ in range(repeats)]
            times = np.median(np.array([w[0] for w in walks]), axis=0)  # per position, over repeats
            accepted, bitmask = walks[0][1], walks[0][2]
            masks.setdefault(name, {})[engine] = bitmask
            all_times += times[1:].tolist()
            row["schemas"][name] = {"compile_ms": round(1e3 * statistics.median(compile_times), 3),
                                    "first_mask_us": round(1e6 * float(times[0]), 1),
                                    "mask_us_per_token": round(1e6 * float(times[1:].mean()), 1),
                                    "mask_us_max": round(1e6 * float(times.max()), 1),
                                    "accepted_tokens": accepted, "document_tokens": len(tokens)}
        row["compile_ms_median"] = round(statistics.median(r["compile_ms"] for r in row["schemas"].values()), 3)
        row["mask_us_per_token_mean"] = round(1e6 * statistics.mean(all_times), 1)
        row["mask_us_per_token_median"] = round(1e6 * statistics.median(all_times), 1)
        report["engines"][engine] = row
    if "llguidance" in engines:  # where they differ: which engine allows tokens the other refuses
        counts = Counter()
        for pair in masks.values():
            a, b = pair["xgrammar"], pair["llguidance"]
            counts["positions"] += a.shape[0]
            counts["equal"] += int((a == b).all(dim=1).sum())
            counts["xgrammar_allows_more"] += int(((a & ~b) != 0).any(dim=1).sum())
            counts["llguidance_allows_more"] += int(((b & ~a) != 0).any(dim=1).sum())
        report["equal_masks"] = dict(counts)
    return report


def run(args, make_llm, tokenizer, log=print) -> dict:
    """The report for ``args.structured_configs`` ({name: plugin_params}, MTP off first)."""
    prompts = heldout_prompts(tokenizer, args.prompts, args.prompt_tokens, seed=PROMPT_SEED)
    prompt_schemas = [schema_of(i) for i in range(len(prompts))]
    configs = args.structured_configs
    llms = {name: make_llm(params) for name, params in configs.items()}
    for llm in llms.values():  # xgrammar's import and each schema's compile, before anything is timed
        for name, schema in SCHEMAS.items():
            llm.generate([prompts[0]], greedy_params(schema, 4))
    report: dict = {
        "scenario": "structured", "rounds": args.rounds, "prompts": len(prompts),
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "target": TARGET,
        "schemas": SCHEMAS, "prompt_schemas": prompt_schemas, "configs": configs,
        "sampled": {**SAMPLED, "seed": f"{SEED_BASE} + prompt index"},
        "unconstrained": "greedy, EOS ignored, max_tokens = MTP off's constrained output length of the same prompt",
    }
    t = time.time()
    twins = unconstrained_twins(configs)
    report["batch 1"] = run_batch1(llms, twins, prompts, prompt_schemas, args.max_tokens, args.rounds, log)
    log(f"structured batch 1 done ({time.time() - t:.0f} s)")
    t = time.time()
    report["sampled batch 1"] = run_sampled(llms, prompts, prompt_schemas, args.max_tokens)
    log(f"structured sampled done ({time.time() - t:.0f} s)")
    t = time.time()
    report[f"batch {args.structured_batch}"] = run_batch(llms, twins, prompts, prompt_schemas,
                                                         args.max_tokens, args.rounds, args.structured_batch)
    report["batch_label"] = f"batch {args.structured_batch}"
    log(f"structured batch {args.structured_batch} done ({time.time() - t:.0f} s)")
    report["validity"] = {
        "greedy": {n: _valid_counts(r["validity"]) for n, r in report["batch 1"]["constrained"].items()},
        "sampled": {n: _valid_counts(r["validity"]) for n, r in report["sampled batch 1"].items()},
    }
    report["greedy_identity"] = {n: {"mismatches": len(r["greedy_mismatches_vs_mtp_off"]),
                                     "prompts": r["greedy_mismatches_vs_mtp_off"]}
                                 for n, r in report["batch 1"]["constrained"].items() if n != BASELINE}
    if args.grammar_engines:
        t = time.time()
        engine = llms[BASELINE].engine
        documents = {}
        for i, name in enumerate(prompt_schemas):  # each schema's first greedy document
            if name not in documents:
                documents[name] = _document(llms[BASELINE], prompts[i], name, args.max_tokens, engine.eos_token_ids)
        report["grammar_engines"] = compare_grammar_engines(tokenizer, engine.model_wrapper.config.vocab_size,
                                                            sorted(engine.eos_token_ids), documents)
        log(f"structured grammar engines done ({time.time() - t:.0f} s)")
    _print_summary(report, log)
    return report


def _document(llm, prompt: list[int], schema: str, max_tokens: int, eos: set) -> list[int]:
    ids = llm.generate([prompt], greedy_params(SCHEMAS[schema], max_tokens))[0].token_ids
    return [t for t in ids if t not in eos]


def _valid_counts(v: dict) -> dict:
    return {"valid": v["valid"], "total": v["total"], "finish_reasons": v["finish_reasons"]}


def _print_summary(report: dict, log) -> None:
    for mode in ("greedy", "sampled"):
        log(f"valid ({mode}): " + ", ".join(f"{n} {v['valid']}/{v['total']}" for n, v in report["validity"][mode].items()))
    log("greedy mismatches vs mtp off: " + ", ".join(f"{n} {v['mismatches']}" for n, v in report["greedy_identity"].items()))
    log("sampled outputs equal to mtp off's: " + ", ".join(f"{n} {r['same_tokens_as_mtp_off']}/{r['validity']['total']}"
                                                           for n, r in report["sampled batch 1"].items() if n != BASELINE))
    b1 = report["batch 1"]
    for name, t in b1["targets"].items():
        log(f"{name}: speed-up constrained {t['speedup_constrained']:.2f}x (per request worst "
            f"{t['speedup_constrained_per_request']['min']:.2f} median {t['speedup_constrained_per_request']['median']:.2f}),"
            f" unconstrained {t['speedup_unconstrained']:.2f}x (worst {t['speedup_unconstrained_per_request']['min']:.2f}"
            f" median {t['speedup_unconstrained_per_request']['median']:.2f}); gain ratio {t['gain_ratio']}, "
            f"speed-up ratio {t['speedup_ratio']:.2f}")
    label = report["batch_label"]
    for name in b1["constrained"]:
        log(f"{name}: mask share batch 1 {b1['constrained'][name]['mask_share']}, {label} "
            f"{report[label]['constrained'][name]['mask_share']}; {label} constrained "
            f"{report[label]['constrained'][name]['tokens_per_s_median']:.0f} tok/s")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b1 = report["batch 1"]
    label = report["batch_label"]
    names = [n for n in b1["constrained"] if n != BASELINE]
    engines = report.get("grammar_engines", {}).get("engines", {})
    fig, axes = plt.subplots(2, 2, figsize=(14, 10))
    axes = axes.ravel()
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"]
    ax = axes[0]
    hi = 1.0
    for name, color in zip(names, colors):
        c = b1["constrained"][name]["speedup_per_request"]["values"]
        u = b1["unconstrained"][b1["targets"][name]["unconstrained_from"]]["speedup_per_request"]["values"]
        ax.scatter(u, c, s=14, color=color, alpha=0.75, label=name)
        hi = max(hi, max(c), max(u))
    lo = 0.5
    xs = np.linspace(lo, hi * 1.05, 10)
    ax.plot(xs, xs, color="gray", lw=0.8, label="equal")
    ax.plot(xs, 1 + TARGET * (xs - 1), color="#c44e52", lw=0.8, ls="--", label=f"{TARGET:.0%} of the gain")
    ax.set_xlabel("unconstrained speed-up vs MTP off (per request)")
    ax.set_ylabel("constrained speed-up vs MTP off (per request)")
    ax.set_title("batch 1, greedy", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1]
    data, ticks, kinds = [], [], []
    for name in names:  # an unconstrained twin once, before the configurations it stands for
        twin = b1["targets"][name]["unconstrained_from"]
        if f"{twin}\nunconstrained" not in ticks:
            data.append(b1["unconstrained"][twin]["speedup_per_request"]["values"])
            ticks.append(f"{twin}\nunconstrained")
            kinds.append("#c7d3e8")
        data.append(b1["constrained"][name]["speedup_per_request"]["values"])
        ticks.append(f"{name}\nconstrained")
        kinds.append("#f2c9ad")
    box = ax.boxplot(data, patch_artist=True)
    for patch, color in zip(box["boxes"], kinds):
        patch.set_facecolor(color)
    ax.set_xticks(range(1, len(ticks) + 1), ticks, rotation=20, ha="right", fontsize=7)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("speed-up vs MTP off (per request)")
    ax.set_title("per request speed-ups, batch 1", fontsize=9)
    ax = axes[2]
    all_names = list(b1["constrained"])
    x = np.arange(len(all_names))
    shares1 = [100 * (b1["constrained"][n]["mask_share"] or 0) for n in all_names]
    sharesb = [100 * (report[label]["constrained"][n]["mask_share"] or 0) for n in all_names]
    ax.bar(x - 0.2, shares1, 0.4, label="batch 1", color="#4c72b0")
    ax.bar(x + 0.2, sharesb, 0.4, label=label, color="#dd8452")
    ax.set_xticks(x, all_names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("structured output host time / wall time (%)")
    ax.set_title("mask share (row masks + draft masks), greedy constrained", fontsize=9)
    ax.legend(fontsize=8)
    if not engines:
        axes[3].axis("off")
    else:
        ax = axes[3]
        schemas = list(next(iter(engines.values()))["schemas"])
        x = np.arange(len(schemas))
        width = 0.8 / len(engines)
        for j, (engine, row) in enumerate(engines.items()):
            ax.bar(x + (j - (len(engines) - 1) / 2) * width, [row["schemas"][s]["mask_us_per_token"] for s in schemas],
                   width, label=f"{engine} (compile median {row['compile_ms_median']:.1f} ms)", color=colors[j])
        ax.set_xticks(x, schemas, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("mask fill per token (us)")
        ax.set_title("grammar engines along each schema's greedy document", fontsize=9)
        ax.legend(fontsize=7)
    g, s = report["validity"]["greedy"], report["validity"]["sampled"]
    fig.suptitle(f"JSON-schema constrained decoding, {report.get('device', 'cpu')}, {report['prompts']} prompts, "
                 f"medians of {report['rounds']} rounds; valid greedy "
                 f"{sum(v['valid'] for v in g.values())}/{sum(v['total'] for v in g.values())}, sampled "
                 f"{sum(v['valid'] for v in s.values())}/{sum(v['total'] for v in s.values())}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
