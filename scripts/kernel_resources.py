"""Registers, spills and shared memory of the strict GEMM kernels as compiled for an H100/H200 (sm_90), on a machine
without a GPU: Triton compiles ahead of time for a named target, and the cubin's resource table and SASS say what a
profiler would.

    .venv/bin/python scripts/kernel_resources.py                  # linear and linear_tree, their contract tiles
    .venv/bin/python scripts/kernel_resources.py --out res.json   # the same as JSON (written atomically)
    .venv/bin/python scripts/kernel_resources.py --ops linear_tree --tile paired=1 num_stages=3   # another tile

Run it without TRITON_INTERPRET (the interpreter's kernels cannot be compiled).

Contract: for each op ("linear": one K chunk at `LINEAR_TILES`; "linear_tree": the 8-chunk tree at `TREE_TILES`),
bfloat16 operands read through TMA descriptors, bias on, the kernel `_gemm_kernel` with the launcher's constexprs,
compiled by the installed Triton for GPUTarget("cuda", 90, 32) with the tile's warps and stages. Reported per op:
`registers` (per thread, from `cuobjdump -res-usage`), `stack_bytes`, `spill_stores` / `spill_loads` (STL / LDL
instructions in the SASS: static counts, not executions), `shared_bytes` (Triton's dynamic shared memory) and
`fits_h200` (shared_bytes <= 232,448, the H200's per-block opt-in maximum). The installed Triton may not be the GPU
image's (3.6 there), so counts are a proxy: the same source, the same target, another compiler version.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

H200_SHARED_BYTES = 232_448  # 227 KB: the largest dynamic shared memory one block may opt into on sm_90


def _compile(n_chunks: int, tile):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from h3kernels import gemm

    fn = gemm._gemm_kernel.fn
    consts = dict(HAS_BIAS=True, N_CHUNKS=n_chunks, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                  BLOCK_K=tile.block_k, GROUP_M=tile.group_m, EVEN_K=True, USE_TMA=True, X_TRANS=False,
                  W_TRANS=False, PRECISION=tile.precision, INTERPRETED=False, PAIRED=tile.paired,
                  SLOT_TMA=tile.slot_tma and n_chunks >= 4)
    bf16_desc = "tensordesc<bf16[{}, {}]>"
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "scratch_ptr": "*fp32",
             "x_desc": bf16_desc.format(tile.block_m, tile.block_k),
             "w_desc": bf16_desc.format(tile.block_n, tile.block_k),
             "scratch_desc": (f"tensordesc<fp32[{tile.block_m}, {tile.block_n}]>" if consts["SLOT_TMA"] else "*fp32")}
    ints = {"M", "N", "CHUNK_K", "n_programs"}  # and every stride_*
    unknown = [n for n in fn.arg_names if n not in consts and n not in types and n not in ints
               and not n.startswith("stride_")]
    if unknown:  # a kernel argument this script does not know (a new constexpr, pointer or descriptor)
        raise RuntimeError(f"kernel_resources: no type for kernel arguments {unknown}")
    signature = {name: "constexpr" if name in consts else types.get(name, "i32") for name in fn.arg_names}
    source = ASTSource(fn, signature, constexprs=consts)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": tile.num_warps, "num_stages": tile.num_stages,
                                   "enable_fp_fusion": False})


def _cuobjdump() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        raise RuntimeError(f"kernel_resources: {path} is missing (Triton's NVIDIA backend ships it)")
    return path


def _contract_tile(op: str):
    """The bf16 contract tile of `op` ("linear" or "linear_tree")."""
    import torch

    from h3kernels import gemm

    if op not in ("linear", "linear_tree"):
        raise ValueError(f"kernel_resources: op {op!r} is not 'linear' or 'linear_tree'")
    return (gemm.LINEAR_TILES if op == "linear" else gemm.TREE_TILES)[torch.bfloat16]


def resources(op: str, tile=None) -> dict:
    """The resource row of one op's contract kernel (module docstring); `tile` replaces the contract's tile."""
    import triton

    from h3kernels import gemm

    tile = tile or _contract_tile(op)
    kernel = _compile(1 if op == "linear" else gemm.TREE_CHUNKS, tile)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([_cuobjdump(), "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_cuobjdump(), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    fields = dict(part.split(":", 1) for line in usage.splitlines() if "REG:" in line for part in line.split())
    shared = int(kernel.metadata.shared)
    return {"op": op, "tile": tile.describe(), "registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"]),
            "spill_stores": sass.count("STL"), "spill_loads": sass.count("LDL"), "shared_bytes": shared,
            "fits_h200": shared <= H200_SHARED_BYTES, "target": "sm_90", "triton": triton.__version__}


def _override(op: str, pairs: list[str], parser):
    """The op's contract tile with FIELD=INT replacements (None when there are none)."""
    if not pairs:
        return None
    import dataclasses

    tile = _contract_tile(op)
    fields = {f.name for f in dataclasses.fields(tile)}
    changes = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in fields or not value.lstrip("-").isdigit():
            parser.error(f"--tile {pair!r}: want FIELD=INT with FIELD one of {sorted(fields)}")
        changes[name] = bool(int(value)) if isinstance(getattr(tile, name), bool) else int(value)
    return dataclasses.replace(tile, **changes)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="+", default=["linear", "linear_tree"], choices=["linear", "linear_tree"])
    parser.add_argument("--tile", nargs="+", metavar="FIELD=INT", default=[],
                        help="replace fields of the contract tile (ints; 0/1 for flags), e.g. num_stages=3 paired=1")
    parser.add_argument("--out", help="JSON path (written atomically)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 is set: the interpreter's kernels cannot be compiled; unset it")
    rows = [resources(op, _override(op, args.tile, parser)) for op in args.ops]
    for r in rows:
        print(" | ".join(f"{k} {r[k]}" for k in ("op", "tile", "registers", "spill_stores", "spill_loads",
                                                  "shared_bytes", "fits_h200")), flush=True)
    if args.out:
        from h3lab.io_utils import atomic_write_text

        atomic_write_text(args.out, json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
