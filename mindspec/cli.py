"""``mindspec`` command line: ``mindspec generate``, ``serve``, ``configs``, ``bench``.

A user error (a bad argument, config, checkpoint, plugin parameter, a backend that cannot run here,
a port in use) prints one line on stderr and exits with code 2; ``--debug`` (or
``MINDSPEC_DEBUG=1``) shows its traceback instead.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sys
from dataclasses import replace
from typing import Optional, Sequence

# Nothing imported at the top loads torch: --help, ``configs`` and argument errors answer at once.
from mindspec.backend_error import BackendError
from mindspec.config.plugin_params import PluginParamsError
from mindspec.engine.errors import RequestRejected
from mindspec.modeling.errors import CheckpointError
from mindspec.modeling.model_path import check_model_path
from mindspec.plugins.plugin import PluginError
from mindspec.text_generator.tokenizer import TokenizerError

DEBUG_ENV = "MINDSPEC_DEBUG"


class CliError(Exception):
    """A user error the command line itself detects (a port in use, --chat without a tokenizer)."""


# Errors caused by the user's input: one line on stderr, exit code 2, a traceback only with --debug.
# BackendError: an unknown backend, or cuda/npu asked for where they cannot run. ValueError covers
# ConfigError, ModelConfigError, SamplingParamsError and the value checks of LLM's keywords.
USER_ERRORS = (
    CliError, BackendError, CheckpointError, PluginParamsError, PluginError, RequestRejected,
    TokenizerError, ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError,
)


def _add_debug_arg(p: argparse.ArgumentParser, default) -> None:
    p.add_argument("--debug", action="store_true", default=default,
                   help=f"show tracebacks of user errors (also ${DEBUG_ENV}=1)")


def _add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help="cpu backend: intra-op threads per process (beats $MINDSPEC_CPU_THREADS, which beats the "
                        "config's cpuThreads; default: one for a model below hidden size 1024, such as the "
                        "shipped one, else one per usable core, split among dp ranks)")


def _add_compile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", dest="decode_graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="decode steps as compiled packages on cpu (the first run compiles, for one to two minutes "
                        "per shape; later runs load them), as graphs on cuda/npu (replaces ModelConfig.decodeGraphs)")
    p.add_argument("--compile-workers", type=int, default=None, metavar="N",
                   help="with --compile on cpu: compile shapes first met in N worker processes while the step runs "
                        "eagerly; 0: compile on the serving thread (replaces ModelConfig.compileWorkers; default: "
                        "one per core, at most 4, for serve and configs; 0 for --model)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint directory (Hugging Face layout, safetensors) or a .gguf file; "
                                     "default: the shipped model")
    src.add_argument("--config", help="MindIE-style config.json (or .yaml)")
    # None: the model's own default (the shipped model's or the config's); a value given replaces it
    p.add_argument("--backend", default=None, help="cpu | cuda | npu | auto (default: cpu, or the config's)")
    p.add_argument("--dtype", default=None, help="auto | float32 | bfloat16 | float16 (default: the model's)")
    p.add_argument("--plugin-params", default=None, help='e.g. \'{"plugin_type": "mtp", "num_speculative_tokens": 2}\'')
    p.add_argument("--cache-block-size", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: from memory)")
    _add_threads_arg(p)
    _add_compile_arg(p)


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
    _add_debug_arg(p, argparse.SUPPRESS)
    p.set_defaults(func=_cmd_generate)


def _model_kwargs(args: argparse.Namespace) -> dict:
    """The model options given on the command line; the others keep the model's defaults."""
    given = dict(backend=args.backend, dtype=args.dtype, plugin_params=args.plugin_params,
                 cache_block_size=args.cache_block_size, num_blocks=args.num_blocks, cpu_threads=args.threads,
                 decode_graphs=args.decode_graphs, compile_workers=args.compile_workers)
    return {k: v for k, v in given.items() if v is not None}


def _cmd_generate(args: argparse.Namespace) -> int:
    from mindspec.llm import LLM
    from mindspec.text_generator.sampling.params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
    )
    # neither --model nor --config: the shipped default model (MTP on), with the options given
    # The prompts are all the batch there will be: no more sequences (and, with --compile, no more
    # batch-size buckets compiled) than that.
    llm = LLM(model=args.model, config=args.config, max_batch_size=len(args.prompt), **_model_kwargs(args))
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
    p.add_argument("--port", type=int, default=None, help="the business port (replaces ServerConfig.port)")
    p.add_argument("--management-port", type=int, default=None, help="health routes (replaces ServerConfig.managementPort)")
    p.add_argument("--metrics-port", type=int, default=None, help="/metrics (replaces ServerConfig.metricsPort)")
    _add_threads_arg(p)
    _add_compile_arg(p)
    _add_debug_arg(p, argparse.SUPPRESS)
    p.set_defaults(func=_cmd_serve)


