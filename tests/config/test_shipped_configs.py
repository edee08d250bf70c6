"""The ready-made configs: "mindspec:default" names the shipped model from any folder, configs are
found by name, and the wheel carries them as mindspec/configs/*.json."""
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import mindspec
from mindspec.config.defaults import find_config, shipped_config_path
from mindspec.config.mindie_config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
SHIPPED_MODEL = Path(mindspec.__file__).resolve().parent / "assets" / "default_model"


def test_copied_config_finds_the_shipped_model(tmp_path):
    shutil.copy(CONFIGS / "config.json", tmp_path / "config.json")
    cfg = load_config(tmp_path / "config.json")
    assert cfg.model.model_weight_path == str(SHIPPED_MODEL)


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.json")))
def test_every_shipped_config_uses_the_shipped_model(name):
    raw = json.loads((CONFIGS / name).read_text())
    assert raw["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] == "mindspec:default"


def test_absent_model_path_is_the_shipped_model():
    cfg = parse_config({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [{"modelName": "m"}]}}})
    assert cfg.model.model_weight_path == str(SHIPPED_MODEL)


def test_shipped_config_by_name():
    from mindspec.config import shipped_config_names, shipped_config_path as exported

    assert exported is shipped_config_path and "config_cpu_no_mtp" in shipped_config_names()
    assert shipped_config_path("config_cpu_no_mtp") == CONFIGS / "config_cpu_no_mtp.json"
    assert shipped_config_path("config_cuda.json") == CONFIGS / "config_cuda.json"
    assert load_config(shipped_config_path("config_cpu_no_mtp")).model.plugin_params is None
    for bad in ("nope", "../configs/config", ""):
        with pytest.raises(ConfigError, match=r"no shipped config named .*shipped configs: config, config_cpu_no_mtp, "):
            shipped_config_path(bad)


def test_find_config_prefers_an_existing_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_config("config_npu") == CONFIGS / "config_npu.json"
    (tmp_path / "config_npu.json").write_text("{}")
    assert find_config("config_npu.json") == Path("config_npu.json")
    with pytest.raises(ConfigError, match=r"config file 'missing.json' does not exist, and no shipped config has that name"):
        find_config("missing.json")
    with pytest.raises(ConfigError, match="does not exist"):
        find_config(str(tmp_path / "sub" / "config"))


def _build_wheel(tmp_path: Path) -> Path:
    """Builds from a copy of the sources so the checkout gets no build/ folder."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("mindspec", "backends", "plugins", "models", "configs"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out)], check=True, capture_output=True, timeout=600)
    (wheel,) = out.glob("mindspec-*.whl")
    return wheel


def test_wheel_carries_the_configs(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"mindspec/configs/{p.name}" for p in CONFIGS.glob("*.json")}
    assert expected and expected <= names
    assert "mindspec/assets/default_model/config.json" in names
    # installed layout: the extracted wheel first on the path, run from an unrelated folder
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import mindspec.config.defaults as d, mindspec.config.mindie_config as m;"
            "p = d.shipped_config_path('config_cpu_no_mtp'); print(p); print(m.load_config(p).model.model_weight_path)")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    config_path, model_path = run.stdout.split()
    assert config_path == str(site / "mindspec" / "configs" / "config_cpu_no_mtp.json")
    assert model_path == str(site / "mindspec" / "assets" / "default_model")
