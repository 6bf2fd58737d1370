"""Strict norm / elementwise / RoPE / timestep / packing kernels vs the torch reference ops on the H3 shapes.

    python benchmarks/benchmark_elementwise.py --out benchmarks/results/elementwise.json     # H200
    python benchmarks/benchmark_elementwise.py --dry-run --out /tmp/elementwise.json         # CPU interpreter, tiny
    python benchmarks/benchmark_elementwise.py --sweep ...                                   # + rms_norm tile sweep
    python benchmarks/benchmark_elementwise.py --fusions --out benchmarks/results/fusions.json  # fused vs unfused
    python benchmarks/benchmark_elementwise.py --fusions --dry-run --out /tmp/fusions.json      # CPU, tiny

Rows M in {2066, 7272} (512x512x22f and 864x480x56f), batch 1, hidden 5376, 56 heads x 128 (96 rotated), FFN 14336,
bfloat16 activations as released (float32 where the model is float32: silu on the timestep MLP, the RoPE tables,
the sinusoid, the video/audio projections that `pack_rows` casts, the output heads `select_rows` reads).
Each op is timed as the model calls it (host-side checks included) against `h3lab.execution.runtime`'s reference op in the
same process, two ways: `median_s` = `triton.testing.do_bench` (eager, L2 flushed between runs, median of all runs),
which for ops of tens of microseconds measures Python launch overhead as much as the GPU; `gpu_s` = device time per
call of 20 back-to-back calls queued behind a GPU sleep (`measure_gpu`), the time that counts inside a forward where
the host runs ahead of the GPU. `ratio` = strict / torch on `gpu_s`, `ratio_eager` on `median_s`.
GB/s = bytes_moved / gpu_s, bytes_moved = every input read once + every output written once (the formula is in
each row's `bytes_formula`). Backward rows time `torch.autograd.grad` of the op alone.
Checks stored on the strict rows: `ref_equal` (bytes equal to the torch reference on this GPU), `rows_equal` (the
first row alone, the first half of the rows, and rows 7..M -- every row at another position in its tile -- give the
bytes of the full call), `repeat_equal`, `bwd_repeat_equal`
(two backward runs), and `rel_l2_vs_fp32` for strict and torch alike (against the float32 reference math).
`--fusions` times instead each switchable epilogue fusion (`h3lab.execution.runtime.FUSIONS`) against the unfused strict
sequence the model runs without it, at `FUSION_ROWS` (2,066 and 37,853 packed rows: 512x512x22f and 1344x768x124f)
of the full width: `qk_norm_rope` vs rms_norm(q), rms_norm(k), rope(q), rope(k); `residual_norm_modulate` vs
gated_residual then norm_modulate. Rows carry `variant` "fused" / "unfused" (impl "h3lab-strict") beside the torch
composition (impl "h3lab-off"), `bytes_per_row` of each variant from the formula in `bytes_formula` (bf16 = 2 bytes,
the float32 rstd the unfused norms write, the RoPE tables once per packed row per kernel, the small AdaLN tables as
L2-resident), `fused_equal_unfused` (bytes), `rows_equal`, `repeat_equal`, and `ratio` = fused / unfused device time.
`ptx` lists, per strict kernel, the count of approximate / contracted PTX instructions (`.approx`, `div.full`,
`fma`) in its compiled code — libdevice functions (exp / sin / cos) contain fma by design.
"""

from __future__ import annotations

import re

from _common import equal, flat, header, kernel_parser, measure, measure_gpu, prepare, rel_l2, write

HIDDEN, HEADS, HEAD_DIM, ROTARY, FFN, FREQ_DIM, TIMESTEPS = 5376, 56, 128, 96, 14336, 256, 2
ROWS = (2066, 7272)
# (text, video, audio) rows of the two layouts: illustrative splits with the released proportions.
SPLITS = {2066: (493, 1536, 37), 7272: (1508, 5670, 94), 3: (1, 1, 1), 67: (20, 40, 7)}
DRY = dict(HIDDEN=24, HEADS=2, HEAD_DIM=16, ROTARY=12, FFN=40, FREQ_DIM=16)
DRY_ROWS = (3, 67)


