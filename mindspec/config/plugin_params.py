"""``ModelConfig.plugin_params`` as MindIE reads it: a JSON string (or object) of at most 1024
characters whose ``plugin_type`` names one or more plugins separated by commas. ``"mtp,suffix"`` is
the MTP plugin with suffix drafts (its ``suffix_drafting`` option): both draft, one verifies.
``prefix_cache`` (MindIE's name; alone or with others) turns on the engine's prefix caching and
``splitfuse`` its SplitFuse scheduling: in mindspec these are engine features, not plugins."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union

MAX_PLUGIN_PARAMS_CHARS = 1024


class PluginParamsError(ValueError):
    """plugin_params is malformed; the message names the offending key."""


@dataclass(frozen=True)
class PluginParams:
    plugin_types: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)  # every key except plugin_type
    prefix_cache: bool = False  # "prefix_cache" in plugin_type
    splitfuse: bool = False  # "splitfuse" in plugin_type

    @property
    def enabled(self) -> bool:
        return bool(self.plugin_types)

    def as_dict(self, **changes) -> dict:
        """plugin_params that parse back to these (with option ``changes``)."""
        types = self.plugin_types + (("prefix_cache",) if self.prefix_cache else ()) + (
            ("splitfuse",) if self.splitfuse else ())
        return {"plugin_type": ",".join(types), **self.options, **changes}


def parse_plugin_params(raw: Optional[Union[str, dict]]) -> PluginParams:
    if raw is None or raw == "" or raw == {}:
        return PluginParams()
    text = raw if isinstance(raw, str) else json.dumps(raw)
    if len(text) > MAX_PLUGIN_PARAMS_CHARS:
        raise PluginParamsError(f"plugin_params is {len(text)} characters long; at most {MAX_PLUGIN_PARAMS_CHARS} are allowed")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise PluginParamsError(f"plugin_params is not valid JSON: {exc.msg} at character {exc.pos}") from None
    if not isinstance(raw, dict):
        raise PluginParamsError(f"plugin_params must be a JSON object, got {type(raw).__name__}")
    options = dict(raw)
    plugin_type = options.pop("plugin_type", None)
    if not isinstance(plugin_type, str) or not plugin_type.strip():
        raise PluginParamsError(f"plugin_params.plugin_type must be a non-empty string, got {plugin_type!r}")
    types = tuple(t for t in re.split(r",\s*", plugin_type.strip()) if t)
    if len(set(types)) != len(types):
        raise PluginParamsError(f"plugin_params.plugin_type lists a plugin twice: {plugin_type!r}")
    if "mtp" in types and "suffix" in types:  # MTP with suffix drafts per sequence: one drafter
        if options.get("suffix_drafting", True) is not True:
            raise PluginParamsError(f"plugin_params.suffix_drafting must be true with plugin_type {plugin_type!r}, "
                                    f"got {options['suffix_drafting']!r}")
        types = tuple(t for t in types if t != "suffix")
        options["suffix_drafting"] = True
    engine_features = {"prefix_cache", "splitfuse"}
    return PluginParams(plugin_types=tuple(t for t in types if t not in engine_features), options=options,
                        prefix_cache="prefix_cache" in types, splitfuse="splitfuse" in types)
