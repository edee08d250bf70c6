"""JSON forms of what PD nodes and the router exchange: SamplingParams and RequestOutput."""
from __future__ import annotations

import json
from dataclasses import asdict, fields
from typing import Any

from mindspec.engine.outputs import RequestMetrics, RequestOutput, SpecDecodeStats
from mindspec.text_generator.sampling.params import SamplingParams


def params_to_json(params: SamplingParams) -> dict[str, Any]:
    return asdict(params)


def params_from_json(data: Any) -> SamplingParams:
    """Raises SamplingParamsError (a ValueError naming the field) or TypeError for unknown fields."""
    if not isinstance(data, dict):
        raise TypeError("sampling params must be a JSON object")
    known = {f.name for f in fields(SamplingParams)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise TypeError(f"unknown sampling parameter {unknown[0]!r}")
    return SamplingParams(**data)


def output_to_line(out: RequestOutput) -> bytes:
    """One NDJSON line."""
    return (json.dumps(asdict(out), ensure_ascii=False) + "\n").encode()


def output_from_line(line: str | bytes) -> RequestOutput:
    data = json.loads(line)
    if data.get("spec_decode") is not None:
        data["spec_decode"] = SpecDecodeStats(**data["spec_decode"])
    if data.get("metrics") is not None:
        data["metrics"] = RequestMetrics(**data["metrics"])
    if data.get("top_logprobs") is not None:  # JSON object keys are strings
        data["top_logprobs"] = [{int(k): v for k, v in d.items()} for d in data["top_logprobs"]]
    return RequestOutput(**data)
