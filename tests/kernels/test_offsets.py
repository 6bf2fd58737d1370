"""64-bit addressing of the strict kernels (kernels/_offsets.py): the offset helpers past 2**31 in a tiny kernel,
and the strided-view kernels run on rows that lie past 2**31 elements of a lazily allocated buffer (a separate
process: a wrapped offset reads a wild address, which may kill the process rather than fail an assertion)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

from h3kernels._offsets import flat_offsets, tile_offsets

ROWS, COLS = 8, 16


@triton.jit
def _offsets_probe(out_tile, out_flat, row0, row_stride, col_stride, pid, ROWS: tl.constexpr, COLS: tl.constexpr,
                   BLOCK: tl.constexpr):
    rows = row0 + tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    offs = tile_offsets(rows, row_stride, cols, col_stride)
    tl.store(out_tile + tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :], offs)
    tl.store(out_flat + tl.arange(0, BLOCK), flat_offsets(pid, BLOCK))


def test_offset_helpers_past_int32():
    # the last rows of 1344x768x362f's FFN activation (109,205 rows x 28,672), and of a 3 x 37,853-row batch;
    # the flat block of the last program over its 3.1e9 elements (BLOCK 1024)
    for row0, row_stride, col_stride in ((109_205 - ROWS, 28_672, 1), (113_559 - ROWS, 28_672, 1), (3, 2**30 + 3, 7)):
        tile = torch.full((ROWS, COLS), -1, dtype=torch.int64)
        flat = torch.full((1024,), -1, dtype=torch.int64)
        pid = 3_131_125_760 // 1024
        _offsets_probe[(1,)](tile, flat, row0, row_stride, col_stride, pid, ROWS=ROWS, COLS=COLS, BLOCK=1024)
        rows = np.arange(row0, row0 + ROWS, dtype=np.int64)[:, None]
        want = rows * row_stride + np.arange(COLS, dtype=np.int64)[None, :] * col_stride
        assert want.max() >= 2**31  # the case the helpers exist for
        np.testing.assert_array_equal(tile.numpy(), want)
        np.testing.assert_array_equal(flat.numpy(), pid * 1024 + np.arange(1024, dtype=np.int64))


def test_kernels_address_rows_past_int32():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("offsets_worker.py"))], env=env,
                          capture_output=True, text=True, timeout=600)
    done = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert proc.returncode == 0, f"worker exited {proc.returncode} after {done}: {proc.stderr[-2000:]}"
    assert done == ["gemm_tma", "gemm_pointers", "gemm_weight", "attention", "select_rows", "modulate_tables"]
