"""`mindspec generate` as a user runs it: the installed console script, a real checkpoint dir."""
import shutil
import subprocess
import sys

import pytest

from tests.support.checkpoints import make_checkpoint, tiny_v3_config
from tests.support.tokenizers import make_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("cli"), tiny_v3_config(), seed=2)
    make_tokenizer(path, vocab_size=256)
    return path


def _run(*args):
    exe = shutil.which("mindspec")
    cmd = [exe] if exe else [sys.executable, "-m", "mindspec.cli"]
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=300)


def test_generate_prints_text(model_dir):
    from mindspec import LLM, SamplingParams

    res = _run("generate", "--model", str(model_dir), "--prompt", "def add(a, b):", "--max-tokens", "12",
               "--ignore-eos", "--dtype", "float32", "--num-blocks", "64")
    assert res.returncode == 0, res.stderr
    llm = LLM(model=str(model_dir), dtype="float32", num_blocks=64, progress=False)
    expected = llm.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].text
    assert res.stdout == expected + "\n"


def test_bad_model_dir_is_one_line_error(tmp_path):
    res = _run("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert res.returncode == 2
    assert res.stderr.strip().startswith("mindspec: error:") and "does not exist" in res.stderr
    assert "Traceback" not in res.stderr


def test_bad_sampling_value_is_named(model_dir):
    res = _run("generate", "--model", str(model_dir), "--prompt", "hi", "--temperature", "-1")
    assert res.returncode == 2 and "temperature" in res.stderr and "Traceback" not in res.stderr
