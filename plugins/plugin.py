"""The Plugin interface: the hooks the PluginManager calls around every forward (MindIE's
``text_generator/plugins/plugin.py``), plus the registry that loads a plugin by name.

Plugins are found as ``mindspec.plugins.{name}.{name}_plugin.{Name}Plugin`` (``mtp`` -> MtpPlugin)
or through the ``mindspec.plugins`` entry-point group.
"""
from __future__ import annotations

import importlib
from abc import ABC
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import numpy as np
    import torch

    from mindspec.text_generator.step import StepBatch, StepInputs, StepOutputs


class PluginError(ValueError):
    """A plugin cannot be loaded or configured."""


class Plugin(ABC):
    """Hooks default to "change nothing", so a plugin implements only what it alters."""

    name = "plugin"
    # KV positions a decode step writes beyond one new token per sequence (MTP: drafts).
    num_lookahead_tokens = 0
    # Tokens after a position that the plugin's own KV entry at that position depends on (MTP
    # module s pairs position i with token i + 1 + s: K); the prefix cache keys blocks with them.
    kv_context_tokens = 0
    # plugin_verify reads the step's SamplingMetadata (inputs.extra["sampling_metadata"]) even
    # when every row is plain greedy, whose sampling otherwise skips building it.
    needs_sampling_metadata = False
    # Whether prepare_masks_for_filling / fill_in_model_result handle this plugin's inputs.
    supports_async_scheduling = True

    def model_inputs_update(self, batch: "StepBatch", inputs: "StepInputs") -> "StepInputs":
        return inputs

    def sample_preprocess(self, batch: "StepBatch", inputs: "StepInputs") -> "StepInputs":
        return inputs

    def token_bitmask(self, batch: "StepBatch", inputs: "StepInputs", row_prefix: "list[list[int]]") -> "Optional[tuple[torch.Tensor, list[int]]]":
        """(bitmask [M, ceil(V / 32)] int32, its M logits rows): the tokens those rows may take
        (structured output), where row r samples after ``row_prefix[r]`` (the drafts before it)
        follow the sequence's output; None: no row is limited."""
        return None

    def plugin_verify(self, batch: "StepBatch", inputs: "StepInputs", outputs: "StepOutputs") -> "StepOutputs":
        return outputs

    def plugin_cache_update(self, batch: "StepBatch", inputs: "StepInputs", outputs: "StepOutputs") -> None:
        pass

    def plugin_cache_clear(self, seq_ids: list[int]) -> None:
        pass

    # ---- prefix caching ---------------------------------------------------------------------------
    def enable_prefix_caching(self) -> None:
        """Cached KV blocks will be shared between sequences: make the caches this plugin writes
        complete enough to be worth sharing."""

    def final_cache_positions(self, seq, finished: bool = False) -> "int | None":
        """Leading positions of ``seq`` whose entries in this plugin's own KV caches are final
        (never written again; ``finished``: the sequence has ended, only a step already built
        may still write); None: the plugin keeps no KV cache of its own."""
        return None

    # ---- async scheduling (MindIE's prepare_masks_for_filling / fill_in_model_result) -----------
    def prepare_masks_for_filling(self, batch: "StepBatch", inputs: "StepInputs", pending: "np.ndarray") -> "StepInputs":
        """Host, while the previous step still runs: this step's inputs. ``pending[b] > 0``:
        sequence b is in that step and gains 1..pending[b] tokens there; its batch entry carries
        pending[b] placeholder tokens (PLACEHOLDER_TOKEN) for them. The default suits plugins whose
        inputs do not depend on those tokens."""
        return self.model_inputs_update(batch, inputs)

    def fill_in_model_result(
        self, batch: "StepBatch", inputs: "StepInputs", pending: "np.ndarray", accepted: "list[list[int]]"
    ) -> None:
        """Device side, once the previous step is done and before this one runs: patch what
        ``prepare_masks_for_filling`` left as placeholders, from that step's accepted tokens
        (``accepted[b]``, empty when ``pending[b] == 0``)."""


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def plugin_class(name: str) -> type[Plugin]:
    eps = {ep.name: ep.value for ep in entry_points(group="mindspec.plugins")}
    target = eps.get(name, f"mindspec.plugins.{name}.{name}_plugin:{_camel(name)}Plugin")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise PluginError(f"plugin_params.plugin_type: unknown plugin {name!r}") from None
        raise
    return getattr(module, attr)


def load_plugin(name: str, **kwargs: Any) -> Plugin:
    return plugin_class(name)(**kwargs)
