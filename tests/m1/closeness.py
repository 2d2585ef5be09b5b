"""One tensor against the reference's: on failure, which tensor, where, both values, by how much, and the tolerance.

m1's module tests compare each piece of the model with transformers' own module on the
same weights. A bare ``assert torch.allclose(...)`` would say only "False"; a learner needs
the name of the tensor, the first element out of tolerance and how far off it is, to tell a
summation-order difference (just over the line) from a wrong formula (far over it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Tolerance:
    """An element passes when ``|ours - reference| <= atol + rtol * |reference|`` (torch.testing's rule)."""

    atol: float
    rtol: float = 0.0

    def __str__(self) -> str:
        return f"atol {self.atol:g}" + (f" + rtol {self.rtol:g} x |reference|" if self.rtol else "")


EXACT = Tolerance(0.0)  # the same operations in the same order: bit for bit
# float32 modules on the same weights: transformers and m1 may sum in another order (a fused kernel, another
# matmul split), which moves the last few bits. Measured: at most 1.4e-5 on outputs of order 10 to 40.
FLOAT32 = Tolerance(1e-5, rtol=1e-5)


def expect_close(name: str, ours: torch.Tensor, reference: torch.Tensor, tolerance: Tolerance,
                 source: str = "transformers") -> None:
    """Raise AssertionError naming ``name``, the first element out of ``tolerance``, both values and the margin."""
    if not isinstance(ours, torch.Tensor):
        raise AssertionError(f"{name}: expected a tensor, got {type(ours).__name__}")
    if ours.shape != reference.shape:
        raise AssertionError(f"{name} has shape {list(ours.shape)}, not {list(reference.shape)} as in {source}")
    if ours.dtype != reference.dtype:
        raise AssertionError(f"{name} is {ours.dtype}, not {reference.dtype} as in {source}")
    a, b = ours.detach().cpu().double(), reference.detach().cpu().double()
    difference = (a - b).abs().nan_to_num(nan=float("inf"))  # a NaN is never close to anything
    allowed = tolerance.atol + tolerance.rtol * b.abs()
    out = difference > allowed
    if not out.any():
        return
    first = tuple(int(i) for i in out.nonzero()[0])
    excess = torch.where(out, difference / allowed, 0.0)  # inf where nothing was allowed
    worst = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
    raise AssertionError(
        f"{name} differs from {source} at index {list(first)}: {a[first].item():.7g} here, "
        f"{b[first].item():.7g} in {source} (off by {difference[first].item():.3g}). "
        f"{int(out.sum())} of {out.numel()} elements are out of tolerance ({tolerance}); the worst, at "
        f"{list(worst)}, is off by {difference[worst].item():.3g}, {excess[worst].item():.3g} times what is allowed"
    )
