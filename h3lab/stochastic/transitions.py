"""The stochastic transition contract: one pass of an SDE sampler as a Gaussian, in H3's own sign convention, its exact
float32 log-density, and the seeded noise each pass draws. Pure functions over tensors; no model, no run spec.

Sign convention (checked against the released `MiniMaxH3Scheduler.step` and `h3lab.run.sampler.euler_step`)
------------------------------------------------------------------------------------------------------
H3's velocity is data-ward: with sigma the noise level of x (t = 1 - sigma the timestep the model sees),

    x0_hat  = x + sigma * v              (the released scheduler's `x0 = x_t + (1 - t) * v`, note the +)
    eps_hat = x - (1 - sigma) * v        (the noise estimate: x = (1 - sigma) * x0_hat + sigma * eps_hat)

SD3-style code (Flow-GRPO, DanceGRPO, CPS) writes x0_hat = x - sigma * v_sd3: the same estimates with v_sd3 = -v.
Every formula below is the paper's with v_sd3 replaced by -v, then regrouped as "the released Euler step plus a
correction along eps_hat", so that level 0 is the Euler step byte for byte. dt = sigma_next - sigma (< 0).

    Euler (level 0)   mean = euler_step(x, v, t = 1 - sigma, sigma, sigma_next)   [= x - dt * v exactly in reals]

    flow_sde (Flow-GRPO, level a):   s = a * sqrt(sigma / (1 - sigma)), with 1 - sigma_next as the denominator when
        sigma == 1 (the first pass; Flow-GRPO's `sigma_max = sigmas[1]`)
        paper:  mean = x * (1 + s^2 dt / (2 sigma)) + v_sd3 * (1 + s^2 (1 - sigma) / (2 sigma)) * dt,  std = s sqrt(-dt)
        H3:     mean = Euler + c * eps_hat,   c = s^2 dt / (2 sigma)

    dance_sde (DanceGRPO's flux_step, level eta):   score = -(x - (1 - sigma) * x0_hat) / sigma^2 = -eps_hat / sigma
        paper:  mean = x + dt * v_sd3 - eta^2 / 2 * score * dt,  std = eta * sqrt(sigma - sigma_next)
        H3:     mean = Euler + c * eps_hat,   c = eta^2 dt / (2 sigma)

    cps (coefficient-preserving sampling, level a in [0, 1]):   std = sigma_next * sin(a * pi / 2)
        paper:  mean = (1 - sigma_next) * x0_hat + sqrt(sigma_next^2 - std^2) * eps_hat
        H3:     mean = Euler + c * eps_hat,   c = sqrt(sigma_next^2 - std^2) - sigma_next
        (since (1 - sigma_next) * x0_hat + sigma_next * eps_hat is the Euler step). Its step into sigma_next = 0
        has std 0: the last CPS pass is the Euler step, deterministic.

    the transition:  x_next = mean + std * eps,  eps ~ N(0, I) from `pass_noise`.

Arithmetic (fixed, so a rollout and a training forward agree to the byte on equal inputs):
- x and v are taken as float32. The Euler part is `sampler.euler_step` (its x0 uses 1 - t, its blend the grid
  ratio), eps_hat = x - t * v with t = 1 - sigma rounded to float32 (the timestep of the pass), all float32.
- c and std are computed in float64 from the float32 grid values and the level (python floats), then rounded once
  to float32; mean = Euler + c * eps_hat in float32. When c == 0 (level 0; the CPS step into 0) nothing is added:
  the mean is the Euler step's bytes (no -0.0 -> +0.0 either).
- std is one float32 scalar per pass (a 0-d tensor on x's device): the same for every element and request.

The log-density (`gaussian_logprob`)
------------------------------------
For one request with n elements (every element but the leading batch axis):

    log p = sum_k [ -(x_next_k - mean_k)^2 / (2 std^2) - log std - log sqrt(2 pi) ]
          = -S / 2 - n * (log std + log(2 pi) / 2),    S = sum_k z_k^2,  z_k = (x_next_k - mean_k) / std

`logp_sum` is log p and `logp_mean` is log p / n (Flow-GRPO's and DanceGRPO's per-element mean), both rounded once
to float32 from float64. z_k is float64 (the float32 difference widened, divided by std, squared: IEEE basic ops,
the same bytes on every device); S is a pairwise halving tree over the request's elements in row-major order,
zero-padded to a power of two (level by level: element j plus element j + width/2), in float64; log std and
log sqrt(2 pi) are python float64 (`math.log`, on the host), not device kernels. Every request is reduced on its
own (the tree runs along its own row), so its bytes do not depend on the batch size, its position in the batch, the
device, the thread count or the other requests. It is differentiable in `mean` (training's autograd), not in std.

The noise (`pass_noise`)
------------------------
eps of request `request`, pass `pass_index`, modality `modality` ("video" | "audio") is
`torch.randn(shape, dtype=float32)` on a CPU generator seeded with

    int.from_bytes(sha256(f"h3lab-pass-noise/1|{seed}|{request}|{pass_index}|{modality}").digest()[:8], "little")
        & (2**63 - 1)

so it depends on those four values and the shape only: not on the device, the batch, the batch position or the
order in which requests are drawn. `request` is the request's identity in its rollout (sealed with the run), never
its position in a forward batch.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from typing import Sequence

import torch

from ..errors import ValidationError
from ..run.sampler import euler_step

SDE_KINDS = ("flow_sde", "dance_sde", "cps")
MODALITIES = ("video", "audio")
NOISE_SCHEME = "h3lab-pass-noise/1"
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


class TransitionError(ValidationError):
    """A stochastic transition's kind, level, sigmas, tensors or noise key break a rule; names value and rule."""


