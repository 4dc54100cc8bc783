"""Numerical tolerances: derived from the arithmetic, checked with the seed, and recorded.

Randomized tests draw fresh inputs every run (``seed`` in conftest). A tolerance is therefore a
claim about every seed, and one set at the edge of what the arithmetic gives turns CI red by
chance (issue 34: a bf16 key rounded twice, tolerance one bf16 step). So:

* ``ulp(scale, dtype)`` is the spacing of ``dtype`` at the tensor's largest magnitude (not at 1):
  a tolerance is a count of roundings times that spacing, the count read off the computation;
* every check goes through ``check`` / ``check_close``, which fail with the seed in the message
  and, when ``MINIPIC_TOLERANCE_LOG`` names a file (``tools/sweep_tolerances.py``), append the
  error as a share of the tolerance, so a sweep over many seeds reports how close each test
  comes to its bound.
"""

from __future__ import annotations

import json
import math
import os

import torch

from minipic.span_contract.env import TOLERANCE_LOG_ENV

LOG_ENV = TOLERANCE_LOG_ENV


def ulp(scale: float, dtype: torch.dtype) -> float:
    """Spacing of ``dtype``'s values at magnitude ``scale`` (``eps`` is the spacing at 1)."""
    if scale <= 0 or not math.isfinite(scale):
        return torch.finfo(dtype).eps
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(scale))


def check(err: float, tol: float, what: str, seed: int | None) -> None:
    """``err < tol``, recorded; the failure names the seed that replays it."""
    _record(err / tol if tol > 0 else math.inf, what, seed)
    assert err < tol, f"{what}: error {err:.3e} >= tolerance {tol:.3e}{_replay(seed)}"


def check_close(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float,
                what: str, seed: int | None) -> None:
    """``torch.testing.assert_close``'s criterion, ``|a - e| <= atol + rtol * |e|`` everywhere,
    recorded as the largest share of the allowance any element uses."""
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{what}: shapes {tuple(a.shape)} vs {tuple(e.shape)}"
    assert not torch.isnan(a).any(), f"{what}: NaN in the output{_replay(seed)}"
    share = float(((a - e).abs() / (atol + rtol * e.abs())).max()) if a.numel() else 0.0
    _record(share, what, seed)
    assert share <= 1.0, (f"{what}: off by {share:.2f}x the allowance atol={atol:g} + rtol={rtol:g}"
                          f" * |expected|{_replay(seed)}")


def _replay(seed: int | None) -> str:
    """How to replay the failure (``what`` names the seed itself where ``seed`` is None)."""
    return "" if seed is None else f" (MINIPIC_TEST_SEED={seed})"


def _record(share: float, what: str, seed: int | None) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    with open(path, "a") as log:
        log.write(json.dumps({"test": test, "what": what, "seed": seed, "share": share}) + "\n")
