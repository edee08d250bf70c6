"""Structured output end to end on the shipped model: every output fits its format (JSON schemas
checked with jsonschema, a regex, a choice, an EBNF grammar), and speculation changes nothing:
greedy and seeded sampled tokens are identical with MTP off, vanilla, eagle (drafts masked or
not), draft trees, suffix drafts, async scheduling, prefix caching and preemption, with
constrained and free sequences in one batch."""
import json
import re

import jsonschema
import pytest

from mindspec import LLM, SamplingParams
from mindspec.plugins.structured_output.grammars import StructuredOutputError

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "address"]}
ORDER = {"type": "object", "properties": {
    "status": {"enum": ["open", "paid", "shipped"]},
    "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
        "sku": {"type": "string", "maxLength": 6}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"]}},
    "total": {"type": "number"}, "gift": {"type": "boolean"}},
    "required": ["status", "items", "total", "gift"]}
GRAMMAR = 'root ::= "def " name "(" name "):"\nname ::= [a-z] [a-z_]{0,7}'
REGEX = r"[A-Z][a-z]{2,8} [0-9]{2}"
CHOICES = ["alpha", "beta", "gamma delta"]
FORMATS = [dict(json_schema=PERSON), dict(json_schema=ORDER), dict(regex=REGEX), dict(choice=CHOICES),
           dict(grammar=GRAMMAR), dict(json_object=True), {}]  # {}: a free sequence in the same batch
PROMPTS = ["def read_config(path):", "import json\n\n", "class Order:\n    ", "# parse the header\n",
           "for key, value in", "    return {", "x = [", "\"\"\"Utilities"]