# ------------------------------------------------------------------------------------------------ validation
def _real(name: str, value) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TransitionError(f"{name} has shape {tuple(value.shape)}: must be a single number")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TransitionError(f"{name}={value!r}: must be a finite number")
    return float(value)


def check_kind(kind) -> str:
    if kind not in SDE_KINDS:
        raise TransitionError(f"kind={kind!r}: must be one of {', '.join(SDE_KINDS)}")
    return kind


def check_level(kind: str, level) -> float:
    """The level of `kind` as a python float: flow_sde's a >= 0, dance_sde's eta >= 0, cps's a in [0, 1]."""
    level = _real(f"{check_kind(kind)} level", level)
    if level < 0 or (kind == "cps" and level > 1):
        rule = "in [0, 1]" if kind == "cps" else ">= 0"
        raise TransitionError(f"{kind} level={level!r}: must be {rule}")
    return level


def _grid(name: str, value) -> float:
    """A sigma as the python float of its float32 value (grid values are float32)."""
    value = _real(name, value)
    return float(torch.tensor(value, dtype=torch.float32))


def _check_sigmas(sigma, sigma_next) -> tuple[float, float]:
    s, s_next = _grid("sigma", sigma), _grid("sigma_next", sigma_next)
    if not 0.0 <= s_next < s <= 1.0:
        raise TransitionError(f"sigma={s!r} -> sigma_next={s_next!r}: must satisfy 0 <= sigma_next < sigma <= 1")
    return s, s_next


# ------------------------------------------------------------------------------------------------ the step
def coefficients(kind: str, level, sigma, sigma_next) -> tuple[float, float]:
    """(c, std) of one pass in float64 (python floats; see the module docstring): mean = Euler + c * eps_hat."""
    level = check_level(kind, level)
    s, s_next = _check_sigmas(sigma, sigma_next)
    dt = s_next - s
    if kind == "flow_sde":
        denominator = 1.0 - (s_next if s == 1.0 else s)
        noise = level * math.sqrt(s / denominator)
        return noise * noise * dt / (2.0 * s), noise * math.sqrt(-dt)
    if kind == "dance_sde":
        return level * level * dt / (2.0 * s), level * math.sqrt(s - s_next)
    std = s_next * math.sin(level * math.pi / 2.0)
    return math.sqrt(max(s_next * s_next - std * std, 0.0)) - s_next, std