PORT_OPTIONS = ("port", "management_port", "metrics_port")  # the --options and ServerConfig's fields


def _with_ports(config, args: argparse.Namespace):
    """The config with the ports given on the command line."""
    given = {}
    for name in PORT_OPTIONS:
        value = getattr(args, name)
        if value is None:
            continue
        if not 1 <= value <= 65535:
            raise CliError(f"--{name.replace('_', '-')}: must be in 1..65535, got {value}")
        given[name] = value
    return replace(config, server=replace(config.server, **given)) if given else config


def with_decode_graphs(config, on: bool):
    """The config with ModelConfig.decodeGraphs set on every model (--compile / --no-compile)."""
    return with_model_options(config, decode_graphs=on)


def with_model_options(config, **options):
    """The config with these ModelConfig fields set on every model."""
    deploy = config.backend.model_deploy
    models = [replace(m, **options) for m in deploy.models]
    return replace(config, backend=replace(config.backend, model_deploy=replace(deploy, models=models)))


def _listening(server_cfg) -> dict[int, tuple[str, str]]:
    """port -> (host, what it is) for each port serve binds (ports with one number share a server).
    The business port and the PD routes listen on ipAddress, health and metrics on
    managementIpAddress."""
    management_host = getattr(server_cfg, "management_ip_address", server_cfg.ip_address)
    out = {server_cfg.metrics_port: (management_host, "ServerConfig.metricsPort"),
           server_cfg.management_port: (management_host, "ServerConfig.managementPort")}
    if server_cfg.pd_role in ("prefill", "decode"):
        out[server_cfg.inter_comm_port] = (server_cfg.ip_address, "ServerConfig.interCommPort")
    out[server_cfg.port] = (server_cfg.ip_address, "ServerConfig.port")
    return out


def check_ports_free(server_cfg) -> None:
    """Before the model loads: a port another process listens on is one CliError naming it.
    SO_REUSEADDR as uvicorn binds, so a port in TIME_WAIT from a previous run is not refused."""
    for port, (host, what) in sorted(_listening(server_cfg).items()):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                raise CliError(f"cannot listen on {host}:{port} ({what}): {exc.strerror or exc}") from exc


def _apply_threads(config, threads: Optional[int]) -> None:
    """--threads > $MINDSPEC_CPU_THREADS > the config's cpuThreads > the default policy, set before
    the engine is built (a PD router runs no model); first the model path is checked, since
    setting the threads loads torch."""
    if config.server.pd_role == "router":
        return
    from mindspec.engine.args import EngineArgs

    engine_args = EngineArgs.from_mindie_config(config)
    check_model_path(engine_args.model)
    engine_args.apply_cpu_threads(threads)
    # the server's dp ranks (spawned, or torchrun's share_host_cores here) read the count from there
    os.environ.update(engine_args.rank_thread_env(config.model.parallel.is_distributed))


def _cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from mindspec.distributed import launch
    from mindspec.service import server

    config = _with_ports(server.resolve_config(args.config), args)
    if args.decode_graphs is not None:
        config = with_decode_graphs(config, args.decode_graphs)
    if args.compile_workers is not None:
        if args.compile_workers < 0:
            raise CliError(f"--compile-workers: must be >= 0, got {args.compile_workers}")
        config = with_model_options(config, compile_workers=args.compile_workers)
    _apply_threads(config, args.threads)
    torchrun = launch.torchrun_env()
    if torchrun is not None and torchrun[0] != 0:  # a follower rank: no HTTP, so no ports
        return server.run(args.config, args.api_key)
    check_ports_free(config.server)  # before the model loads, not after
    asyncio.run(server.serve(config, args.api_key or os.environ.get("MINDSPEC_API_KEY")))
    return 0


