"""Request bodies of the HTTP routes and their translation to SamplingParams."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from mindspec.text_generator.sampling.params import SamplingParams, SamplingParamsError

from .errors import ApiError


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAISampling(_Body):
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None

    def sampling_params(self, default_max_tokens: int, logprobs: Optional[int] = None) -> SamplingParams:
        if self.n != 1:
            raise ApiError(400, "only n=1 is supported", param="n")
        values = dict(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            ignore_eos=self.ignore_eos,
            max_tokens=next((v for v in (self.max_completion_tokens, self.max_tokens) if v is not None), default_max_tokens),
            logprobs=logprobs,
        )
        return to_sampling_params(values)


class CompletionRequest(_OpenAISampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = None
    echo: bool = False


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = None


class TgiParameters(_Body):
    max_new_tokens: int = 20
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    do_sample: bool = False
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: list[str] = Field(default_factory=list)
    details: bool = False
    return_full_text: bool = False
    ignore_eos: bool = False

    def sampling_params(self) -> SamplingParams:
        greedy = not self.do_sample and self.temperature in (None, 0)
        return to_sampling_params(dict(
            temperature=0.0 if greedy else (self.temperature or 1.0),
            top_k=self.top_k or 0,
            top_p=self.top_p if self.top_p is not None else 1.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            max_tokens=self.max_new_tokens,
            ignore_eos=self.ignore_eos,
        ))


class TgiRequest(_Body):
    inputs: str
    parameters: TgiParameters = Field(default_factory=TgiParameters)
    stream: bool = False


class VllmGenerateRequest(_OpenAISampling):
    prompt: str


def to_sampling_params(values: dict) -> SamplingParams:
    try:
        return SamplingParams(**values)
    except SamplingParamsError as exc:
        raise ApiError(400, str(exc), param=exc.field) from None
