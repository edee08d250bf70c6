"""Benchmark workloads: edit prompts built from held-out functions, the mixed workload, and the
per-request speed-up distribution the bench reports for them."""
import json

import pytest

from mindspec.bench import speed, workloads
from mindspec.bench.corpus import corpus_files, read
from mindspec.bench.main import main
from mindspec.config.defaults import default_model_dir


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def test_edit_prompts_hold_a_held_out_function_and_ask_for_it_renamed(tokenizer):
    prompts = workloads.edit_prompts(tokenizer, 12)
    held = "\n".join(read(p) for p in corpus_files()[1])
    assert len(prompts) == 12 and len({tuple(p) for p in prompts}) == 12
    for ids in prompts:
        assert ids[0] == tokenizer.bos_token_id and len(ids) <= workloads.EDIT_PROMPT_TOKENS
        text = tokenizer.decode(ids[1:])
        source, request = text.split("\n\n\n# The same function, renamed to ")
        new_name, header = request.split(":\n", 1)
        assert new_name.endswith("_v2") and header.startswith(f"def {new_name}(") and header.endswith("\n")
        first_line = source.split("\n", 1)[0].strip()
        assert first_line in held  # the function comes from a held-out file (dedented: compare a line)


def test_edit_text_renames_the_def_line_only():
    source = "def area(w, h):\n    # area(w, h) of a rectangle\n    return w * h\n"
    text = workloads.edit_text("area", source.rstrip("\n"))
    assert text.startswith(source.rstrip("\n"))
    assert text.endswith("# The same function, renamed to area_v2:\ndef area_v2(w, h):\n")


def test_mixed_alternates_continue_and_edit_and_unknown_is_an_error(tokenizer):
    mixed = workloads.prompts_for("mixed", tokenizer, 5, 32)
    cont = workloads.prompts_for("continue", tokenizer, 3, 32)
    edit = workloads.prompts_for("edit", tokenizer, 2, 32)
    assert mixed == [cont[0], edit[0], cont[1], edit[1], cont[2]]
    assert workloads.max_prompt_tokens("continue", 64) == 65
    assert workloads.max_prompt_tokens("edit", 64) == workloads.EDIT_PROMPT_TOKENS
    with pytest.raises(ValueError, match="continue, edit, mixed"):
        workloads.prompts_for("chat", tokenizer, 1, 32)


def test_per_group_speedup_is_the_ratio_of_median_times_per_group():
    base = [[1.0, 2.0, 4.0], [1.2, 2.0, 4.0], [0.8, 2.2, 4.0]]  # rounds x groups
    mine = [[0.5, 2.0, 2.0], [0.5, 2.5, 2.0], [0.6, 2.0, 1.0]]
    out = speed.per_group_speedup(mine, base)
    assert out["values"] == [2.0, 1.0, 2.0] and out["min"] == 1.0 and out["median"] == 2.0 and out["max"] == 2.0


@pytest.mark.slow
def test_bench_edit_workload_reports_each_requests_speedup(tmp_path):
    out = tmp_path / "edit"
    rc = main(["--workload", "edit", "--batches", "1", "--rounds", "1", "--new-tokens", "6", "--configs",
               "mtp off,suffix K=8,eagle K=3 adaptive", "--no-async", "--no-hf", "--no-profile", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["workload"] == "edit"
    rows = report["results"]["batch 1"]
    for name in ("suffix K=8", "eagle K=3 adaptive"):
        per = rows[name]["speedup_per_group"]
        assert len(per["values"]) == report["prompts_per_batch"]["batch 1"]
        assert per["min"] <= per["median"] <= per["p90"] <= per["max"]
        assert rows[name]["identical_to_mtp_off"]
    assert rows["mtp off"]["speedup_per_group"]["values"] == [1.0] * report["prompts_per_batch"]["batch 1"]
    assert out.with_suffix(".png").stat().st_size > 10_000
