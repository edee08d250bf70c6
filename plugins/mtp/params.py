"""MTP options from ``plugin_params`` (MindIE keys plus mindspec's policy keys), validated.

Every bad value is one PluginParamsError naming the key.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from mindspec.config.plugin_params import PluginParamsError
from mindspec.modeling.draft_tree import TreeShape, TreeShapeError

MAX_SPECULATIVE_TOKENS = 5
MTP_MODES = ("vanilla", "eagle")
POLICIES = ("strict", "relaxed", "typical")
TREE_KINDS = ("static", "dynamic")
PD_ROLES = ("standard", "prefill", "decode")
KNOWN_KEYS = {
    "num_speculative_tokens", "mtp_mode", "decoding_policy", "relaxed_topk", "relaxed_delta",
    "think_start_token_id", "think_end_token_id", "posterior_threshold", "posterior_alpha", "pd_role",
    "adaptive_speculation", "simulated_acceptance", "suffix_drafting", "suffix_max_drafts", "suffix_min_match",
    "tree", "tree_choices", "tree_topk", "num_draft_tokens",
}
MAX_SUFFIX_DRAFTS = 15  # the graph runner's verification rows per sequence less the fed token


@dataclass(frozen=True)
class MtpParams:
    num_speculative_tokens: int
    mtp_mode: Optional[str] = None  # None: vanilla when the checkpoint has >= K modules, else eagle
    decoding_policy: str = "strict"
    relaxed_topk: int = 1
    relaxed_delta: float = 0.0
    think_start_token_id: Optional[int] = None
    think_end_token_id: Optional[int] = None
    posterior_threshold: float = 0.09  # Medusa's epsilon
    posterior_alpha: float = 0.3  # Medusa's alpha (about sqrt(epsilon))
    pd_role: str = "standard"
    # Per step, speculate or not by measured throughput at the batch size (adaptive.py).
    adaptive_speculation: bool = True
    # Benchmarking only (SGLang's SGLANG_SIMULATE_ACC_LEN): draft j is accepted with probability
    # simulated_acceptance[j - 1], whatever the target says; output is no longer the model's.
    simulated_acceptance: Optional[tuple[float, ...]] = None
    # Per sequence and step, verify suffix drafts (the sequence's own repeats: plugins/suffix)
    # instead of MTP's when they promise more tokens; up to suffix_max_drafts of them, drafted
    # when the repeated suffix has >= suffix_min_match tokens.
    suffix_drafting: bool = False
    suffix_max_drafts: int = 8
    suffix_min_match: int = 3
    # Draft trees (modeling/draft_tree.py): "static" from tree_choices (Medusa's paths of top-k
    # ranks), "dynamic" (EAGLE-2: tree_topk candidates per expanded node, the num_draft_tokens
    # best verified); num_speculative_tokens is the tree's depth.
    tree: Optional[str] = None
    tree_choices: Optional[tuple[tuple[int, ...], ...]] = None
    tree_topk: int = 4
    num_draft_tokens: int = 8

    def tree_shape(self) -> Optional[TreeShape]:
        if self.tree is None:
            return None
        if self.tree == "static":
            return TreeShape.static(self.tree_choices)
        return TreeShape.dynamic_tree(self.num_speculative_tokens, self.tree_topk, self.num_draft_tokens)

    def resolved_mode(self, modules_in_checkpoint: int) -> str:
        k = self.num_speculative_tokens
        if self.mtp_mode is None:
            return "vanilla" if modules_in_checkpoint >= k else "eagle"
        if self.mtp_mode == "vanilla" and modules_in_checkpoint < k:
            raise PluginParamsError(
                f"plugin_params.mtp_mode 'vanilla' needs {k} MTP modules (num_speculative_tokens={k}) "
                f"but the checkpoint has {modules_in_checkpoint}; use mtp_mode 'eagle'"
            )
        if modules_in_checkpoint < 1:
            raise PluginParamsError("plugin_params.plugin_type 'mtp' needs a checkpoint with MTP modules (none found)")
        return self.mtp_mode

    def modules_needed(self, modules_in_checkpoint: int) -> int:
        mode = self.resolved_mode(modules_in_checkpoint)
        return self.num_speculative_tokens if mode == "vanilla" else 1


def _int(options: dict, key: str, lo: int, hi: Optional[int] = None, default: Any = ...) -> Any:
    if key not in options:
        if default is ...:
            raise PluginParamsError(f"plugin_params.{key} is required for plugin_type 'mtp'")
        return default
    value = options[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise PluginParamsError(f"plugin_params.{key} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise PluginParamsError(f"plugin_params.{key} must be in {rng}, got {value}")
    return value


def _float(options: dict, key: str, lo: float, hi: float, default: float) -> float:
    value = options.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise PluginParamsError(f"plugin_params.{key} must be a number in [{lo}, {hi}], got {value!r}")
    return float(value)


def _choice(options: dict, key: str, choices: tuple[str, ...], default: Optional[str]) -> Optional[str]:
    value = options.get(key, default)
    if value is not None and value not in choices:
        raise PluginParamsError(f"plugin_params.{key} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _bool(options: dict, key: str, default: bool) -> bool:
    value = options.get(key, default)
    if not isinstance(value, bool):
        raise PluginParamsError(f"plugin_params.{key} must be true or false, got {value!r}")
    return value


def _rates(options: dict, key: str, k: int) -> Optional[tuple[float, ...]]:
    """K non-increasing rates in [0, 1]: the share of steps whose draft j is accepted."""
    if key not in options or options[key] is None:
        return None
    value = options[key]
    ok = isinstance(value, (list, tuple)) and len(value) == k and all(
        not isinstance(v, bool) and isinstance(v, (int, float)) and 0 <= v <= 1 for v in value)
    if not ok or any(b > a for a, b in zip(value, value[1:])):
        raise PluginParamsError(
            f"plugin_params.{key} must be a list of num_speculative_tokens={k} non-increasing rates in [0, 1] "
            f"(the share of steps accepting draft 1, 2, ...), got {value!r}")
    return tuple(float(v) for v in value)


def _tree_options(options: dict) -> dict:
    """The tree keys, checked; num_speculative_tokens defaults to a static tree's depth."""
    kind = _choice(options, "tree", TREE_KINDS, "static" if "tree_choices" in options else None)
    if kind is None:
        stray = sorted({"tree_topk", "num_draft_tokens"} & set(options))
        if stray:
            raise PluginParamsError(f"plugin_params.{stray[0]} needs a draft tree: set tree_choices or \"tree\": \"dynamic\"")
        return {}
    out = {"tree": kind, "tree_topk": _int(options, "tree_topk", 1, 16, 4),
           "num_draft_tokens": _int(options, "num_draft_tokens", 1, None, 8)}
    if kind == "dynamic":
        if "tree_choices" in options:
            raise PluginParamsError("plugin_params.tree_choices describes a static tree, not \"tree\": \"dynamic\"")
        return out
    if "tree_choices" not in options:
        raise PluginParamsError("plugin_params.tree_choices is required with \"tree\": \"static\"")
    for key in ("tree_topk", "num_draft_tokens"):
        if key in options:
            raise PluginParamsError(f"plugin_params.{key} is for \"tree\": \"dynamic\"; a static tree is its tree_choices")
    try:
        depth = TreeShape.static(options["tree_choices"]).depth
    except TreeShapeError as exc:
        raise PluginParamsError(f"plugin_params.{exc}") from None
    out["tree_choices"] = tuple(tuple(c) for c in options["tree_choices"])
    out["num_speculative_tokens"] = options.get("num_speculative_tokens", depth)
    if out["num_speculative_tokens"] != depth:
        raise PluginParamsError(f"plugin_params.num_speculative_tokens ({out['num_speculative_tokens']}) must equal "
                                f"the depth of tree_choices ({depth}), or be left out")
    return out


