"""The forward-variant sweep of `benchmark_attention.py --sweep`: strict attention's forward kernel under candidate
loop variants and tiles (kernels/attention.py `ForwardVariant`, `AttentionTiles`) against torch SDPA, in one call.

Contract: for each S (default 2066 12369 37853; dry run 67 130 256), B = 1, bf16, fresh random (1, S, H, D) q/k/v:
every variant in `VARIANTS` is run once, its output o and base-2 log-sum-exp compared byte for byte with the
contract's kernel (`bytes_equal`: o and lse both), then timed (CUDA events, median of `runs`, interleaved with the
other variants round by round); SDPA is timed the same way three ways: `runtime.attention` (the op table's
reference, as Diffusers calls it), and the cuDNN and flash backends forced. Each result row: rows, variant, class
("byte-keeping": declared to keep the per-row reduction order over keys and every rounding; "byte-changing"),
bytes_equal, median_s, tflops (4 S^2 H D / t), ratio_vs_sdpa (to `runtime.attention`) and ratio_vs_cudnn,
rel_l2_vs_fp32 where S <= 4096 (float32 reference, head by head), or error (compilation or launch failure: recorded,
the sweep goes on). Byte-keeping rows first, byte-changing rows apart (`class`). `precompile` > 0 compiles every
variant first in that many processes (they fill Triton's on-disk cache at S = 256, the same specialisation).
"""

from __future__ import annotations

import math
import statistics

SWEEP_SEQS = (2066, 12369, 37853)
DRY_SEQS = (67, 130, 256)


def variants(only=None):
    """[(name, class, ForwardVariant, AttentionTiles)]: byte-keeping first, then byte-changing; `only`: just the
    named ones (in this order)."""
    import torch
    from h3kernels import attention as attn

    base = attn.TILES[torch.bfloat16]
    fma = attn.FORWARD[torch.bfloat16].fp_fusion  # the contract's FMA contraction, on every byte-keeping variant

    def V(**knobs):  # noqa: N802 - a ForwardVariant with the contract's fp_fusion unless a knob says otherwise
        return attn.ForwardVariant(**{"fp_fusion": fma, **knobs})

    T = lambda m, warps, stages=None, n=None: attn.AttentionTiles(  # noqa: E731
        m, n or base.fwd_n, warps, stages or base.fwd_stages, *(getattr(base, f) for f in (
            "dkdv_n", "dkdv_m", "dq_m", "dq_n", "bwd_warps", "bwd_stages")))
    unmasked = V(split_tail=True, even_d=True)
    tma = V(split_tail=True, even_d=True, tma=True)
    # 4 stages (288 KB) and BLOCK_N 256 at 2 stages (288 KB) exceed the 227 KB of shared memory: not swept.
    # "contract" is the loop with every tile masked: with FMA contraction its masked tiles cannot contract the
    # logit subtraction, so on the GPU its bytes may differ from the unmasked loops' (`bytes_equal` says).
    keep = [
        ("contract", V(), base),
        ("split_tail", V(split_tail=True), base),
        ("unmasked", unmasked, base),
        ("unmasked_stages2", unmasked, T(128, 8, 2)),
        ("unmasked_loop_stages2", V(split_tail=True, even_d=True, loop_stages=2), base),
        ("unmasked_m64_w4", unmasked, T(64, 4)),
        ("unmasked_m64_w4_s1", unmasked, T(64, 4, 1)),
        ("tma", tma, base),
        ("tma_stages2", tma, T(128, 8, 2)),
        ("tma_m64_w4", tma, T(64, 4)),
        ("tma_m64_w4_s2", tma, T(64, 4, 2)),
        ("tma_m64_w4_s1", tma, T(64, 4, 1)),
        ("tma_m256_w8", tma, T(256, 8, 2)),
        ("tma_warp_specialize", V(split_tail=True, even_d=True, tma=True, warp_specialize=True), base),
        ("tma_lookahead", V(split_tail=True, even_d=True, tma=True, lookahead=True), base),
        ("tma_lookahead_stages2", V(split_tail=True, even_d=True, tma=True, lookahead=True), T(128, 8, 2)),
        ("exp_triton", V(split_tail=True, even_d=True, tma=True, exp="triton"), base),
        ("exp_ftz", V(split_tail=True, even_d=True, tma=True, exp="ftz"), base),
    ]
    change = [
        ("no_fp_fusion", V(split_tail=True, even_d=True, tma=True, fp_fusion=False), base),  # the 9th session's
        ("prescale_q", V(split_tail=True, even_d=True, tma=True, prescale_q=True), base),
        ("reciprocal", V(split_tail=True, even_d=True, tma=True, reciprocal=True), base),
        ("fusion_prescale_reciprocal", V(split_tail=True, even_d=True, tma=True, prescale_q=True, reciprocal=True),
         base),
        ("block_n64", tma, T(128, 8, n=64)),
        ("block_n64_m64_w4", tma, T(64, 4, n=64)),
        ("block_n64_m64_w4_s2", tma, T(64, 4, 2, n=64)),
    ]
    rows = [(n, "byte-keeping", v, t) for n, v, t in keep] + [(n, "byte-changing", v, t) for n, v, t in change]
    if only:
        unknown = sorted(set(only) - {r[0] for r in rows})
        if unknown:
            raise ValueError(f"unknown attention variants {unknown}; known: {[r[0] for r in rows]}")
        rows = [r for r in rows if r[0] in only]
    return rows


