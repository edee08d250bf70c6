"""plugin_params validation: every bad input is one PluginParamsError naming what is wrong."""
import json

import pytest

from mindspec.config.plugin_params import PluginParamsError, parse_plugin_params
from mindspec.plugins.mtp.params import parse_mtp_params
from mindspec.plugins.plugin import PluginError, plugin_class


def _mtp(raw):
    parsed = parse_plugin_params(raw)
    return parse_mtp_params(parsed.options)


BAD = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('"mtp"', "must be a JSON object"),
    (json.dumps({"plugin_type": "mtp", "x": "a" * 1100}), "at most 1024"),
    ({"num_speculative_tokens": 1}, "plugin_type"),
    ({"plugin_type": "", "num_speculative_tokens": 1}, "plugin_type"),
    ({"plugin_type": 3}, "plugin_type"),
    ({"plugin_type": "mtp, mtp", "num_speculative_tokens": 1}, "twice"),
    ({"plugin_type": "mtp"}, "num_speculative_tokens is required"),
    ({"plugin_type": "mtp", "num_speculative_tokens": 0}, r"num_speculative_tokens must be in 1\.\.5"),
    ({"plugin_type": "mtp", "num_speculative_tokens": 6}, r"num_speculative_tokens must be in 1\.\.5"),
    ({"plugin_type": "mtp", "num_speculative_tokens": "2"}, "num_speculative_tokens must be an integer"),
    ({"plugin_type": "mtp", "num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
    ({"plugin_type": "mtp", "num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer"),
    ({"plugin_type": "mtp", "num_speculative_tokens": 1, "mtp_mode": "medusa"}, "mtp_mode must be one of"),
    ({"plugin_type": "mtp", "num_speculative_tokens": 1, "decoding_policy": "greedy"}, "decoding_policy must be one of"),
    ({"plugin_type": "mtp", "num_speculative_tokens": 1, "decoding_policy": "relaxed"}, "think_start_token_id"),
    ({"plugin_type": "mtp", "num_speculative_tokens": 1, "relaxed_delta": 1.5}, "relaxed_delta"),
    ({"plugin_type": "mtp", "num_speculative_tokens": 1, "relaxed_topk": 0}, "relaxed_topk"),
    ({"plugin_type": "mtp", "num_speculative_tokens": 1, "posterior_threshold": -0.1}, "posterior_threshold"),
    ({"plugin_type": "mtp", "num_speculative_tokens": 1, "pd_role": "master"}, "pd_role must be one of"),
    ({"plugin_type": "mtp", "num_speculative_tokens": 1, "num_speculative_token": 2}, "num_speculative_token is not an MTP option"),
    ({"plugin_type": "mtp", "num_speculative_tokens": 1, "think_start_token_id": -3}, "think_start_token_id"),
    ({"plugin_type": "mtp", "num_speculative_tokens": 2, "simulated_acceptance": [0.9]}, "simulated_acceptance must be a list of"),
    ({"plugin_type": "mtp", "num_speculative_tokens": 2, "simulated_acceptance": [0.5, 0.7]}, "non-increasing"),
    ({"plugin_type": "mtp", "num_speculative_tokens": 1, "simulated_acceptance": [1.5]}, "simulated_acceptance"),
    ({"plugin_type": "mtp", "num_speculative_tokens": 1, "simulated_acceptance": "0.9"}, "simulated_acceptance"),
    ({"plugin_type": "mtp", "num_speculative_tokens": 1, "simulated_acceptance": [True]}, "simulated_acceptance"),
    # draft trees
    ({"plugin_type": "mtp", "tree_choices": [[0, 1]]}, r"path \[0, 1\] needs its parent \[0\]"),
    ({"plugin_type": "mtp", "tree_choices": "[[0]]"}, "tree_choices must be a non-empty list"),
    ({"plugin_type": "mtp", "tree_choices": [[0], [0, 0]], "num_speculative_tokens": 3}, "must equal the depth"),
    ({"plugin_type": "mtp", "tree_choices": [[0]] + [[0] * d for d in range(2, 7)]}, r"num_speculative_tokens must be in 1\.\.5"),
    ({"plugin_type": "mtp", "tree_choices": [[0]], "tree_topk": 2}, "tree_topk is for"),
    ({"plugin_type": "mtp", "tree": "dynamic", "num_speculative_tokens": 2, "tree_choices": [[0]]}, "describes a static tree"),
    ({"plugin_type": "mtp", "tree": "static", "num_speculative_tokens": 2}, "tree_choices is required"),
    ({"plugin_type": "mtp", "tree": "beam", "num_speculative_tokens": 2}, "tree must be one of static, dynamic"),
    ({"plugin_type": "mtp", "tree": "dynamic"}, "num_speculative_tokens is required"),
    ({"plugin_type": "mtp", "tree": "dynamic", "num_speculative_tokens": 2, "tree_topk": 0}, r"tree_topk must be in 1\.\.16"),
    ({"plugin_type": "mtp", "tree": "dynamic", "num_speculative_tokens": 2, "tree_topk": 2, "num_draft_tokens": 7},
     r"num_draft_tokens must be in 1\.\.6"),
    ({"plugin_type": "mtp", "num_speculative_tokens": 2, "num_draft_tokens": 4}, "num_draft_tokens needs a draft tree"),
    ({"plugin_type": "mtp", "tree": "dynamic", "num_speculative_tokens": 2, "suffix_drafting": True},
     "suffix_drafting cannot be combined with a draft tree"),
    ({"plugin_type": "mtp", "tree": "dynamic", "num_speculative_tokens": 2, "simulated_acceptance": [0.5, 0.4]},
     "simulated_acceptance cannot be combined with a draft tree"),
]


@pytest.mark.parametrize("raw, message", BAD)
def test_bad_plugin_params_name_the_problem(raw, message):
    with pytest.raises(PluginParamsError, match=message):
        _mtp(raw)


def test_unknown_plugin_is_named():
    with pytest.raises(PluginError, match="unknown plugin 'lookahead'"):
        plugin_class("lookahead")


def test_string_and_object_forms_agree():
    a = _mtp('{"plugin_type": "mtp", "num_speculative_tokens": 2, "mtp_mode": "eagle"}')
    b = _mtp({"plugin_type": "mtp", "num_speculative_tokens": 2, "mtp_mode": "eagle"})
    assert a == b and a.num_speculative_tokens == 2 and a.decoding_policy == "strict"


def test_mode_resolution_against_checkpoint_modules():
    p = _mtp({"plugin_type": "mtp", "num_speculative_tokens": 3})
    assert p.resolved_mode(3) == "vanilla" and p.resolved_mode(1) == "eagle"
    assert p.modules_needed(1) == 1 and p.modules_needed(5) == 3
    vanilla = _mtp({"plugin_type": "mtp", "num_speculative_tokens": 3, "mtp_mode": "vanilla"})
    with pytest.raises(PluginParamsError, match="mtp_mode 'vanilla' needs 3 MTP modules"):
        vanilla.resolved_mode(1)
    with pytest.raises(PluginParamsError, match="MTP modules"):
        _mtp({"plugin_type": "mtp", "num_speculative_tokens": 1, "mtp_mode": "eagle"}).resolved_mode(0)


def test_no_plugin_params_means_no_plugin():
    assert not parse_plugin_params(None).enabled and not parse_plugin_params("").enabled
    both = parse_plugin_params('{"plugin_type": "mtp,prefix_cache"}')
    assert both.plugin_types == ("mtp",) and both.prefix_cache  # prefix caching is an engine feature


def test_simulated_acceptance_is_kept_as_rates():
    params = _mtp({"plugin_type": "mtp", "num_speculative_tokens": 3, "simulated_acceptance": [0.9, 0.8, 0.8]})
    assert params.simulated_acceptance == (0.9, 0.8, 0.8)
    assert _mtp({"plugin_type": "mtp", "num_speculative_tokens": 3}).simulated_acceptance is None


def test_tree_options_parse_to_a_shape():
    static = _mtp({"plugin_type": "mtp", "tree_choices": [[0], [1], [0, 0]]})
    assert static.num_speculative_tokens == 2 and static.tree == "static" and static.adaptive_speculation
    assert static.tree_shape().num_nodes == 3
    dynamic = _mtp('{"plugin_type": "mtp", "tree": "dynamic", "num_speculative_tokens": 4, "tree_topk": 3, '
                   '"num_draft_tokens": 10}')
    shape = dynamic.tree_shape()
    assert shape.dynamic and shape.depth == 4 and shape.num_nodes == 10 and shape.expanded == (1, 3, 3, 3)
    assert _mtp({"plugin_type": "mtp", "num_speculative_tokens": 2}).tree_shape() is None
