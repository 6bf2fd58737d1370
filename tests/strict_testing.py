"""Shared helpers for kernel tests: seeded random inputs and the derived-tolerance check.

The tolerance rule (flash-attention's): a strict kernel's error against a float64 truth must be at most `factor`
(default 2) times the error of the same computation done by torch in the same dtype, plus a floor of a few float32
ulps of the truth's norm (so float32 kernels are not held to torch getting lucky). Errors are L2 norms over the
whole tensor, which are stable where a max-abs error is dominated by one rounding.
"""

from __future__ import annotations

import torch

FP32_EPS = torch.finfo(torch.float32).eps


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """Fresh standard-normal values (never zeros) from a private generator, rounded once to `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def adaln_row_index(rows: int, timesteps: int, seed: int = 0) -> torch.Tensor:
    """timestep_index * 3 + token_tag per packed row (the AdaLN table row each row reads): video rows, then audio,
    then text, each at a random one of `timesteps` steps."""
    gen = torch.Generator().manual_seed(seed)
    tag = torch.sort(torch.randint(0, 3, (rows,), generator=gen)).values
    return torch.randint(0, timesteps, (rows,), generator=gen) * 3 + tag


def norm_weight(d: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """A learned norm weight near 1 (fresh values, never all ones)."""
    return (1.0 + 0.1 * randn(d, seed=seed)).to(dtype)


def adaln_projection(timesteps: int, d: int, dtype: torch.dtype, seed: int = 2) -> torch.Tensor:
    """(3 * timesteps, 6 d) AdaLN projection output [shift_msa | scale_msa | gate_msa | shift_mlp | scale_mlp |
    gate_mlp], one row per (timestep, modality); the model passes its `chunk(6, dim=-1)` pieces."""
    return randn(3 * timesteps, 6 * d, dtype=dtype, seed=seed, scale=0.5)


def l2_error(out: torch.Tensor, truth: torch.Tensor) -> float:
    """||out - truth||_2 in float64; NaN or inf in `out` gives inf."""
    diff = out.detach().to(torch.float64) - truth.detach().to(torch.float64)
    err = float(diff.norm())
    return err if err == err else float("inf")


def assert_error_within(out: torch.Tensor, torch_out: torch.Tensor, truth: torch.Tensor, what: str,
                        factor: float = 2.0, floor_ulps: float = 4.0) -> None:
    """Assert l2_error(out) <= factor * l2_error(torch_out) + floor_ulps * FP32_EPS * ||truth||."""
    assert out.shape == truth.shape, f"{what}: shape {tuple(out.shape)} != truth {tuple(truth.shape)}"
    kernel_err = l2_error(out, truth)
    torch_err = l2_error(torch_out, truth)
    floor = floor_ulps * FP32_EPS * float(truth.detach().to(torch.float64).norm())
    bound = factor * torch_err + floor
    assert kernel_err <= bound, (
        f"{what}: kernel error {kernel_err:.3e} > {factor} x torch error {torch_err:.3e} + floor {floor:.3e}"
    )