def _inputs(S, heads, head_dim, device):
    import torch

    gen = torch.Generator(device=device).manual_seed(S)
    return tuple(torch.randn(1, S, heads, head_dim, device=device, generator=gen).bfloat16() for _ in range(3))


def _compile_worker(names, heads, head_dim, device="cuda"):
    """Run the named variants once at S = 256 (fills Triton's cache); returns {name: error or None}."""
    from h3kernels import attention as attn

    q, k, v = _inputs(256, heads, head_dim, device)
    errors = {}
    for name, _, variant, tiles in variants():
        if name in names:
            try:
                attn._forward(q, k, v, None, variant, tiles)
                errors[name] = None
            except Exception as exc:  # noqa: BLE001 - reported by the main sweep too
                errors[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return errors


def _precompile(n_procs, heads, head_dim, device="cuda", only=None):
    import multiprocessing

    names = [v[0] for v in variants(only)]
    chunks = [names[i::n_procs] for i in range(n_procs)]
    with multiprocessing.get_context("spawn").Pool(n_procs) as pool:
        results = pool.starmap(_compile_worker, [(c, heads, head_dim, device) for c in chunks])
    return {k: v for r in results for k, v in r.items()}


def _timer(device):
    from _common import call_seconds

    return lambda fn: call_seconds(fn, device)


def _fp32_rel_l2(o, q, k, v):
    import torch

    err = ref = 0.0
    for h in range(q.shape[2]):
        qh, kh, vh = (t[:, :, h].float() for t in (q, k, v))
        truth = torch.softmax(qh @ kh.transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1) @ vh
        err += float((o[:, :, h].float() - truth).pow(2).sum())
        ref += float(truth.pow(2).sum())
    return math.sqrt(err / ref)


def sweep_forward(seqs, heads: int, head_dim: int, device: str, precompile: int = 0, only=None):
    """(variant table, results): see the module docstring; `only` restricts the variants by name."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from h3kernels import attention as attn
    from h3lab.execution import runtime

    if seqs is None:
        seqs = DRY_SEQS if device == "cpu" else SWEEP_SEQS
    table = [{"variant": n, "class": c, "forward": v.describe(), "tile": t.describe()} for n, c, v, t in variants(only)]
    compile_errors = _precompile(precompile, heads, head_dim, only=only) if precompile and device == "cuda" else {}
    timed = _timer(device)
    results = []
    for S in seqs:
        q, k, v = _inputs(S, heads, head_dim, device)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def forced(backend):
            def fn():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(qt, kt, vt)
            return fn

        fns = {"sdpa": lambda: runtime.attention(q, k, v)}
        if device == "cuda":
            fns["cudnn"], fns["flash"] = forced(SDPBackend.CUDNN_ATTENTION), forced(SDPBackend.FLASH_ATTENTION)
        ref_o, ref_lse = attn._forward(q, k, v, None)
        rows = {}
        for name, klass, variant, tiles in variants(only):
            row = {"rows": S, "variant": name, "class": klass, "forward": variant.describe(), "tile": tiles.describe()}
            rows[name] = row
            try:
                o, lse = attn._forward(q, k, v, None, variant, tiles)
                row["bytes_equal"] = bool(torch.equal(o, ref_o) and torch.equal(lse, ref_lse))
                row["o_max_abs_diff"] = float((o.float() - ref_o.float()).abs().max())
                if S <= 4096:
                    row["rel_l2_vs_fp32"] = _fp32_rel_l2(o, q, k, v)
                del o, lse
                fns[name] = lambda variant=variant, tiles=tiles: attn._forward(q, k, v, None, variant, tiles)
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a result
                row["error"] = compile_errors.get(name) or f"{type(exc).__name__}: {str(exc)[:300]}"
        for name in ("sdpa", "cudnn", "flash"):
            if name in fns:
                try:
                    fns[name]()
                except Exception as exc:  # noqa: BLE001
                    rows[name] = {"rows": S, "variant": name, "class": "reference", "error": str(exc)[:300]}
                    del fns[name]
        runs = 3 if S > 20000 else 10 if S > 5000 else 30
        if device == "cpu":
            runs = 1
        times = {name: [] for name in fns}
        for _ in range(runs):  # round-robin: every variant once per round
            for name, fn in fns.items():
                times[name].append(timed(fn))
        flops = 4.0 * S * S * heads * head_dim
        med = {name: statistics.median(ts) for name, ts in times.items()}
        for name in ("sdpa", "cudnn", "flash"):
            if name in med:
                rows[name] = {"rows": S, "variant": name, "class": "reference", "backend": name}
        for name, row in rows.items():
            if name in med:
                row.update(median_s=med[name], times_s=times[name], runs=runs, tflops=flops / med[name] / 1e12,
                           ratio_vs_sdpa=med[name] / med["sdpa"])
                if "cudnn" in med:
                    row["ratio_vs_cudnn"] = med[name] / med["cudnn"]
            row["shape"] = f"1x{S}x{heads}x{head_dim}"
            row["impl"] = "h3lab-strict" if row["class"] != "reference" else "torch-sdpa"
            row.setdefault("peak_mem_gib", float("nan"))
            results.append(row)
        del q, k, v, qt, kt, vt, ref_o, ref_lse, fns
    return table, results