def transition_mean_std(kind: str, x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, level):
    """(mean, std) of the Gaussian transition x -> x_next of one pass (module docstring): mean float32 of x's shape,
    std a float32 0-d tensor on x's device. x: the generated rows entering the pass; v: the model's velocity for
    them (any float dtype; both taken as float32)."""
    s, s_next = _check_sigmas(sigma, sigma_next)
    c, std = coefficients(kind, level, s, s_next)
    if not isinstance(x, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise TransitionError("x and v must be tensors")
    if x.shape != v.shape:
        raise TransitionError(f"x {tuple(x.shape)} and v {tuple(v.shape)}: must have one shape")
    x, v = x.float(), v.float()
    s32 = torch.tensor(s, dtype=torch.float32)
    t = 1.0 - s32  # the pass's timestep, as `sampler.timesteps` builds it
    mean = euler_step(x, v, t, s32, torch.tensor(s_next, dtype=torch.float32))
    if c != 0.0:
        t = t.to(x.device)
        mean = mean + torch.tensor(c, dtype=torch.float32, device=x.device) * (x - t * v)
    return mean, torch.tensor(std, dtype=torch.float32, device=x.device)


# ------------------------------------------------------------------------------------------------ density
def tree_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis by the declared pairwise halving tree (zero-padded to a power of two; element j plus
    element j + width/2 at every level), in values' dtype. Elementwise adds only, so every row's bytes depend on that
    row alone."""
    width = values.shape[-1]
    full = 1 << max(width - 1, 0).bit_length()
    if full != width:
        values = torch.nn.functional.pad(values, (0, full - width))
    while values.shape[-1] > 1:
        half = values.shape[-1] // 2
        values = values[..., :half] + values[..., half:]
    return values[..., 0]


def _per_request_std(std, batch: int) -> list[float]:
    std = torch.as_tensor(std).detach()
    if std.numel() == 1:
        values = [float(std.reshape(()).item())] * batch
    elif std.ndim >= 1 and std.shape[0] == batch and std.numel() == batch:
        values = [float(s) for s in std.double().cpu().reshape(-1)]
    else:
        raise TransitionError(f"std of shape {tuple(std.shape)}: must be one value per pass or per request "
                              f"((), ({batch},) or ({batch}, 1, ...))")
    bad = [s for s in values if not (math.isfinite(s) and s > 0.0)]
    if bad:
        raise TransitionError(f"std={bad[0]!r}: must be a finite number > 0 (a deterministic transition -- level 0, "
                              "or the CPS step into sigma 0 -- has no Gaussian density)")
    return values


def gaussian_logprob(x_next: torch.Tensor, mean: torch.Tensor, std) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_mean, logp_sum), float32 (B,) on mean's device: the log-density of x_next under N(mean, std^2 I) per
    leading batch item, over all its other elements (module docstring: float64 terms, the pairwise tree, one
    rounding). std: one positive value for all requests or one per request."""
    if not isinstance(x_next, torch.Tensor) or not isinstance(mean, torch.Tensor):
        raise TransitionError("x_next and mean must be tensors")
    if x_next.shape != mean.shape or mean.ndim < 2:
        raise TransitionError(f"x_next {tuple(x_next.shape)} and mean {tuple(mean.shape)}: must have one shape "
                              "(batch, ...) with at least one element axis")
    batch, n = mean.shape[0], mean[0].numel()
    if n == 0:
        raise TransitionError(f"mean {tuple(mean.shape)}: a request has no elements, so it has no density")
    stds = _per_request_std(std, batch)
    device = mean.device
    std64 = torch.tensor(stds, dtype=torch.float64, device=device).reshape(batch, 1)
    z = (x_next.detach().to(torch.float32).double() - mean.to(torch.float32).double()).reshape(batch, n) / std64
    squares = tree_sum(z * z)  # (B,) float64
    constant = torch.tensor([n * (math.log(s) + _HALF_LOG_2PI) for s in stds], dtype=torch.float64, device=device)
    logp = -0.5 * squares - constant
    return (logp / n).to(torch.float32), logp.to(torch.float32)


def transition_logprob(kind: str, level, x: torch.Tensor, v: torch.Tensor, x_next: torch.Tensor, sigma, sigma_next):
    """(logp_mean, logp_sum, mean, std) of the observed transition x -> x_next under `kind` at `level` (training's
    side of the ratio: recompute v, then this). Raises for a deterministic pass (std 0)."""
    mean, std = transition_mean_std(kind, x, v, sigma, sigma_next, level)
    logp_mean, logp_sum = gaussian_logprob(x_next, mean, std)
    return logp_mean, logp_sum, mean, std


# ------------------------------------------------------------------------------------------------ the noise
def _index(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise TransitionError(f"{name}={value!r}: must be an integer >= 0")
    return int(value)


def noise_seed(seed: int, request: int, pass_index: int, modality: str) -> int:
    """The CPU generator seed of one (request, pass, modality) draw (module docstring)."""
    key = (f"{NOISE_SCHEME}|{_index('seed', seed)}|{_index('request', request)}|"
           f"{_index('pass_index', pass_index)}|{modality}")
    if modality not in MODALITIES:
        raise TransitionError(f"modality={modality!r}: must be one of {', '.join(MODALITIES)}")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & (2**63 - 1)


def pass_noise(seed: int, request: int, pass_index: int, modality: str, shape: Sequence[int]) -> torch.Tensor:
    """eps of one (request, pass, modality): float32 standard normal of `shape` on the CPU (module docstring)."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(noise_seed(seed, request, pass_index, modality))
    try:
        shape = tuple(_index("shape entry", s) for s in shape)
    except TypeError:
        raise TransitionError(f"shape={shape!r}: must be a sequence of integers >= 0") from None
    return torch.randn(shape, generator=generator, dtype=torch.float32)
