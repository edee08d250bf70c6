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


def test_host_views_share_the_buffer_the_device_views_read():
    """Values assigned into the host views (what a static cpu buffer is loaded through) are what
    the typed views of the same buffer hold, every dtype and shape, zero-size fields included."""
    arrays = _arrays()
    layout = PackedLayout.of(arrays)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    host = layout.host_views(buffer)
    for view, a in zip(host, arrays):
        assert view.dtype == a.dtype and view.shape == a.shape
        view[...] = a
    for t, a in zip(layout.views(buffer), arrays):
        assert np.array_equal(t.numpy(), a)


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


def test_cpu_tensors_of_read_only_arrays_are_copies(recwarn):
    """Arrays the host's builders keep and share are read-only: a cpu tensor gets its own copy
    (torch warns about, and may write into, a non-writable array's memory)."""
    shared, own = np.arange(4, dtype=np.int64), np.arange(3, dtype=np.int32)
    shared.setflags(write=False)
    got_shared, got_own = to_device_packed([shared, own], "cpu")
    assert got_shared.tolist() == [0, 1, 2, 3] and got_shared.data_ptr() != shared.ctypes.data
    assert got_own.data_ptr() == own.ctypes.data  # zero-copy otherwise
    assert not [w for w in recwarn if "not writable" in str(w.message)]


def test_staging_reuses_one_host_buffer_and_grows_for_a_larger_layout():
    from mindspec.modeling.packed_transfer import Staging

    staging = Staging("cpu")
    arrays = _arrays()
    layout = PackedLayout.of(arrays)
    first = staging.fill(layout, arrays)
    assert [np.array_equal(t.numpy(), a) for t, a in zip(layout.views(first), arrays)] == [True] * len(arrays)
    again = staging.fill(layout, [a[::-1].copy() if a.ndim == 1 else a for a in arrays])
    assert again.data_ptr() == first.data_ptr()  # the same memory, rewritten
    bigger = [np.arange(layout.nbytes, dtype=np.int64)]
    grown = staging.fill(PackedLayout.of(bigger), bigger)
    assert grown.numel() == 8 * layout.nbytes and np.array_equal(grown.numpy().view(np.int64), bigger[0])
    with pytest.raises(ValueError, match="do not fit"):
        staging.fill(layout, bigger)
    # back to the first layout (and an equal one): its views are made again over the grown buffer
    for again_layout in (layout, PackedLayout.of(arrays)):
        values = [_changed(a, 1) for a in arrays]
        host = staging.fill(again_layout, values)
        assert all(np.array_equal(t.numpy(), a) for t, a in zip(again_layout.views(host), values))


def _changed(a: np.ndarray, k: int) -> np.ndarray:
    return ~a if a.dtype == np.bool_ else (a * k + 1).astype(a.dtype)


def test_staging_assigns_into_views_it_keeps_for_its_last_layout(monkeypatch):
    """A graph runner sends one layout every step: the buffer's typed views are made once."""
    from mindspec.modeling.packed_transfer import Staging

    staging, arrays = Staging("cpu"), _arrays()
    layout = PackedLayout.of(arrays)
    staging.fill(layout, arrays)
    made = []
    monkeypatch.setattr(PackedLayout, "host_views", lambda self, buffer: made.append(1) or [])
    for step in range(3):
        values = [_changed(a, step + 2) for a in arrays]
        host = staging.fill(layout, values)
        assert all(np.array_equal(t.numpy(), a) for t, a in zip(layout.views(host), values))
    assert made == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked staging and its event need CUDA")
def test_staging_waits_for_the_device_to_read_a_copy_before_rewriting_it():
    """Copies from page-locked memory are asynchronous: a second fill right after the first copy
    must not change what the first copy delivers."""
    from mindspec.modeling.packed_transfer import Staging

    staging = Staging("cuda")
    big = np.arange(1 << 22, dtype=np.int64)  # 32 MB: the copy is still running when fill returns
    torch.cuda._sleep(10_000_000)  # keep the stream busy so the first copy is queued, not done
    (first,) = to_device_packed([big], "cuda", staging)
    (second,) = to_device_packed([-big], "cuda", staging)
    torch.cuda.synchronize()
    assert torch.equal(first.cpu(), torch.from_numpy(big)) and torch.equal(second.cpu(), torch.from_numpy(-big))