# -------------------------------------------------------------------------------------------------- the cases
def cases(m: int, device: str, dims: dict):
    """One dict per op at m packed rows: args, reference math (float32), bytes moved, row slicing for rows_equal,
    and which args get gradients."""
    import torch

    from h3kernels import elementwise, modulate, norm_modulate, packing, rms_norm, rope, timestep
    from h3lab.execution import runtime

    hid, heads, hd, rot, ffn, fdim = (dims[k] for k in ("HIDDEN", "HEADS", "HEAD_DIM", "ROTARY", "FFN", "FREQ_DIM"))
    gen = torch.Generator(device=device).manual_seed(m)
    bf = torch.bfloat16

    def rnd(*shape, dtype=bf, scale=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)

    def idx(n, hi):
        return torch.randint(0, hi, (n,), device=device, generator=gen)

    r_tab = 3 * TIMESTEPS
    index = idx(m, r_tab)
    tables = rnd(r_tab, 6 * hid, scale=0.3).chunk(6, dim=-1)  # the AdaLN projection, chunked as the model does
    nt, nv, na = SPLITS[m]
    perm = torch.randperm(m, device=device, generator=gen)
    ti, vi, ai = perm[:nt].contiguous(), perm[nt : nt + nv].contiguous(), perm[nt + nv :].contiguous()
    f_rope = rot // 6
    pos = torch.stack([idx(m, 14), idx(m, 27), idx(m, 45)], dim=-1)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 2 * f_rope, 2, dtype=torch.float32, device=device) / (2 * f_rope)))
    cos, sin = runtime.rope_table(pos, inv_freq)
    x_h, x_qk = rnd(1, m, hid), rnd(1, m, heads, hd)
    w_h, w_qk = rnd(hid, scale=0.1) + 1, rnd(hd, scale=0.1) + 1
    t = torch.rand(TIMESTEPS, device=device, generator=gen)
    out = []

    def case(name, op, args, truth, nbytes, formula, rows=None, grads=(), shape=None):
        out.append(dict(name=name, op=op, args=args, truth=truth, bytes=nbytes, formula=formula, rows=rows,
                        grads=grads, shape=shape or "x".join(str(s) for s in args[0].shape)))

    # row slicers: sl -> args restricted to packed rows sl (a slice), for the rows_equal check
    sl_b1 = lambda sl: lambda a: (a[0][:, sl].contiguous(), *a[1:])  # noqa: E731
    case("rms_norm", "rms_norm", (x_h, w_h, 1e-5), lambda a: rms_norm.reference(*a), 4 * m * hid + 2 * hid,
         "2*(M*D read + M*D write) bf16", sl_b1, grads=(0, 1))
    case("qk_norm", "rms_norm", (x_qk, w_qk, 1e-5), lambda a: rms_norm.reference(*a), 4 * m * heads * hd,
         "2*(M*H*D read + write) bf16", sl_b1, grads=(0, 1))

    def sl_index(sl):
        return lambda a: (a[0][:, sl].contiguous(), a[1], a[2], a[3][sl].contiguous())

    case("modulate", "modulate", (x_h, tables[1], tables[0], index), lambda a: modulate.reference_modulate(*a),
         4 * m * hid + 8 * m, "2*(M*D read + M*D write) + 8*M index", sl_index, grads=(0, 1, 2))
    # the fused AdaLN pre-norm; `chain` is the two strict kernels apart, whose bytes the fused kernel must give
    case("norm_modulate", "norm_modulate", (x_h, w_h, 1e-5, tables[1], tables[0], index),
         lambda a: norm_modulate.reference(*a), 4 * m * hid + 2 * hid + 8 * m,
         "2*(M*D read + M*D write) + 8*M index (fused: the normalised rows never reach memory)",
         lambda sl: lambda a: (a[0][:, sl].contiguous(), *a[1:5], a[5][sl].contiguous()), grads=(0, 1, 3, 4))
    out[-1]["chain"] = lambda x, w, eps, sc, sh, i: modulate.modulate(rms_norm.rms_norm(x, w, eps), sc, sh, i)
    y_h = rnd(1, m, hid)
    case("gated_residual", "gated_residual", (x_h, tables[2], index, y_h),
         lambda a: modulate.reference_gated_residual(*a), 6 * m * hid + 8 * m, "2*3*M*D + 8*M",
         lambda sl: lambda a: (a[0][:, sl].contiguous(), a[1], a[2][sl].contiguous(), a[3][:, sl].contiguous()),
         grads=(0, 1, 3))
    case("add", "add", (x_h, y_h), lambda a: elementwise.reference_add(*a), 6 * m * hid, "2*3*M*D",
         lambda sl: lambda a: (a[0][:, sl].contiguous(), a[1][:, sl].contiguous()), grads=(0, 1))
    case("swiglu", "swiglu", (rnd(1, m, 2 * ffn),), lambda a: elementwise.reference_swiglu(*a), 2 * m * 3 * ffn,
         "2*(M*2F read + M*F write)", sl_b1, grads=(0,))
    case("silu_temb", "silu", (rnd(TIMESTEPS, hid, dtype=torch.float32),), lambda a: elementwise.reference_silu(*a),
         8 * TIMESTEPS * hid, "4*2*T*D float32 (the real call: launch-bound)", None)
    case("silu_wide", "silu", (rnd(1, m, ffn),), lambda a: elementwise.reference_silu(*a), 4 * m * ffn,
         "2*2*M*F bf16 (bandwidth probe)", sl_b1, grads=(0,))
    case("rope", "rope", (x_qk, cos, sin), lambda a: rope.reference_rope(*a), 4 * m * heads * hd + 8 * m * rot,
         "2*2*M*H*D + 2*4*M*R tables",
         lambda sl: lambda a: (a[0][:, sl].contiguous(), a[1][sl].contiguous(), a[2][sl].contiguous()), grads=(0,))
    case("rope_table", "rope_table", (pos, inv_freq), lambda a: rope.reference_rope_table(*a, dtype=torch.float64),
         24 * m + 8 * m * rot, "8*3*M positions + 2*4*M*R", lambda sl: lambda a: (a[0][sl].contiguous(), a[1]),
         shape=f"{m}x3")
    case("timestep_embedding", "timestep_embedding", (t, fdim), lambda a: timestep.reference(*a),
         4 * TIMESTEPS + 4 * TIMESTEPS * fdim, "4*T + 4*T*dim (launch-bound)", None, shape=f"{TIMESTEPS}x{fdim}")
    parts = ((ti, rnd(1, nt, hid)), (vi, rnd(1, nv, hid, dtype=torch.float32)), (ai, rnd(1, na, hid, dtype=torch.float32)))
    case("pack_rows", "pack_rows", (m, *parts), lambda a: packing.reference_pack_rows(*a),
         2 * nt * hid + 4 * (nv + na) * hid + 2 * m * hid, "2*Nt*D + 4*(Nv+Na)*D + 2*M*D", None,
         shape=f"{m}x{hid}", grads=())
    head_out = rnd(1, m, 96, dtype=torch.float32)
    case("select_rows", "select_rows", (head_out, vi), lambda a: packing.reference_select_rows(*a), 8 * nv * 96,
         "2*4*Nv*96 float32", None, grads=(0,))
    return out


