"""mindspec: a speculative-decoding-first inference stack for DeepSeek-V2/V3."""
import os
import sys

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]

# OpenMP's threads sleep while they wait instead of spinning: beside a process busy on one of the
# cores, spinning threads made decoding many times slower (benchmarks/README.md, "CPU threads"; the
# policy is described in mindspec.backends.cpu.backend). OpenMP reads this once, when torch loads
# it, so it applies only if mindspec is imported before torch; a value already in the environment
# (ACTIVE, PASSIVE) is kept, as is libgomp's GOMP_SPINCOUNT (how long a waiting thread spins
# before it sleeps; it overrides the policy's spin: on an idle machine OpenMP's default, 300000,
# makes two threads pay on the shipped model at batch 16, benchmarks/README.md).
# "user": the environment had a value; "passive": set here; "too late": set here after torch (and
# OpenMP) had loaded, so it reaches only child processes.
if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
    WAIT_POLICY_SOURCE = "user"
else:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    WAIT_POLICY_SOURCE = "too late" if "torch" in sys.modules else "passive"


def __getattr__(name):
    # Lazy, so that importing a submodule (a backend, the config schema) stays cheap.
    if name == "LLM":
        from mindspec.llm import LLM

        return LLM
    if name == "SamplingParams":
        from mindspec.text_generator.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'mindspec' has no attribute {name!r}")
