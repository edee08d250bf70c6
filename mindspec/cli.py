"""``mindspec`` command line: ``mindspec generate``, ``mindspec serve``, ``mindspec bench``."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from mindspec.config.plugin_params import PluginParamsError
from mindspec.engine.errors import RequestRejected
from mindspec.modeling.errors import CheckpointError
from mindspec.plugins.plugin import PluginError
from mindspec.text_generator.sampling.params import SamplingParamsError
from mindspec.text_generator.tokenizer import TokenizerError

# Errors caused by the user's input: one line on stderr, exit code 2, never a traceback.
USER_ERRORS = (
    CheckpointError, PluginParamsError, PluginError, RequestRejected, SamplingParamsError, TokenizerError,
    ValueError, FileNotFoundError,
)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint directory (Hugging Face layout, safetensors); default: the shipped model")
    src.add_argument("--config", help="MindIE-style config.json (or .yaml)")
    p.add_argument("--backend", default="cpu", help="cpu | cuda | npu | auto (with --model)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (with --model)")
    p.add_argument("--plugin-params", default=None, help='e.g. \'{"plugin_type": "mtp", "num_speculative_tokens": 2}\'')
    p.add_argument("--cache-block-size", type=int, default=128)
    p.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: from memory)")


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts")
    _add_model_args(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message with the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stats", action="store_true", help="print speculative-decoding statistics to stderr")
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    from mindspec.llm import LLM
    from mindspec.text_generator.sampling.params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
    )
    if args.config:
        llm = LLM(config=args.config)
    elif args.model is None:
        llm = LLM()  # the shipped default model with MTP on
    else:
        llm = LLM(
            model=args.model, backend=args.backend, dtype=args.dtype, plugin_params=args.plugin_params,
            cache_block_size=args.cache_block_size, num_blocks=args.num_blocks,
        )
    prompts = args.prompt
    if args.chat:
        if llm.tokenizer is None:
            raise TokenizerError("--chat needs a tokenizer in the model directory")
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    for i, out in enumerate(llm.generate(prompts, params)):
        if len(prompts) > 1:
            print(f"--- prompt {i} ---")
        print(out.text if llm.tokenizer is not None else out.token_ids)
        if args.stats and out.spec_decode is not None:
            s = out.spec_decode
            print(
                f"[spec] steps={s.num_steps} drafted={s.num_draft_tokens} accepted={s.num_accepted_tokens} "
                f"per_position={s.accepted_per_position} mean_accepted_length={s.mean_accepted_length:.2f}",
                file=sys.stderr,
            )
    return 0


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve OpenAI, MindIE and TGI routes from a MindIE-style config.json")
    p.add_argument("--config", default=None, help="config.json / .yaml (default: $MIES_CONFIG_JSON_PATH, else the shipped model)")
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (also $MINDSPEC_API_KEY)")
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from mindspec.service.server import run

    return run(args.config, args.api_key)


def _bench_parser(sub) -> None:
    # `mindspec bench` parses its own arguments (mindspec.bench.main); listed here for --help.
    p = sub.add_parser("bench", help="decoding speed side by side (JSON + PNG); --backend cuda for the GPU kernels",
                       add_help=False)
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    from mindspec.bench.main import main as bench_main

    rest = args.bench_args
    return bench_main(rest[1:] if rest[:1] == ["--"] else rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mindspec", description="DeepSeek inference with speculative decoding")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _bench_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own parser, which also serves --backend cuda's arguments
        argv = ["bench", "--", *argv[1:]]
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"mindspec: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
