"""``mindspec bench --scenario structured``: its output check, which unconstrained runs stand for
which configuration, and one tiny end-to-end run that writes its JSON and PNG."""
import json
from types import SimpleNamespace

import pytest

from mindspec.bench import structured
from mindspec.bench.main import main
from mindspec.bench.structured_schemas import SCHEMAS, schema_of


def test_schemas_are_bounded_and_assigned_round_robin():
    assert list(SCHEMAS) == ["nested_object", "enums", "array_of_objects", "numbers", "booleans"]
    assert [schema_of(i) for i in range(6)] == list(SCHEMAS) + ["nested_object"]

    def bounded(schema):  # every string has a maxLength (or a fixed pattern/enum), every array a maxItems
        types = schema.get("type")
        types = types if isinstance(types, list) else [types]
        if "string" in types and "enum" not in schema:
            assert "maxLength" in schema or "pattern" in schema, schema
        if "array" in types:
            assert "maxItems" in schema, schema
            bounded(schema["items"])
        for sub in schema.get("properties", {}).values():
            bounded(sub)

    for schema in SCHEMAS.values():
        bounded(schema)


def test_check_output_parses_then_validates():
    schema = SCHEMAS["enums"]
    good = {"status": "open", "priority": 2, "kind": "bug", "assignee": None}
    assert structured.check_output(json.dumps(good), schema) is None
    assert structured.check_output('{"status": "open"', schema).startswith("json:")
    assert structured.check_output(json.dumps({**good, "priority": 7}), schema).startswith("schema:")
    # a raw control character inside a string is not JSON (json.loads is strict)
    assert structured.check_output('{"a": "x\x01"}', {"type": "object"}).startswith("json:")


def test_mask_drafts_false_shares_the_unconstrained_runs_of_its_configuration():
    twins = structured.unconstrained_twins(structured.CONFIGS)
    assert twins == {"mtp off": "mtp off", "eagle K=3": "eagle K=3", "vanilla K=3": "vanilla K=3",
                     "eagle K=3 no draft masks": "eagle K=3"}
    alone = {k: structured.CONFIGS[k] for k in ("mtp off", "eagle K=3 no draft masks")}
    assert structured.unconstrained_twins(alone)["eagle K=3 no draft masks"] == "eagle K=3 no draft masks"


def test_validity_counts_per_schema_and_keeps_the_invalid_ones():
    def out(text, reason="stop"):
        return SimpleNamespace(text=text, token_ids=[0] * len(text), finish_reason=reason)

    v = structured.validity([out('{"enabled": true}'), out('{"status": "open", "priority": 1, "kind": "bug", '
                                                            '"assignee": "bob"}'), out('{"order', "length")],
                            ["booleans", "enums", "array_of_objects"])
    assert (v["valid"], v["total"], v["finish_reasons"]) == (1, 3, {"stop": 2, "length": 1})
    assert v["per_schema"]["enums"]["valid"] == 1 and v["per_schema"]["booleans"]["valid"] == 0
    assert [(i["prompt"], i["finish_reason"]) for i in v["invalid"]] == [(0, "stop"), (2, "length")]


@pytest.mark.slow
def test_structured_scenario_writes_json_and_png(tmp_path):
    out = tmp_path / "structured"
    rc = main(["--scenario", "structured", "--configs", "eagle K=3", "--prompts", "3", "--rounds", "1",
               "--max-tokens", "96", "--structured-batch", "2", "--threads", "1", "--out", str(out)])
    assert rc == 0 and out.with_suffix(".png").stat().st_size > 10_000
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["scenario"] == "structured" and list(report["configs"]) == ["mtp off", "eagle K=3"]
    assert report["prompt_schemas"] == ["nested_object", "enums", "array_of_objects"]
    for mode in ("greedy", "sampled"):
        for name, v in report["validity"][mode].items():
            assert v["total"] == 3 and 0 <= v["valid"] <= 3 and sum(v["finish_reasons"].values()) == 3, (mode, name)
    for name, row in report["batch 1"]["constrained"].items():
        v = row["validity"]
        assert v["valid"] == sum(s["valid"] for s in v["per_schema"].values())
        assert v["valid"] + len(v["invalid"]) == v["total"]  # fewer than MAX_INVALID_KEPT invalid here
        assert 0 <= row["mask_share"] < 1 and row["steps"] > 0 and row["identical_across_rounds"]
    assert report["greedy_identity"] == {"eagle K=3": {"mismatches": 0, "prompts": []}}  # lossless
    b1 = report["batch 1"]
    assert b1["unconstrained"]["mtp off"]["lengths_match_constrained_mtp_off"]
    assert b1["constrained"]["mtp off"]["speedup_aggregate"] == 1.0
    assert b1["constrained"]["mtp off"]["mask_share"] > 0 and "draft_mask_share" in b1["constrained"]["eagle K=3"]
    target = b1["targets"]["eagle K=3"]
    assert target["unconstrained_from"] == "eagle K=3" and len(target["speedup_ratio_per_request"]["values"]) == 3
    assert {"gain_ratio", "speedup_ratio", "meets_target_gain", "meets_target_speedup_ratio"} <= set(target)
    assert b1["constrained"]["eagle K=3"]["mean_accepted_length"] >= 1.0
    batch = report[report["batch_label"]]
    assert report["batch_label"] == "batch 2" and batch["requests"] == 2
    assert list(batch["constrained"]) == list(batch["unconstrained"]) == ["mtp off", "eagle K=3"]
    assert batch["constrained"]["eagle K=3"]["tokens_per_s_median"] > 0 and "mask_share" in batch["constrained"]["mtp off"]
    engines = report["grammar_engines"]["engines"]
    assert set(engines["xgrammar"]["schemas"]) == {"nested_object", "enums", "array_of_objects"}
    for row in engines.values():  # every engine walks each greedy document to its end
        assert all(s["accepted_tokens"] == s["document_tokens"] for s in row["schemas"].values())