MAX_TOKENS = 96
MTP = {"vanilla": {"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "vanilla"},
       "eagle": {"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "eagle"},
       "eagle-unmasked-drafts": {"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "eagle", "mask_drafts": False},
       "tree": {"plugin_type": "mtp", "tree": "dynamic", "num_speculative_tokens": 3, "tree_topk": 2,
                "num_draft_tokens": 6, "mtp_mode": "eagle"},
       "suffix": {"plugin_type": "mtp,suffix", "num_speculative_tokens": 2, "mtp_mode": "eagle", "suffix_min_match": 1},
       "structured-listed": {"plugin_type": "mtp,structured_output", "num_speculative_tokens": 2, "mtp_mode": "vanilla"}}


def _llm(plugin_params=None, **kw):
    return LLM(plugin_params=plugin_params, dtype="float32", progress=False, **kw)


def _batch(**sampling):
    prompts = [p for p in PROMPTS for _ in FORMATS][:28]
    params = [SamplingParams(max_tokens=MAX_TOKENS, **FORMATS[i % len(FORMATS)], **sampling) for i in range(len(prompts))]
    return prompts, params


def _check_format(params: SamplingParams, text: str, finish_reason: str) -> None:
    if not params.has_structured or (params.json_object and finish_reason == "length"):
        return  # a free JSON object may hold a string longer than max_tokens
    assert finish_reason == "stop", (params.structured, text)
    if params.json_schema is not None:
        jsonschema.validate(json.loads(text), params.json_schema)
    elif params.json_object:
        assert isinstance(json.loads(text), dict)
    elif params.regex is not None:
        assert re.fullmatch(REGEX, text), text
    elif params.choice is not None:
        assert text in CHOICES
    else:
        assert re.fullmatch(r"def [a-z][a-z_]{0,7}\([a-z][a-z_]{0,7}\):", text), text


@pytest.fixture(scope="module")
def reference():
    llm = _llm()
    greedy = _batch(temperature=0)
    sampled = _batch(temperature=0.9, top_p=0.95, seed=7)
    return {"greedy": (greedy, llm.generate(*greedy)), "sampled": (sampled, llm.generate(*sampled))}


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_every_output_fits_its_format(reference, mode):
    (_, params), outs = reference[mode]
    for p, o in zip(params, outs):
        _check_format(p, o.text, o.finish_reason)


@pytest.mark.slow
@pytest.mark.parametrize("config", list(MTP))
def test_speculation_keeps_every_token(reference, config):
    llm = _llm(MTP[config])
    for mode in ("greedy", "sampled"):
        (prompts, params), ref = reference[mode]
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref], (config, mode)


def test_drafts_under_the_format_are_kept_more_often(reference):
    """Unmasked drafts follow the model's own taste (code), which the format mostly refuses."""
    (prompts, params), _ = reference["greedy"]
    schema = [i for i, p in enumerate(params) if p.json_schema is not None]
    kept = {}
    for config in ("eagle", "eagle-unmasked-drafts"):
        llm = _llm({**MTP[config], "adaptive_speculation": False})
        llm.generate([prompts[i] for i in schema], [params[i] for i in schema])
        kept[config] = llm.engine.spec_stats.num_accepted_tokens / llm.engine.spec_stats.num_draft_tokens
    assert kept["eagle"] > 0.5 and kept["eagle"] > 3 * kept["eagle-unmasked-drafts"], kept


def test_one_request_alone_equals_its_batch(reference):
    (prompts, params), ref = reference["greedy"]
    llm = _llm(MTP["eagle"])
    for i in (0, 3, 6):
        assert llm.generate([prompts[i]], params[i])[0].token_ids == ref[i].token_ids


@pytest.mark.slow
@pytest.mark.parametrize("engine_kw", [dict(async_scheduling=True), dict(enable_prefix_caching=True),
                                       dict(num_blocks=24, cache_block_size=16)])
def test_async_prefix_caching_and_preemption_keep_every_token(reference, engine_kw):
    (prompts, params), ref = reference["greedy"]
    llm = _llm(MTP["vanilla"], **engine_kw)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    if "num_blocks" in engine_kw:
        assert sum(o.num_preemptions for o in outs) > 0


def test_ignore_eos_and_min_tokens_end_with_the_format():
    llm = _llm(MTP["eagle"])
    outs = llm.generate(["x = ", "y = "], [SamplingParams(temperature=0, max_tokens=40, choice=CHOICES, ignore_eos=True),
                                          SamplingParams(temperature=0, max_tokens=40, choice=CHOICES, min_tokens=30)])
    for o in outs:
        assert o.text in CHOICES and o.finish_reason == "stop"


@pytest.mark.parametrize("params, field", [
    (SamplingParams(json_schema={"type": "objectx"}), "json_schema"),
    (SamplingParams(regex="a("), "regex"),
    (SamplingParams(grammar="root ::= nothing_here"), "grammar"),
])
def test_a_bad_format_is_rejected_naming_its_field(params, field):
    llm = _llm()
    with pytest.raises(StructuredOutputError, match=f"^invalid {field}: ") as info:
        llm.generate(["x"], params)
    assert info.value.field == field
    assert llm.generate(["x"], SamplingParams(temperature=0, max_tokens=4))[0].token_ids  # the engine goes on


def test_medusa_keeps_every_token(reference):
    llm = _llm({"plugin_type": "medusa"})
    for mode in ("greedy", "sampled"):
        (prompts, params), ref = reference[mode]
        outs = llm.generate(prompts[:14], params[:14])
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref[:14]], mode


@pytest.mark.slow
def test_pd_decode_node_rebuilds_the_matcher(reference):
    """The prefill node draws the first token under the format; the decode node's matcher
    catches up from the handed-off tokens."""
    (prompts, params), ref = reference["greedy"]
    mtp = {**MTP["eagle"], "adaptive_speculation": False}
    prefill = _llm({**mtp, "pd_role": "prefill"})
    decode = _llm({**mtp, "pd_role": "decode"})
    picked = [0, 1, 2, 3, 4, 6]
    states = [decode.engine.add_prefilled_request(prefill.engine.prefill_for_handoff(prompts[i], params[i]), params[i])
              for i in picked]
    outs = decode.engine.run(states)
    assert [o.token_ids for o in outs] == [ref[i].token_ids for i in picked]


@pytest.mark.slow
def test_dp2_keeps_every_token(reference):
    (prompts, params), ref = reference["greedy"]
    llm = _llm({**MTP["vanilla"], "adaptive_speculation": False}, dp=2, dist_timeout=60)
    try:
        outs = llm.generate(prompts[:14], params[:14])
    finally:
        llm.close()
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref[:14]]
    schema = [o.spec_decode for o, p in zip(outs, params) if p.json_schema is not None]
    kept = sum(s.num_accepted_tokens for s in schema) / sum(s.num_draft_tokens for s in schema)
    assert kept > 0.5  # each rank drafted its own sequences under their formats
