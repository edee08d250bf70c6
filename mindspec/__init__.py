"""mindspec: a speculative-decoding-first inference stack for DeepSeek-V2/V3."""
__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # Lazy, so that importing a submodule (a backend, the config schema) stays cheap.
    if name == "LLM":
        from mindspec.llm import LLM

        return LLM
    if name == "SamplingParams":
        from mindspec.text_generator.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'mindspec' has no attribute {name!r}")