def _configs_parser(sub) -> None:
    p = sub.add_parser("configs", help="list the shipped MindIE configs, print one, or copy one out to edit")
    p.add_argument("name", nargs="?", help="a shipped config's name: print it (or copy it with --copy)")
    p.add_argument("--copy", metavar="DIR", help="write NAME.json into DIR (it keeps working there: its model "
                                                  "path is mindspec:default)")
    _add_debug_arg(p, argparse.SUPPRESS)
    p.set_defaults(func=_cmd_configs)


def _cmd_configs(args: argparse.Namespace) -> int:
    import shutil
    from pathlib import Path

    from mindspec.config.defaults import shipped_config_names, shipped_config_path

    if args.name is None:
        if args.copy:
            raise CliError("--copy needs the name of a shipped config")
        print("\n".join(shipped_config_names()))
        return 0
    source = shipped_config_path(args.name)
    if not args.copy:
        print(source.read_text(encoding="utf-8"), end="")
        return 0
    target = Path(args.copy) / source.name
    if target.exists():
        raise CliError(f"{target} already exists; not overwriting it")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    print(target)
    return 0


def _convert_parser(sub) -> None:
    p = sub.add_parser("convert", help="write a checkpoint in another format: block FP8 (as DeepSeek publishes "
                                       "V3/R1), GGUF (llama.cpp), or safetensors from a GGUF file")
    p.add_argument("src", help="a Hugging Face-layout DeepSeek checkpoint directory, or a .gguf file")
    p.add_argument("dst", help="the new checkpoint: a directory (created; must be empty) or, for --to gguf, "
                               "a .gguf file")
    p.add_argument("--to", choices=["fp8", "gguf", "safetensors"], default=None,
                   help="fp8: e4m3 with a scale per block; gguf: llama.cpp's deepseek2 layout (MTP modules "
                        "included); safetensors: from a GGUF file (default: safetensors for a .gguf SRC, "
                        "gguf for a .gguf DST, else fp8)")
    p.add_argument("--block", default="128,128", help="fp8: rows,columns of a weight that share a scale (default 128,128)")
    p.add_argument("--type", default="q8_0", dest="gguf_type",
                   help="gguf: the weights' type: f32, f16, bf16, q8_0 (default), q4_0, q4_1, q5_0, q5_1, q4_k, "
                        "q5_k, q6_k")
    p.add_argument("--split-max-size", default="0",
                   help="gguf: shards of at most this size (e.g. 2G, 500M), named like llama.cpp's gguf-split")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="safetensors: the dequantized weights' dtype")
    _add_debug_arg(p, argparse.SUPPRESS)
    p.set_defaults(func=_cmd_convert)


def _cmd_convert(args: argparse.Namespace) -> int:
    to = args.to or ("safetensors" if args.src.endswith(".gguf") else "gguf" if args.dst.endswith(".gguf") else "fp8")
    if to == "gguf":
        from mindspec.modeling.gguf_convert import convert_to_gguf

        for f in convert_to_gguf(args.src, args.dst, args.gguf_type.lower(), _size(args.split_max_size)):
            print(f)
        return 0
    if to == "safetensors":
        import torch

        from mindspec.modeling.gguf_convert import convert_from_gguf

        if not args.src.endswith(".gguf"):
            raise CliError(f"--to safetensors converts a .gguf file, got {args.src!r}")
        print(convert_from_gguf(args.src, args.dst, getattr(torch, args.dtype)))
        return 0
    from mindspec.modeling.fp8_convert import convert_to_block_fp8

    try:
        block = tuple(int(b) for b in args.block.split(","))
    except ValueError:
        block = ()
    if len(block) != 2 or min(block) <= 0:
        raise CliError(f"--block must be two positive integers like 128,128, got {args.block!r}")
    print(convert_to_block_fp8(args.src, args.dst, block))
    return 0


_SIZE_UNITS = {"": 1, "K": 1000, "M": 1000**2, "G": 1000**3}


def _size(text: str) -> int:
    """'2G' -> 2e9 bytes (llama.cpp's gguf-split units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", text.upper())
    if m is None:
        raise CliError(f"--split-max-size must be a size like 500M or 2G, got {text!r}")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2)]


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
    _add_debug_arg(parser, False)
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _configs_parser(sub)
    _convert_parser(sub)
    _bench_parser(sub)
    return parser


def one_line(exc: BaseException) -> str:
    """The error as one line: its message's lines joined (a traceback is for --debug)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines) or type(exc).__name__


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own parser, which also serves --backend cuda's arguments
        argv = ["bench", "--", *argv[1:]]
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        if debug:
            raise
        print(f"mindspec: error: {one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
