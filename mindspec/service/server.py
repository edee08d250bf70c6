"""`mindspec serve`: build the engine from a MindIE config and serve it on its ports."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Optional

import uvicorn

from mindspec.config.mindie_config import ConfigError, MindieConfig, load_config
from mindspec.engine.args import EngineArgs
from mindspec.engine.llm_engine import LLMEngine

from .app import apps_by_port
from .async_engine import AsyncEngine
from .metrics import ServiceMetrics
from .runner import RequestRunner, Timeouts
from .state import ServiceState

logger = logging.getLogger(__name__)
CONFIG_ENV = "MIES_CONFIG_JSON_PATH"


def resolve_config(path: Optional[str]) -> MindieConfig:
    """--config, else $MIES_CONFIG_JSON_PATH, else the built-in default (the shipped model)."""
    path = path or os.environ.get(CONFIG_ENV)
    if path:
        return load_config(path)
    from mindspec.config.defaults import default_config

    return default_config()


def build_state(config: MindieConfig, api_key: Optional[str] = None) -> ServiceState:
    engine = LLMEngine(EngineArgs.from_mindie_config(config, progress=False))
    metrics = ServiceMetrics()
    async_engine = AsyncEngine(engine, metrics)
    server = config.server
    runner = RequestRunner(async_engine, metrics, Timeouts(token=server.token_timeout, e2e=server.e2e_timeout))
    return ServiceState(engine=async_engine, runner=runner, metrics=metrics, model_name=config.model.model_name,
                        max_seq_len=config.backend.model_deploy.max_seq_len, api_key=api_key)


async def serve(config: MindieConfig, api_key: Optional[str] = None) -> None:
    server_cfg = config.server
    host = server_cfg.ip_address
    if host == "0.0.0.0" and not server_cfg.allow_all_zero_ip_listening:
        raise ConfigError("ServerConfig.ipAddress: 0.0.0.0 needs ServerConfig.allowAllZeroIpListening true")
    state = build_state(config, api_key)
    apps = apps_by_port(state, server_cfg.port, server_cfg.management_port, server_cfg.metrics_port,
                        server_cfg.max_request_length_bytes, server_cfg.max_link_num)
    servers = [uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
               for port, app in apps.items()]
    for s in servers:
        s.install_signal_handlers = lambda: None  # one handler below stops them all
    model = config.model
    plugins = ", ".join(p.name for p in state.engine.engine.plugin_manager.plugins) or "none"
    print(f"mindspec serving {model.model_name} ({model.model_weight_path}) on backend {model.backend_type}, "
          f"plugins: {plugins}", flush=True)
    print("listening on " + ", ".join(f"http://{host}:{p}" for p in apps), flush=True)
    state.engine.start()
    loop = asyncio.get_running_loop()

    def stop(*_):
        for s in servers:
            s.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    try:
        await asyncio.gather(*(s.serve() for s in servers))
    finally:
        state.engine.shutdown()
        print("mindspec stopped", flush=True)


def run(config_path: Optional[str] = None, api_key: Optional[str] = None) -> int:
    config = resolve_config(config_path)
    asyncio.run(serve(config, api_key or os.environ.get("MINDSPEC_API_KEY")))
    return 0
