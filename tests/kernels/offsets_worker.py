"""Run as a script by test_offsets.py (a separate process: a wrapped offset would read a wild address, which can
kill the interpreter instead of failing an assertion). Each check runs a strict kernel on views whose rows lie past
2**31 elements of one lazily allocated bfloat16 buffer (only the touched pages are ever backed by memory) and
compares the result, byte for byte, with the same kernel on a compact copy. Prints `ok <check>` per check."""

from __future__ import annotations

import torch

from h3kernels import attention, gemm, modulate, packing
from strict_testing import randn

# Row strides below 2**31 (so Triton passes them as int32, as it does at every real shape) whose row 2 lies past
# 2**31 elements: only an int64 product row * stride addresses it.
HALF = 2**30 + 32  # 16-byte aligned in bf16: the TMA path where a kernel has one
ODD = 2**30 + 3  # not 16-byte aligned: the pointer path
END = 2 * HALF + 4096  # buffer length


def buffer() -> torch.Tensor:
    """A bf16 buffer of END elements (4 GiB), uninitialised except where the checks write."""
    return torch.empty(END, dtype=torch.bfloat16)


def far_rows(buf: torch.Tensor, rows: torch.Tensor, stride: int) -> torch.Tensor:
    """rows (R, C) written at buf[r * stride : r * stride + C]; the (R, C) view with row stride `stride`."""
    r, c = rows.shape
    for i in range(r):
        buf[i * stride : i * stride + c] = rows[i]
    return buf.as_strided((r, c), (stride, 1))


def check_gemm(buf: torch.Tensor) -> None:
    K, N = 64, 48
    rows = randn(3, K, dtype=torch.bfloat16, seed=1)
    w = randn(N, K, dtype=torch.bfloat16, seed=2)
    for name, stride in (("tma", HALF), ("pointers", ODD)):
        x = far_rows(buf, rows, stride).requires_grad_()
        xc = rows.clone().requires_grad_()
        wc = w.clone().requires_grad_()
        w2 = w.clone().requires_grad_()
        y, yc = gemm.linear(x, w2), gemm.linear(xc, wc)
        assert torch.equal(y, yc), f"gemm forward ({name}) differs on a view past 2**31"
        dy = randn(3, N, dtype=torch.bfloat16, seed=3)
        gx, gw = torch.autograd.grad(y, (x, w2), dy)
        rx, rw = torch.autograd.grad(yc, (xc, wc), dy)
        assert torch.equal(gx, rx) and torch.equal(gw, rw), f"gemm backward ({name}) differs past 2**31"
        print(f"ok gemm_{name}")
    # the weight's row 2 past 2**31 (pointer path: odd stride)
    wf = far_rows(buf, w[:3], ODD)
    assert torch.equal(gemm.linear(rows, wf), gemm.linear(rows, w[:3].clone())), "gemm weight rows past 2**31"
    print("ok gemm_weight")


def check_attention(buf: torch.Tensor) -> None:
    B, S, H, D = 3, 8, 1, 16
    q, k, v = (randn(B, S, H, D, dtype=torch.bfloat16, seed=10 + i) for i in range(3))
    views = []
    for i, t in enumerate((q, k, v)):
        base = i * S * H * D  # q, k, v side by side in each batch slot; batch item 2 past 2**31
        for b in range(B):
            buf[b * HALF + base : b * HALF + base + S * H * D] = t[b].reshape(-1)
        views.append(buf[base:].as_strided((B, S, H, D), (HALF, H * D, D, 1)).requires_grad_())
    compact = [t.clone().requires_grad_() for t in (q, k, v)]
    o, oc = attention.attention(*views), attention.attention(*compact)
    assert torch.equal(o, oc), "attention forward differs on batch items past 2**31"
    do = randn(B, S, H, D, dtype=torch.bfloat16, seed=13)
    for a, b in zip(torch.autograd.grad(o, views, do), torch.autograd.grad(oc, compact, do)):
        assert torch.equal(a, b), "attention backward differs on batch items past 2**31"
    print("ok attention")


def check_packing(buf: torch.Tensor) -> None:
    D = 32
    rows = randn(3, D, dtype=torch.bfloat16, seed=20)
    src = far_rows(buf, rows, HALF).unsqueeze(0)  # (1, 3, D): row 2 past 2**31
    index = torch.tensor([2, 0, 1], dtype=torch.int64)
    assert torch.equal(packing.select_rows(src, index), packing.select_rows(rows.unsqueeze(0).clone(), index))
    print("ok select_rows")


def check_modulate_tables(buf: torch.Tensor) -> None:
    S, D = 5, 32
    x = randn(1, S, D, dtype=torch.bfloat16, seed=30)
    table = randn(3, 2 * D, dtype=torch.bfloat16, seed=31)
    far = far_rows(buf, table, HALF)  # table row 2 past 2**31
    index = torch.tensor([2, 0, 1, 2, 0], dtype=torch.int64)
    got = modulate.modulate(x, far[:, :D], far[:, D:], index)
    want = modulate.modulate(x, table[:, :D].clone(), table[:, D:].clone(), index)
    assert torch.equal(got, want), "modulate differs with table rows past 2**31"
    print("ok modulate_tables")


if __name__ == "__main__":
    big = buffer()
    check_gemm(big)
    check_attention(big)
    check_packing(big)
    check_modulate_tables(big)