def _check_tree(params: MtpParams) -> MtpParams:
    """Combinations a tree step does not take."""
    if params.tree is None:
        return params
    refused = [("suffix_drafting", params.suffix_drafting), ("simulated_acceptance", params.simulated_acceptance)]
    for key, on in refused:
        if on:
            raise PluginParamsError(f"plugin_params.{key} cannot be combined with a draft tree (\"tree\": {params.tree!r})")
    try:
        params.tree_shape()
    except TreeShapeError as exc:
        raise PluginParamsError(f"plugin_params.{exc}") from None
    return params


def parse_mtp_params(options: dict) -> MtpParams:
    unknown = sorted(set(options) - KNOWN_KEYS)
    if unknown:
        raise PluginParamsError(f"plugin_params.{unknown[0]} is not an MTP option (known: {', '.join(sorted(KNOWN_KEYS))})")
    tree = _tree_options(options)
    if "num_speculative_tokens" in tree:
        options = {**options, "num_speculative_tokens": tree.pop("num_speculative_tokens")}
    params = MtpParams(
        num_speculative_tokens=_int(options, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS),
        mtp_mode=_choice(options, "mtp_mode", MTP_MODES, None),
        decoding_policy=_choice(options, "decoding_policy", POLICIES, "strict"),
        relaxed_topk=_int(options, "relaxed_topk", 1, None, 1),
        relaxed_delta=_float(options, "relaxed_delta", 0.0, 1.0, 0.0),
        think_start_token_id=_int(options, "think_start_token_id", 0, None, None),
        think_end_token_id=_int(options, "think_end_token_id", 0, None, None),
        posterior_threshold=_float(options, "posterior_threshold", 0.0, 1.0, 0.09),
        posterior_alpha=_float(options, "posterior_alpha", 0.0, 1.0, 0.3),
        pd_role=_choice(options, "pd_role", PD_ROLES, "standard"),
        adaptive_speculation=_bool(options, "adaptive_speculation", True),
        suffix_drafting=_bool(options, "suffix_drafting", False),
        suffix_max_drafts=_int(options, "suffix_max_drafts", 1, MAX_SUFFIX_DRAFTS, 8),
        suffix_min_match=_int(options, "suffix_min_match", 1, 1024, 3),
    )
    params = replace(params, simulated_acceptance=_rates(options, "simulated_acceptance", params.num_speculative_tokens),
                     **tree)
    if params.decoding_policy == "relaxed" and (params.think_start_token_id is None or params.think_end_token_id is None):
        raise PluginParamsError(
            "plugin_params.think_start_token_id and think_end_token_id are required with decoding_policy 'relaxed'"
        )
    if params.suffix_drafting and params.simulated_acceptance is not None:
        raise PluginParamsError("plugin_params.simulated_acceptance cannot be combined with suffix_drafting "
                                "(simulated rates are per MTP draft position)")
    return _check_tree(params)
