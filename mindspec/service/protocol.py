"""Request bodies of the HTTP routes and their translation to SamplingParams."""
from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from mindspec.text_generator.sampling.params import SamplingParams, SamplingParamsError

from .errors import ApiError
from .structured_request import StructuredFormat, add_guided, add_response_format, add_tgi_grammar
from .tool_calls import Tool, ToolChoice, ToolPlan, tool_plan


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


MAX_N = 128  # MindIE's maxN default: choices per prompt
MAX_CHOICES = 1024  # engine requests one HTTP request may start (prompts x n)


def reject_unsupported(body: BaseModel, defaults: dict[str, Any]) -> None:
    """A field this server does not implement, sent with a value other than its no-op default,
    is a 400 naming it (never silently ignored). ``defaults``: field -> the accepted values."""
    for name, accepted in defaults.items():
        value = getattr(body, name)
        if value not in accepted:
            raise ApiError(400, f"{name}={value!r} is not supported by this server", param=name)


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
    logit_bias: Optional[dict[str, Any]] = None  # OpenAI sends token ids as string keys
    ignore_eos: bool = False
    min_tokens: Optional[int] = None  # vLLM's extras
    skip_special_tokens: Optional[bool] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    use_beam_search: bool = False  # a vLLM extra this server does not implement
    # structured output: OpenAI's response_format (vLLM takes it on completions too), vLLM's extras
    response_format: Optional[dict[str, Any]] = None
    guided_json: Optional[Any] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    structured_outputs: Optional[dict[str, Any]] = None

    _UNSUPPORTED: ClassVar[dict[str, tuple]] = {"use_beam_search": (False,)}

    def check_n(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise ApiError(400, f"n must be in [1, {MAX_N}], got {self.n}", param="n")

    def structured_format(self) -> StructuredFormat:
        """The request's structured output format (a 400 naming the second field that asks for one)."""
        fmt = StructuredFormat()
        add_response_format(fmt, self.response_format)
        add_guided(fmt, self)
        return fmt

    def sampling_params(self, default_max_tokens: int, logprobs: Optional[int] = None,
                        prompt_logprobs: Optional[int] = None,
                        fmt: Optional[StructuredFormat] = None) -> SamplingParams:
        """``fmt``: the request's structured format (structured_format() where None)."""
        self.check_n()
        reject_unsupported(self, self._UNSUPPORTED)
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
        # Only named when used, so the routes work with an engine that lacks them.
        if self.logit_bias:
            values["logit_bias"] = self.logit_bias
        for name in ("min_tokens", "skip_special_tokens"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        if prompt_logprobs is not None:
            values["prompt_logprobs"] = prompt_logprobs
        fmt = self.structured_format() if fmt is None else fmt
        values.update(fmt.values())
        with fmt.naming_errors():
            return to_sampling_params(values)


CompletionPrompt = Union[str, list[int], list[str], list[list[int]]]


class CompletionRequest(_OpenAISampling):
    prompt: CompletionPrompt
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts of the request: one string, one token-id list, or a list of either."""
        p = self.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts or any(not x for x in prompts):
            raise ApiError(400, "prompt must not be empty", param="prompt")
        if len(prompts) * self.n > MAX_CHOICES:
            raise ApiError(400, f"{len(prompts)} prompts x n={self.n} exceeds {MAX_CHOICES} choices per request", param="n")
        return prompts

    def check_supported(self) -> None:
        if self.suffix is not None:
            raise ApiError(400, "suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, f"best_of must equal n ({self.n}) or be absent: this server returns every "
                                f"sequence it generates", param="best_of")


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]], None] = None
    # a tool-calling conversation: the assistant's calls, and which call a tool message answers
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None
    name: Optional[str] = None

    def template_dict(self) -> dict:
        """The message as chat templates read it: text content ("" for none: DeepSeek's templates
        render a tool-call turn's "" as its null, and simpler templates concatenate it), and the
        tool fields where sent."""
        extra = {k: v for k in ("tool_calls", "tool_call_id", "name") if (v := getattr(self, k)) is not None}
        return {"role": self.role, "content": _text(self.content), **extra}


TEXT_PARTS = ("text", "refusal")  # chat content part types that carry text (under the key of that name)


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get(part.get("type"), "") for part in content if part.get("type") in TEXT_PARTS)


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Tool]] = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[Any]] = None
    audio: Optional[Any] = None
    prediction: Optional[Any] = None
    modalities: Optional[list[str]] = None

    def check_supported(self) -> None:
        for name in ("functions", "audio", "prediction"):  # functions: OpenAI's old spelling of tools
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported by this server", param=name)
        if self.modalities and self.modalities != ["text"]:
            raise ApiError(400, "modalities other than ['text'] are not supported", param="modalities")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        for i, message in enumerate(self.messages):  # an image or audio part is not dropped unread
            for j, part in enumerate(message.content if isinstance(message.content, list) else []):
                if part.get("type") not in TEXT_PARTS:
                    param = f"messages[{i}].content[{j}].type"
                    raise ApiError(400, f"{param} {part.get('type')!r} is not supported: this model reads text only",
                                   param=param)

    def logprobs_k(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_plan(self) -> ToolPlan:
        return tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls)

    def chat_format(self, plan: ToolPlan) -> StructuredFormat:
        """The structured format: response_format or guided_*, or a named / required tool call's."""
        fmt = self.structured_format()
        plan.constrain(fmt)
        return fmt


class TgiParameters(_Body):
    max_new_tokens: int = 20
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    do_sample: bool = False
    repetition_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: list[str] = Field(default_factory=list)
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: Optional[int] = None
    return_full_text: bool = False
    ignore_eos: bool = False
    truncate: Optional[int] = None
    best_of: Optional[int] = None
    typical_p: Optional[float] = None
    watermark: bool = False
    grammar: Optional[Any] = None
    adapter_id: Optional[str] = None
    priority: Optional[int] = None  # MindIE: 1 (highest) .. 5; this engine schedules first come, first served
    timeout: Optional[float] = None  # MindIE: the request's own end-to-end limit in seconds

    _UNSUPPORTED: ClassVar[dict[str, tuple]] = {"best_of": (None, 1), "watermark": (False,),
                                                "adapter_id": (None,)}

    def check_supported(self) -> None:
        reject_unsupported(self, self._UNSUPPORTED)
        if self.truncate is not None and self.truncate < 1:
            raise ApiError(400, f"truncate must be an int >= 1, got {self.truncate}", param="truncate")
        if self.priority is not None and not 1 <= self.priority <= 5:
            raise ApiError(400, f"priority must be in [1, 5], got {self.priority}", param="priority")
        if self.timeout is not None and not self.timeout > 0:
            raise ApiError(400, f"timeout must be > 0 seconds, got {self.timeout}", param="timeout")

    @property
    def wants_details(self) -> bool:
        # TGI 0.9.4 (and MindIE): either flag returns the details.
        return self.details or self.decoder_input_details

    def structured_format(self) -> StructuredFormat:
        fmt = StructuredFormat()
        add_tgi_grammar(fmt, self.grammar)
        return fmt

    def sampling_params(self, seed: Optional[int], logprobs: Optional[int],
                        fmt: Optional[StructuredFormat] = None) -> SamplingParams:
        self.check_supported()
        greedy = not self.do_sample and self.temperature in (None, 0)
        values = dict(
            temperature=0.0 if greedy else (self.temperature or 1.0),
            top_k=self.top_k or 0,
            top_p=self.top_p if self.top_p is not None else 1.0,
            typical_p=self.typical_p if self.typical_p is not None else 1.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            seed=seed,
            stop=self.stop,
            max_tokens=self.max_new_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )
        if self.decoder_input_details:
            values["prompt_logprobs"] = 0
        fmt = self.structured_format() if fmt is None else fmt
        values.update(fmt.values())
        try:
            with fmt.naming_errors():
                return to_sampling_params(values)
        except ApiError as exc:  # name TGI's fields, not the engine's
            renamed = {"max_tokens": "max_new_tokens", "logprobs": "top_n_tokens"}.get(exc.param, exc.param)
            raise ApiError(exc.status, exc.message.replace(f" {exc.param}=", f" {renamed}="), param=renamed) from None


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
