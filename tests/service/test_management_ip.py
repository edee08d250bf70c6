"""managementIpAddress: the management (and a separate metrics) port listen there, the business
port on ipAddress; $MIES_CONTAINER_IP / $MIES_CONTAINER_MANAGEMENT_IP override them as in MindIE.
Linux routes all of 127.0.0.0/8 to the loopback device, so 127.0.0.2 is a second local address."""
import re

import httpx
import pytest

from mindspec.config.mindie_config import ConfigError, parse_config
from mindspec.service.server import listen_host
from tests.service.conftest import free_port, start_serve, stop_serve, write_config

ENVS = ("MIES_CONTAINER_IP", "MIES_CONTAINER_MANAGEMENT_IP")


@pytest.fixture(autouse=True)
def _no_container_env(monkeypatch):
    for name in ENVS:
        monkeypatch.delenv(name, raising=False)


def _server_config(**server):
    return parse_config({"ServerConfig": {"port": 2000, "managementPort": 2001, "metricsPort": 2002, **server},
                         "BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"modelWeightPath": "/m"}]}}}).server


def test_addresses_from_config_and_environment(monkeypatch):
    assert (_server_config().ip_address, _server_config().management_ip_address) == ("127.0.0.1", "127.0.0.1")
    cfg = _server_config(ipAddress="127.0.0.5", managementIpAddress="127.0.0.2")
    assert (cfg.ip_address, cfg.management_ip_address) == ("127.0.0.5", "127.0.0.2")
    # no managementIpAddress: the business address, also when that comes from the environment
    monkeypatch.setenv("MIES_CONTAINER_IP", "10.1.2.3")
    assert (_server_config().ip_address, _server_config().management_ip_address) == ("10.1.2.3", "10.1.2.3")
    monkeypatch.setenv("MIES_CONTAINER_MANAGEMENT_IP", "10.1.2.4")
    cfg = _server_config(ipAddress="127.0.0.5", managementIpAddress="127.0.0.2")
    assert (cfg.ip_address, cfg.management_ip_address) == ("10.1.2.3", "10.1.2.4")


def test_ports_listen_on_their_plane():
    cfg = _server_config(managementIpAddress="127.0.0.2")
    assert [listen_host(cfg, p) for p in (2000, 2001, 2002)] == ["127.0.0.1", "127.0.0.2", "127.0.0.2"]
    # a metrics port merged with the business port stays on ipAddress
    merged = _server_config(managementIpAddress="127.0.0.2", metricsPort=2000)
    assert [listen_host(merged, p) for p in (2000, 2001)] == ["127.0.0.1", "127.0.0.2"]


@pytest.mark.parametrize("server, env, message", [
    ({"managementIpAddress": "localhost"}, {}, "ServerConfig.managementIpAddress: must be an IPv4 or IPv6 address, got 'localhost'"),
    ({"managementIpAddress": "0.0.0.0"}, {}, "ServerConfig.managementIpAddress: 0.0.0.0 needs ServerConfig.allowAllZeroIpListening true"),
    ({"ipAddress": "::"}, {}, "ServerConfig.ipAddress: :: needs ServerConfig.allowAllZeroIpListening true"),
    ({}, {"MIES_CONTAINER_MANAGEMENT_IP": "not-an-ip"}, "$MIES_CONTAINER_MANAGEMENT_IP: must be an IPv4 or IPv6 address"),
])
def test_bad_addresses_name_their_source(server, env, message, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=re.escape(message)):
        _server_config(**server)


def test_all_zero_allowed_when_opted_in():
    cfg = _server_config(ipAddress="0.0.0.0", managementIpAddress="0.0.0.0", allowAllZeroIpListening=True)
    assert cfg.management_ip_address == "0.0.0.0"


def _refused(url: str) -> bool:
    try:
        httpx.get(url, timeout=2)
    except httpx.ConnectError:
        return True
    return False


def test_management_port_answers_on_management_address_only(tiny_model, tmp_path):
    ports = (free_port(), free_port(), free_port())
    cfg = write_config(tmp_path / "c.json", tiny_model, ports, **{"ServerConfig.managementIpAddress": "127.0.0.2"})
    proc = start_serve(cfg, lambda: httpx.get(f"http://127.0.0.2:{ports[1]}/health", timeout=1))
    try:
        assert _refused(f"http://127.0.0.1:{ports[1]}/health")
        assert httpx.get(f"http://127.0.0.2:{ports[2]}/metrics", timeout=5).status_code == 200
        assert _refused(f"http://127.0.0.1:{ports[2]}/metrics")
        # the business port stays on ipAddress
        r = httpx.get(f"http://127.0.0.1:{ports[0]}/v1/models", timeout=5)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
        assert _refused(f"http://127.0.0.2:{ports[0]}/v1/models")
    finally:
        out = stop_serve(proc)
    assert f"http://127.0.0.1:{ports[0]}, http://127.0.0.2:{ports[1]}, http://127.0.0.2:{ports[2]}" in out, out


def test_environment_overrides_the_config(tiny_model, tmp_path):
    ports = (free_port(), free_port(), free_port())
    cfg = write_config(tmp_path / "c.json", tiny_model, ports, **{"ServerConfig.managementIpAddress": "127.0.0.2"})
    env = {"MIES_CONTAINER_IP": "127.0.0.3", "MIES_CONTAINER_MANAGEMENT_IP": "127.0.0.4"}
    proc = start_serve(cfg, lambda: httpx.get(f"http://127.0.0.4:{ports[1]}/health", timeout=1), env=env)
    try:
        assert _refused(f"http://127.0.0.2:{ports[1]}/health")
        assert httpx.get(f"http://127.0.0.3:{ports[0]}/v1/models", timeout=5).status_code == 200
        assert _refused(f"http://127.0.0.1:{ports[0]}/v1/models")
    finally:
        stop_serve(proc)
