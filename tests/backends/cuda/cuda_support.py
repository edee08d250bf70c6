"""Test support for the cuda-backend tests: where they run, which dtypes, explicit tolerances.

float32: kernels and the cpu reference differ only in summation order. float16 / bfloat16: both
sides round intermediates to the activation dtype, at different points (the reference rounds
whole-einsum scores and GEMM outputs, the kernels accumulate tiles in float32), so the bounds are
a few units in the last place for outputs of magnitude ~1-10.
"""
import torch

ON_GPU = torch.cuda.is_available()
DEVICES = ["cuda"] if ON_GPU else ["cpu"]
# bfloat16 is wrong under Triton's interpreter (DESIGN.md section 3): only natively.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])

TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=6e-2, rtol=4e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """actual (any device) vs expected (cpu), with ``scale`` widening the dtype's bounds."""
    tol = TOL[dtype]
    torch.testing.assert_close(
        actual.cpu().float(), expected.cpu().float(), atol=tol["atol"] * scale, rtol=tol["rtol"] * scale
    )
