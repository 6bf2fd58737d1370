"""`StrictAdamW`: AdamW whose update is a declared sequence of elementwise float32 ops, applied to the flat
combined gradient of `step.py`.

Math (torch.optim.AdamW: decoupled weight decay, bias correction, no amsgrad), step k = 1, 2, ..., per element:
    w        <- w * (1 - lr * weight_decay)                 `w.mul_(1 - lr*wd)`            (skipped when wd == 0)
    m        <- lerp(m, g, 1 - beta1)                       `m.lerp_(g, 1 - beta1)`
    v        <- v * beta2 + (1 - beta2) * g * g             `v.mul_(beta2).addcmul_(g, g, value=1 - beta2)`
    bc1, bc2  = 1 - beta1**k, 1 - beta2**k                  python floats (float64), as torch computes them
    w        <- w - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
                                      `w.addcdiv_(m, (v.sqrt() / bc2**0.5).add_(eps), value=-lr/bc1)`
This is the op sequence of torch's single-tensor AdamW (`foreach=False, fused=False`), op for op, so on a device the
bytes equal `torch.optim.AdamW(..., foreach=False)` on float32 parameters (the test checks it on CPU).

Why the update is deterministic: every op is elementwise — an element's new value reads only that element's weight,
gradient and state, through one fixed sequence of roundings — so it does not depend on scheduling, batch, tensor
layout or rank; every data-parallel rank applies it to the same combined gradient and holds the same bytes. One
implementation is pinned because the others round differently: torch's fused AdamW evaluates the update as one
expression (on CPU its bytes differ from the single-tensor ones; the test shows it), and its foreach path is a
separate multi-tensor implementation on CUDA (on CPU it happens to match).

State (all float32, shaped like each parameter): `exp_avg`, `exp_avg_sq`, and for a parameter that is not float32
(bfloat16 weights of the released policy) a float32 `master` copy that the update is applied to, the parameter then
set to the master rounded to nearest-even (`param.copy_(master)`); `master_weights=False` applies the update to the
float32 upcast of the parameter each step instead (updates smaller than half a bf16 ulp are then lost).
"""

from __future__ import annotations

import hashlib
import math
import numbers
from typing import Sequence

import torch
from torch import nn

from ..hashing import tensor_digest
from .objective import SettingError, TrainingError


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _positive(name: str, value: float, allow_zero: bool = False) -> float:
    if not _is_real(value) or value < 0 or (value == 0 and not allow_zero):
        raise SettingError("AdamW", name, value, f"must be a finite number {'>=' if allow_zero else '>'} 0")
    return float(value)


class StrictAdamW:
    """AdamW over `params` (name, parameter) pairs in the order of the flat gradient (module docstring)."""

    def __init__(
        self,
        params: Sequence[tuple[str, nn.Parameter]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        master_weights: bool = True,
    ):
        self.params = list(params)
        if not self.params:
            raise TrainingError("StrictAdamW: no parameters to optimise")
        self.lr, self.betas, self.eps, self.weight_decay = self.check_hyperparameters(lr, betas, eps, weight_decay)
        self.master_weights = bool(master_weights)
        self.step_count = 0
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in self.params:
            st = {"exp_avg": torch.zeros(p.shape, dtype=torch.float32, device=p.device),
                  "exp_avg_sq": torch.zeros(p.shape, dtype=torch.float32, device=p.device)}
            if self.master_weights and p.dtype != torch.float32:
                st["master"] = p.detach().to(torch.float32).clone()
            self.state[name] = st
        self.numel = sum(p.numel() for _, p in self.params)

    @staticmethod
    def check_hyperparameters(lr: float, betas: tuple[float, float], eps: float,
                              weight_decay: float) -> tuple[float, tuple[float, float], float, float]:
        """The hyperparameters as floats; a bad one raises `TrainingError` naming it."""
        betas = tuple(betas) if isinstance(betas, (tuple, list)) else (betas,)
        if len(betas) != 2 or not all(_is_real(b) and 0.0 <= b < 1.0 for b in betas):
            raise TrainingError(f"AdamW betas={betas!r}: must be two numbers in [0, 1)")
        return (_positive("lr", lr), (float(betas[0]), float(betas[1])), _positive("eps", eps),
                _positive("weight_decay", weight_decay, allow_zero=True))

    def config(self) -> dict:
        return {"name": "StrictAdamW", "lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay, "master_weights": self.master_weights}

    @torch.no_grad()
    def step(self, gradient: torch.Tensor) -> None:
        """One update from the flat float32 gradient (P,) (trainable parameters in order, each flattened)."""
        if gradient.dtype != torch.float32 or gradient.shape != (self.numel,):
            raise TrainingError(
                f"AdamW gradient {gradient.dtype} {tuple(gradient.shape)}: must be float32 ({self.numel},), the flat "
                "gradient of the optimiser's parameters"
            )
        if not bool(torch.isfinite(gradient).all()):
            raise TrainingError("AdamW gradient holds non-finite values: the step is refused, weights unchanged")
        self.step_count += 1
        step = float(self.step_count)
        beta1, beta2 = self.betas
        lr, wd = self.lr, self.weight_decay
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        offset = 0
        for name, p in self.params:
            g = gradient[offset:offset + p.numel()].view(p.shape).to(p.device)
            offset += p.numel()
            st = self.state[name]
            w = st.get("master")
            if w is None:
                w = p if p.dtype == torch.float32 else p.detach().to(torch.float32)
            if wd != 0:
                w.mul_(1 - lr * wd)
            st["exp_avg"].lerp_(g, 1 - beta1)
            st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (st["exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(self.eps)
            w.addcdiv_(st["exp_avg"], denom, value=-step_size)
            if w is not p:
                p.copy_(w)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """`<param>.<exp_avg|exp_avg_sq|master>` -> tensor, for sealing and hashing."""
        return {f"{name}.{k}": t for name, st in self.state.items() for k, t in st.items()}

    @torch.no_grad()
    def load_state_tensors(self, tensors: dict[str, torch.Tensor], step_count: int) -> None:
        """Restore the state `state_tensors()` returned after `step_count` steps (a resumed run): the same keys,
        shapes and float32 dtype, copied exactly onto each parameter's device; a mismatch raises `TrainingError`."""
        mine = self.state_tensors()
        if set(tensors) != set(mine):
            odd = sorted(set(tensors) ^ set(mine))
            raise TrainingError(f"AdamW state {odd[:3]}: does not match the optimiser's parameters")
        for key, t in tensors.items():
            if t.dtype != torch.float32 or t.shape != mine[key].shape:
                raise TrainingError(f"AdamW state {key!r} is {t.dtype} {tuple(t.shape)}: must be float32 "
                                    f"{tuple(mine[key].shape)}")
        if isinstance(step_count, bool) or not isinstance(step_count, int) or step_count < 1:
            raise TrainingError(f"AdamW step count {step_count!r}: must be an integer >= 1")
        for key, t in tensors.items():
            mine[key].copy_(t)
        self.step_count = step_count

    def state_digest(self) -> str:
        """SHA-256 over the step count and every state tensor's digest, in parameter order."""
        h = hashlib.sha256(f"step={self.step_count};".encode())
        for key, t in self.state_tensors().items():
            h.update(f"{key}={tensor_digest(t, 'auto')};".encode())
        return h.hexdigest()
