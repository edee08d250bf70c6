"""Fixtures of the npu backend tests: the torch_npu reference installed only inside a test.

``npu_ref`` puts tests/support/torch_npu_reference.py into sys.modules as ``torch_npu`` (and its host
stand-in as ``torch.npu``) and removes both afterwards; nothing here runs on an NPU.
"""
import pytest

from tests.support import torch_npu_reference


@pytest.fixture
def npu_ref():
    with torch_npu_reference.installed() as module:
        yield module


@pytest.fixture
def npu_backend(npu_ref):
    from mindspec.backend import get_backend

    return get_backend("npu", "cpu")