# ------------------------------------------------------------------------------------------------- the fusions
FUSION_ROWS = (2066, 37853)
FUSION_DRY_ROWS = (3, 67)


def fusion_bytes(dims: dict) -> dict:
    """Bytes moved per packed row by each fusion and by its unfused sequence (bf16 activations): name -> (fused,
    unfused, formula). E = H*D elements of q (and of k), T = 2*R*4 bytes of the float32 cos / sin rows."""
    e, h, d = dims["HEADS"] * dims["HEAD_DIM"], dims["HEADS"], dims["HIDDEN"]
    t = 2 * dims["ROTARY"] * 4
    return {
        "qk_norm_rope": (2 * (4 * e + t), 2 * (8 * e + 4 * h + t),
                         "fused 2*(2E read + 2E write + T); unfused 2*((2E + 2E + 4H rstd) + (2E + T + 2E))"),
        "residual_norm_modulate": (8 * d + 8, 10 * d + 20,
                                   "fused 2D+2D read, 2D+2D write, 8 index; unfused (6D + 8) + (4D + 4 rstd + 8)"),
    }


def fusion_cases(m: int, device: str, dims: dict) -> list[dict]:
    """Per fusion: its inputs, the fused strict call, the unfused strict sequence, the torch composition and a row
    slicer (packed rows `sl` of every per-row input) for rows_equal."""
    import torch

    from h3kernels import modulate, norm_modulate, qk_norm_rope, residual_norm_modulate, rms_norm, rope
    from h3lab.execution import runtime

    hid, heads, hd, rot = (dims[k] for k in ("HIDDEN", "HEADS", "HEAD_DIM", "ROTARY"))
    gen = torch.Generator(device=device).manual_seed(m)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(torch.bfloat16)

    f_rope = rot // 6
    pos = torch.stack([torch.randint(0, n, (m,), device=device, generator=gen) for n in (14, 27, 45)], dim=-1)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 2 * f_rope, 2, dtype=torch.float32, device=device) / (2 * f_rope)))
    cos, sin = runtime.rope_table(pos, inv_freq)
    q, k, wq, wk = rnd(1, m, heads, hd), rnd(1, m, heads, hd, scale=3.0), rnd(hd, scale=0.1) + 1, rnd(hd, scale=0.1) + 1
    res, y, w = rnd(1, m, hid, scale=2.0), rnd(1, m, hid), rnd(hid, scale=0.1) + 1
    index = torch.randint(0, 3 * TIMESTEPS, (m,), device=device, generator=gen)
    _, gate, _, shift, scale, _ = rnd(3 * TIMESTEPS, 6 * hid, scale=0.3).chunk(6, dim=-1)  # [.. gate_msa, shift_mlp, scale_mlp ..]

    def unfused_qk(q, k, wq, wk, eps, cos, sin):
        return rope.rope(rms_norm.rms_norm(q, wq, eps), cos, sin), rope.rope(rms_norm.rms_norm(k, wk, eps), cos, sin)

    def unfused_residual(res, gate, index, y, w, eps, scale, shift):
        stream = modulate.gated_residual(res, gate, index, y)
        return stream, norm_modulate.norm_modulate(stream, w, eps, scale, shift, index)

    rows = lambda t, sl: t[:, sl].contiguous()  # noqa: E731
    return [
        dict(name="qk_norm_rope", fused=qk_norm_rope.qk_norm_rope, unfused=unfused_qk,
             args=(q, k, wq, wk, 1e-6, cos, sin), grads=(0, 1, 2, 3), shape=f"1x{m}x{heads}x{hd}",
             rows=lambda a, sl: (rows(a[0], sl), rows(a[1], sl), *a[2:5], a[5][sl].contiguous(), a[6][sl].contiguous())),
        dict(name="residual_norm_modulate", fused=residual_norm_modulate.residual_norm_modulate,
             unfused=unfused_residual, args=(res, gate, index, y, w, 1e-5, scale, shift), grads=(0, 1, 3, 4, 6, 7),
             shape=f"1x{m}x{hid}", rows=lambda a, sl: (rows(a[0], sl), a[1], a[2][sl].contiguous(), rows(a[3], sl),
                                                       *a[4:])),
    ]


