"""Many host arrays moved as one buffer: each view has its array's dtype, shape and values."""
import numpy as np
import pytest
import torch

from mindspec.modeling.forward_metadata import build_model_inputs, input_arrays, to_device
from mindspec.modeling.packed_transfer import ALIGN, PackedLayout, to_device_packed


def _arrays():
    rng = np.random.default_rng(0)
    return [
        rng.integers(-5, 2**40, 7, dtype=np.int64),
        rng.integers(0, 100, (3, 5)).astype(np.int32),  # 60 bytes: the next field must realign
        np.zeros(0, dtype=np.int64),
        rng.random(3).astype(np.float32),
        np.array([True, False, True]),
        rng.random(2),  # float64
    ]


def test_views_round_trip_every_dtype_and_shape():
    arrays = _arrays()
    layout = PackedLayout.of(arrays)
    packed = layout.views(layout.stage(arrays))  # what a GPU gets, on the host
    for tensors in (packed, to_device_packed(arrays, "cpu")):  # cpu: the arrays' own memory
        for a, t in zip(arrays, tensors):
            assert t.dtype == torch.from_numpy(a).dtype and tuple(t.shape) == a.shape
            assert np.array_equal(t.numpy(), a)
    assert all(off % ALIGN == 0 for _, _, off in layout.fields) and layout.nbytes % ALIGN == 0


def test_stage_refuses_arrays_of_another_layout():
    arrays = _arrays()
    layout = PackedLayout.of(arrays)
    with pytest.raises(ValueError, match="do not fit"):
        layout.stage(arrays[:-1] + [np.zeros(3)])
    with pytest.raises(ValueError, match="do not fit"):
        layout.stage(arrays[:-1] + [arrays[-1].astype(np.float32)])


def test_to_device_views_equal_the_zero_copy_cpu_tensors():
    """to_device packs for every device but cpu; the packed views hold the same inputs."""
    host = build_model_inputs([[3, 4, 5], [6]], [0, 7], [[2], [4, 5]], 4)
    plain = to_device(host, "cpu")
    arrays = input_arrays(host)
    layout = PackedLayout.of(arrays)
    packed = layout.views(layout.stage(arrays))
    mine = [plain.input_ids, plain.positions, plain.meta.slots, plain.meta.block_tables, plain.meta.seq_lens,
            plain.meta.q_lens, plain.meta.q_start_loc, plain.lm_head_indices]
    for a, b in zip(mine, packed):
        assert a.dtype == b.dtype and torch.equal(a, b)
