"""Arithmetic classes: which machines give the same bytes for which modes.

Contract
- `arithmetic_class(device) -> str`: "cuda", or on a CPU "cpu_<torch's CPU capability>[_amx]" (see the function).
  Two machines of one class give the same bytes in every mode; `off` / `auto` on a CPU (torch's kernels, oneDNN's
  bf16 matmuls) hold only within one class.
- `strict_class(tag)`: the class a strict run's CPU bytes are bound to -- `tag` without `_amx`: the strict kernels
  run in Triton's interpreter (numpy), which does not use AMX. What still differs between CPU capabilities is what
  strict does not govern: the seeded noise (torch's vectorised normal sampler) and the text encoder.
- Strict bytes of the transformer itself, given the same inputs, are the same on every machine (that is the strict
  contract); a whole trajectory's digest also covers its noise and text features, hence `strict_class`.
Replays tag their expect lines with these classes (`h3lab.frontends.replay`); a trajectory's run record names the class it
was sealed on (`h3lab.run.trajectory.machine_record`), so `verify` can say when off bytes were compared across classes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping

import torch


def arithmetic_class(device: str) -> str:
    """The replay tag of this machine for `device` ("cpu" | "cuda"): "cuda", or on a CPU
    "cpu_<torch's CPU capability>[_amx]" ("cpu_avx2", "cpu_avx512", "cpu_avx512_amx", ...).

    torch's capability (`ATEN_CPU_CAPABILITY` can lower it) picks ATen's vectorised kernels; `_amx` says that oneDNN,
    which runs torch's bf16 matmuls, has AMX (`amx_bf16` in /proc/cpuinfo) and may use it (`ONEDNN_MAX_CPU_ISA`,
    when set, must name AMX for the suffix to stay). Measured on an AMD EPYC with AVX-512 BF16: oneDNN capped at
    `AVX512_CORE` gave every shipped digest byte for byte (so AVX-512 BF16 is not a class of its own);
    `ATEN_CPU_CAPABILITY=avx2` alone still differed from an AVX2 machine's `off` and strict digests, with
    `ONEDNN_MAX_CPU_ISA=AVX2` as well it gave the `off` ones, and with numpy's AVX-512 loops off too
    (`NPY_DISABLE_CPU_FEATURES`) the strict one: `ATEN_CPU_CAPABILITY` set without the other two is a class of its
    own (`_mixed`)."""
    if device != "cpu":
        return device
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        flags = ""
    return cpu_class(torch.backends.cpu.get_cpu_capability(), flags, os.environ)


def cpu_class(capability: str, cpuinfo: str, env: Mapping[str, str]) -> str:
    """`arithmetic_class` of a CPU from torch's capability name, the text of /proc/cpuinfo and the environment."""
    tag = f"cpu_{capability.lower()}"
    onednn = env.get("ONEDNN_MAX_CPU_ISA", env.get("DNNL_MAX_CPU_ISA", "ALL")).upper()  # oneDNN's cap
    if env.get("ATEN_CPU_CAPABILITY") and (onednn == "ALL" or not env.get("NPY_DISABLE_CPU_FEATURES")):
        # ATen lowered by hand while oneDNN or numpy (whose SIMD loops run the strict kernels in Triton's
        # interpreter) keep the hardware's ISA: a mixture no shipped line was recorded on (measured: its off and
        # strict digests matched neither class), so it gets a class of its own.
        return tag + "_mixed"
    if re.search(r"\bamx_bf16\b", cpuinfo) and (onednn == "ALL" or "AMX" in onednn):
        tag += "_amx"
    return tag


def strict_class(tag: str) -> str:
    """The class a strict generation's digest is bound to: `tag` without `_amx` (module docstring)."""
    return tag[: -len("_amx")] if tag.endswith("_amx") else tag