def run_fusion(c: dict, m: int, device: str, dims: dict, backward: bool) -> list[dict]:
    """Fused vs unfused strict (and the torch composition) on one case: timings, bytes per row, byte checks."""
    import torch

    from h3kernels import registry
    from h3lab.execution import runtime

    args, name = c["args"], c["name"]
    info = registry.STRICT_OPS[name].check(*args)
    fused_b, unfused_b, formula = fusion_bytes(dims)[name]
    yf, yu = c["fused"](*args), c["unfused"](*args)
    out = []
    for impl, variant, fn, nbytes in (("h3lab-strict", "fused", c["fused"], fused_b),
                                      ("h3lab-strict", "unfused", c["unfused"], unfused_b),
                                      ("h3lab-off", "torch", runtime.REFERENCE_OPS[name], unfused_b)):
        row = {"shape": c["shape"], "rows": m, "impl": impl, "op": name, "case": f"fusion:{name}", "variant": variant,
               "pass": "forward", "bytes_per_row": nbytes, "bytes_moved": nbytes * m, "bytes_formula": formula,
               **measure(lambda fn=fn: fn(*args), device), "gpu_s": measure_gpu(lambda fn=fn: fn(*args), device)}
        row["gb_s"] = row["bytes_moved"] / (row["gpu_s"] or row["median_s"]) / 1e9
        out.append(row)
    fused = out[0]
    fused.update(kernel_id=info["kernel_id"], tile=info["tile"], acc_dtype=info["acc_dtype"],
                 fused_equal_unfused=equal(yf, yu), repeat_equal=equal(c["fused"](*args), yf))
    ok = True
    for sl in (slice(0, 1), slice(0, m // 2 + 1), slice(min(7, m - 1), m)):
        part = c["fused"](*c["rows"](args, sl))
        ok &= all(torch.equal(p, f[:, sl]) for p, f in zip(flat(part), flat(yf)))
    fused["rows_equal"] = bool(ok)
    _ratios(out[:2])
    if backward:
        bwd = []
        for variant, fn in (("fused", c["fused"]), ("unfused", c["unfused"])):
            leaves = [a.detach().clone().requires_grad_() if i in c["grads"] else a for i, a in enumerate(args)]
            ys = flat(fn(*leaves))
            dys = [torch.randn(t.shape, device=device, generator=torch.Generator(device).manual_seed(i)).to(t.dtype)
                   for i, t in enumerate(ys)]
            wrt = [leaves[i] for i in c["grads"]]
            grads = lambda ys=ys, dys=dys, wrt=wrt: torch.autograd.grad(ys, wrt, dys, retain_graph=True)  # noqa: E731
            row = {"shape": c["shape"], "rows": m, "impl": "h3lab-strict", "op": name, "case": f"fusion:{name}",
                   "variant": variant, "pass": "backward", **measure(grads, device), "gpu_s": measure_gpu(grads, device)}
            row["grads"] = grads()
            bwd.append(row)
        bwd[0]["grads_equal_unfused"] = equal(bwd[0]["grads"], bwd[1]["grads"])
        bwd[0]["note"] = "the fused backward recomputes the unfused chain's forward, then its backward"
        _ratios(bwd)
        for row in bwd:
            del row["grads"]
        out += bwd
    return out


def fusions_main(args, device: str, dims: dict, doc: dict) -> None:
    import torch

    for m in FUSION_DRY_ROWS if args.dry_run else FUSION_ROWS:
        for c in fusion_cases(m, device, dims):
            rows = run_fusion(c, m, device, dims, backward=not args.no_backward)
            doc["results"] += rows
            f, u, t = rows[:3]
            us = lambda r: (r["gpu_s"] or r["median_s"]) * 1e6  # noqa: E731
            saved = 1 - f["bytes_per_row"] / u["bytes_per_row"]
            bwd = f" | bwd x{rows[3]['ratio']:.2f}" if len(rows) > 3 else ""
            print(f"{m:>6} {c['name']:<23} fused {us(f):9.1f} us {f['gb_s']:7.1f} GB/s | unfused {us(u):9.1f} us "
                  f"{u['gb_s']:7.1f} GB/s | torch {us(t):9.1f} us | x{f['ratio']:.2f} | bytes/row {f['bytes_per_row']} "
                  f"vs {u['bytes_per_row']} (-{saved:.0%}) | equal={f['fused_equal_unfused']} "
                  f"rows={f['rows_equal']} repeat={f['repeat_equal']}{bwd}", flush=True)
            del c, rows
            if device == "cuda":
                torch.cuda.empty_cache()


def _ratios(pair: list[dict]) -> None:
    """strict / torch: `ratio` on device time (graph replay) where both have it, `ratio_eager` as called."""
    s, t = pair
    s["ratio_eager"] = s["median_s"] / t["median_s"]
    s["ratio"] = s["gpu_s"] / t["gpu_s"] if s["gpu_s"] and t["gpu_s"] else s["ratio_eager"]


def run_case(c: dict, m: int, device: str, backward: bool) -> list[dict]:
    import torch

    from h3kernels import registry
    from h3lab.execution import runtime

    strict, ref = registry.STRICT_OPS[c["op"]], runtime.REFERENCE_OPS[c["op"]]
    args = c["args"]
    info = strict.check(*args)
    truth = c["truth"](args)
    ys, yr = strict.run(*args), ref(*args)
    rows = []
    for impl, fn, y in (("h3lab-strict", strict.run, ys), ("h3lab-off", ref, yr)):
        row = {"shape": c["shape"], "rows": m, "impl": impl, "op": c["op"], "case": c["name"], "pass": "forward",
               "bytes_moved": c["bytes"], "bytes_formula": c["formula"], "rel_l2_vs_fp32": rel_l2(y, truth),
               **measure(lambda fn=fn: fn(*args), device), "gpu_s": measure_gpu(lambda fn=fn: fn(*args), device)}
        row["gb_s"] = c["bytes"] / (row["gpu_s"] or row["median_s"]) / 1e9
        if impl == "h3lab-strict":
            row.update(kernel_id=info["kernel_id"], tile=info["tile"], acc_dtype=info["acc_dtype"])
            row["ref_equal"] = equal(ys, yr)
            if "chain" in c:
                row["unfused_strict_equal"] = equal(ys, c["chain"](*args))
                row["unfused_strict_gpu_s"] = measure_gpu(lambda: c["chain"](*args), device)
            row["repeat_equal"] = equal(strict.run(*args), ys)
            if c["rows"] is not None:
                # first row alone, first half, and rows 7.. (shifts every row's position inside its tile)
                ok = True
                for sl in (slice(0, 1), slice(0, m // 2 + 1), slice(min(7, m - 1), m)):
                    part = strict.run(*c["rows"](sl)(args))
                    ok &= all(torch.equal(p, (f[:, sl] if f.dim() > 2 else f[sl])) for p, f in zip(flat(part), flat(ys)))
                row["rows_equal"] = bool(ok)
        rows.append(row)
    _ratios(rows)
    if backward and c["grads"]:
        bwd = []
        for impl, fn in (("h3lab-strict", strict.run), ("h3lab-off", ref)):
            leaves = [a.detach().clone().requires_grad_() if i in c["grads"] else a for i, a in enumerate(args)]
            y = fn(*leaves)
            dy = torch.randn_like(y)
            wrt = [leaves[i] for i in c["grads"]]
            grads = lambda y=y, dy=dy, wrt=wrt: torch.autograd.grad(y, wrt, dy, retain_graph=True)  # noqa: E731
            g1, g2 = grads(), grads()
            row = {"shape": c["shape"], "rows": m, "impl": impl, "op": c["op"], "case": c["name"], "pass": "backward",
                   "bwd_repeat_equal": equal(g1, g2), **measure(grads, device), "gpu_s": measure_gpu(grads, device)}
            if impl == "h3lab-strict" and "chain" in c:
                chain_leaves = [a.detach().clone().requires_grad_() if i in c["grads"] else a for i, a in enumerate(args)]
                yc = c["chain"](*chain_leaves)
                gc = torch.autograd.grad(yc, [chain_leaves[i] for i in c["grads"]], dy)
                row["unfused_strict_grads_equal"] = equal(g1, gc)
                del yc, gc
            bwd.append(row)
            del y, g1, g2
        _ratios(bwd)
        rows += bwd
    return rows


def ptx_audit() -> dict:
    """kernel name -> counts of approximate / contracted instructions in every compiled variant (CUDA only)."""
    from h3kernels import (elementwise, modulate, norm_modulate, packing, qk_norm_rope, residual_norm_modulate,
                           rms_norm, rope, timestep)

    pat = {"approx": r"\.approx", "div_full": r"div\.full", "fma": r"\bfma\.", "ex2": r"\bex2\."}
    out = {}
    for mod in (rms_norm, modulate, norm_modulate, rope, elementwise, timestep, packing, qk_norm_rope,
                residual_norm_modulate):
        for name in dir(mod):
            fn = getattr(mod, name)
            caches = getattr(fn, "device_caches", None)
            if not name.startswith("_") or not name.endswith("_kernel") or caches is None:
                continue
            counts = {k: 0 for k in pat}
            variants = 0
            try:
                for entry in caches.values():
                    for kernel in entry[0].values():
                        ptx = kernel.asm.get("ptx", "")
                        variants += 1
                        for k, p in pat.items():
                            counts[k] += len(re.findall(p, ptx))
            except Exception as exc:  # provenance only: never fail the benchmark on a cache layout change
                counts = {"error": repr(exc)}
            out[f"{mod.__name__.split('.')[-1]}.{name}"] = {"variants": variants, **counts}
    return out


def sweep_rms_norm(device: str, dims: dict, rows_list) -> list[dict]:
    """Exploration only (the contract's tiles are constants): time other rms_norm tiles through the same kernels."""
    import torch
    import torch.nn.functional as F

    from h3kernels import rms_norm as K

    contract = K._tile
    out = []
    for m in rows_list:
        for shape in ((1, m, dims["HIDDEN"]), (1, m, dims["HEADS"], dims["HEAD_DIM"])):
            d = shape[-1]
            x = torch.randn(shape, device=device).bfloat16().requires_grad_()
            w = (1 + 0.1 * torch.randn(d, device=device)).bfloat16().requires_grad_()
            dy = torch.randn_like(x)
            yr = F.rms_norm(x, (d,), w, 1e-5)
            def timed(fn):
                return measure_gpu(fn, device) or measure(fn, device)["median_s"]

            ref_f = timed(lambda: F.rms_norm(x, (d,), w, 1e-5))
            ref_b = timed(lambda: torch.autograd.grad(yr, (x, w), dy, retain_graph=True))
            base = contract(d)
            for rows in (1, 2, 4) if base["ROWS"] == 1 else (16, 32, 64):
                for warps in (4, 8, 16) if base["ROWS"] == 1 else (4, 8):
                    for tiles in (8, 16):
                        cfg = dict(BLOCK_D=base["BLOCK_D"], ROWS=rows, TILES=tiles, CHUNK=tiles * rows, num_warps=warps)
                        K._tile = lambda _d, cfg=cfg: cfg
                        try:
                            f = timed(lambda: K.rms_norm(x, w, 1e-5))
                            y = K.rms_norm(x, w, 1e-5)
                            b = timed(lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True))
                        finally:
                            K._tile = contract
                        row = {"shape": "x".join(map(str, shape)), "rows": m, "ROWS": rows, "num_warps": warps,
                               "TILES": tiles, "contract": cfg == {**base}, "fwd_ratio": f / ref_f, "bwd_ratio": b / ref_b}
                        print(f"sweep rms_norm {row['shape']:<16} ROWS={rows:>2} warps={warps:>2} TILES={tiles:>2} "
                              f"fwd x{row['fwd_ratio']:.2f} bwd x{row['bwd_ratio']:.2f}{'  <- contract' if row['contract'] else ''}",
                              flush=True)
                        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = kernel_parser(__doc__, "elementwise", sweep_help="also time other rms_norm tiles (exploration only)")
    parser.add_argument("--only", default=None, help="comma-separated case names")
    parser.add_argument("--fusions", action="store_true",
                        help="time each epilogue fusion against its unfused strict sequence (FUSION_ROWS) instead")
    args = parser.parse_args(argv)
    device = prepare(parser, cpu=args.dry_run, flag="--dry-run")
    import torch

    dims = DRY if args.dry_run else dict(HIDDEN=HIDDEN, HEADS=HEADS, HEAD_DIM=HEAD_DIM, ROTARY=ROTARY, FFN=FFN,
                                         FREQ_DIM=FREQ_DIM)
    doc = header("fusions" if args.fusions else "elementwise", __file__, argv, device)
    if args.fusions:
        fusions_main(args, device, dims, doc)
        if device == "cuda":
            doc["ptx"] = ptx_audit()
        write(args.out, doc)
        return 0
    only = set(args.only.split(",")) if args.only else None
    for m in DRY_ROWS if args.dry_run else ROWS:
        for c in cases(m, device, dims):
            if only and c["name"] not in only:
                continue
            rows = run_case(c, m, device, backward=not args.no_backward)
            doc["results"] += rows
            s, t = rows[0], rows[1]
            checks = " ".join(f"{k}={s[k]}" for k in ("ref_equal", "rows_equal", "repeat_equal", "unfused_strict_equal")
                              if k in s)
            bwd = next((r for r in rows if r["pass"] == "backward" and r["impl"] == "h3lab-strict"), None)
            btxt = f" | bwd x{bwd['ratio']:.2f} det={bwd['bwd_repeat_equal']}" if bwd else ""
            us = lambda r: (r["gpu_s"] or r["median_s"]) * 1e6  # noqa: E731
            print(f"{m:>5} {c['name']:<19} strict {us(s):8.1f} us {s['gb_s']:7.1f} GB/s | torch {us(t):8.1f} us "
                  f"{t['gb_s']:7.1f} GB/s | x{s['ratio']:.2f} (eager x{s['ratio_eager']:.2f}) | err "
                  f"{s['rel_l2_vs_fp32']:.1e}/{t['rel_l2_vs_fp32']:.1e} | {checks}{btxt}", flush=True)
            del c
            if device == "cuda":
                torch.cuda.empty_cache()
    if args.sweep:
        doc["sweep_rms_norm"] = sweep_rms_norm(device, dims, DRY_ROWS if args.dry_run else ROWS)
    if device == "cuda":
        doc["ptx"] = ptx_audit()
        for k, v in doc["ptx"].items():
            print(f"ptx {k}: {v}")
    write(args.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
