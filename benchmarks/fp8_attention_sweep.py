"""FP8 attention (kernels/fp8_attention.py) against cuDNN bf16 SDPA, and where one fast forward spends its GPU time.

Sections (each recorded, or its error, in one JSON; the file is rewritten after each):
1. `attention`: at 2,066 / 7,272 / 37,853 rows (56 heads x 128, batch 1, H3's (B, S, H, D) layout): cuDNN bf16 SDPA
   (the call fast makes) and `attention_fp8` at each launch config of --configs (median ms of do_bench, TFLOP/s of
   4*S*S*H*D), the K/V quantisation passes alone, relative L2 of the FP8 output against float32 SDPA (2,066 rows)
   and against cuDNN bf16, every output element written (poisoned NaN buffers checked by isfinite).
2. `qkv_concat`: three FP8 q/k/v projections (torch._scaled_mm, 5,376 -> 7,168 each) against one on the
   concatenated weight (5,376 -> 21,504), at 2,066 and 7,272 rows.
3. `profile`: torch.profiler kernel time of one forward of a --blocks-block, full-width model (Diffusers, fast
   eager with cuDNN attention, fast eager with FP8 attention) at 2,066 and 7,272 rows: per op class and the top
   kernels.
`--dry-run` runs the sections on tiny shapes on the CPU (the interpreter; no profile) as a smoke test.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
import traceback

import torch

from _common import header, prepare, rel_l2, write

CLASSES = (  # op class of a kernel name, first match wins
    ("attention_fp8", r"_attention_fp8_kernel"),
    ("kv_quant", r"_quantize_blocks_kernel"),
    ("attention_bf16", r"cudnn|flash|fmha|sdpa|attention|generated_kernel|sm90_flash"),
    ("gemm_fp8", r"e4m3|f8|fp8.*gemm|scaled_mm|cutlass.*rowwise|f8f8"),
    ("gemm_bf16", r"gemm|cutlass|nvjet|xmma|sm90_xmma|ampere|cublas|Kernel2"),
    ("row_quant", r"_quantize_rows_kernel"),
    ("fused_producers", r"_norm_modulate_quant_kernel|_swiglu_quant_kernel"),
    ("triton_other", r"^_|triton"),
    ("copy_cat_index", r"copy|cat|index|gather|scatter|Memcpy|Memset|fill"),
    ("elementwise_reduce", r"elementwise|reduce|norm|vectorized|unrolled"),
)


def op_class(name: str) -> str:
    for cls, pattern in CLASSES:
        if re.search(pattern, name, re.IGNORECASE):
            return cls
    return "other"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--rows", default="2066,7272,37853")
    ap.add_argument("--configs", default="128,128,8,3;128,128,8,2;128,64,8,3;128,64,4,3;64,128,4,3;128,128,4,3",
                    help="BLOCK_M,BLOCK_N,num_warps,num_stages;...")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--sections", default="attention,qkv_concat,profile")
    args = ap.parse_args(argv)
    device = prepare(ap, cpu=args.dry_run, flag="--dry-run")
    from h3kernels.fp8_attention import attention_fp8, quantize_blocks

    heads, dim = (2, 128) if args.dry_run else (56, 128)
    rows_list = [40, 77] if args.dry_run else [int(r) for r in args.rows.split(",")]
    configs = [dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), map(int, c.split(","))))
               for c in args.configs.split(";")]
    doc = header("fp8_attention_sweep" if not args.dry_run else "fp8_attention_sweep_dry_run", __file__, argv, device,
                 sections={})
    sections = args.sections.split(",")

    def bench(fn) -> float:
        if device != "cuda":
            start = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - start)
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))

    def section(name):
        def wrap(fn):
            if name not in sections:
                return
            start = time.time()
            try:
                doc["sections"][name] = fn()
            except Exception as exc:  # noqa: BLE001 - a failed section is a result; the others still run
                doc["sections"][name] = {"error": f"{type(exc).__name__}: {exc}",
                                         "traceback": traceback.format_exc()[-3000:]}
                print(f"section {name} FAILED: {exc}", flush=True)
            doc["sections"][name]["wall_s"] = time.time() - start
            write(args.out, doc)
        return wrap

    def sdpa_bf16(q, k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION] \
            if device == "cuda" else [SDPBackend.MATH]
        with sdpa_kernel(backends, set_priority=True) if device == "cuda" else sdpa_kernel(backends):
            return torch.nn.functional.scaled_dot_product_attention(
                q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)).permute(0, 2, 1, 3)

    @section("attention")
    def _attention():
        out = []
        gen = torch.Generator(device=device).manual_seed(3)
        for rows in rows_list:
            # q/k as the QK-norm leaves them (unit RMS per head, times a norm weight), v a projection output
            q, k, v = (torch.randn(1, rows, heads, dim, generator=gen, device=device) * s
                       for s in (1.0, 1.0, 0.5))
            q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
            flops = 4.0 * rows * rows * heads * dim
            ref = sdpa_bf16(q, k, v)
            entry = {"rows": rows, "heads": heads, "head_dim": dim, "flops": flops}
            entry["cudnn_bf16_ms"] = bench(lambda: sdpa_bf16(q, k, v))
            entry["cudnn_bf16_tflops"] = flops / entry["cudnn_bf16_ms"] / 1e9
            if rows <= 2066 or device != "cuda":
                truth = torch.nn.functional.scaled_dot_product_attention(
                    *(t.float().permute(0, 2, 1, 3) for t in (q, k, v))).permute(0, 2, 1, 3)
                entry["cudnn_bf16_rel_l2_vs_fp32"] = rel_l2(ref, truth)
            else:
                truth = None
            entry["configs"] = []
            for cfg in configs:
                c = {**cfg}
                try:
                    o = attention_fp8(q, k, v, config=cfg)
                    c["all_finite"] = bool(torch.isfinite(o.float()).all())
                    c["rel_l2_vs_cudnn_bf16"] = rel_l2(o, ref)
                    if truth is not None:
                        c["rel_l2_vs_fp32"] = rel_l2(o, truth)
                    c["ms"] = bench(lambda cfg=cfg: attention_fp8(q, k, v, config=cfg))
                    c["tflops"] = flops / c["ms"] / 1e9
                    c["quant_kv_ms"] = bench(lambda cfg=cfg: (quantize_blocks(k, cfg["BLOCK_N"], False),
                                                              quantize_blocks(v, cfg["BLOCK_N"], True)))
                    c["speedup_vs_cudnn"] = entry["cudnn_bf16_ms"] / c["ms"]
                except Exception as exc:  # noqa: BLE001 - a config that fails to compile is a result
                    c["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                entry["configs"].append(c)
                print(rows, c, flush=True)
            print(f"rows {rows}: cuDNN bf16 {entry['cudnn_bf16_ms']:.2f} ms", flush=True)
            out.append(entry)
            del q, k, v, ref, truth
        return {"results": out}

    @section("qkv_concat")
    def _qkv():
        if device != "cuda":
            return {"skipped": "torch._scaled_mm needs CUDA"}
        from h3lab.execution import fast

        out = []
        gen = torch.Generator(device=device).manual_seed(4)
        ws = [(torch.randn(7168, 5376, generator=gen, device=device) * 5376 ** -0.5).to(torch.bfloat16)
              for _ in range(3)]
        qw = [fast.quantize_rows_reference(w) for w in ws]
        wcat = torch.cat([q for q, _ in qw]), torch.cat([s for _, s in qw]).reshape(1, -1)
        for rows in (2066, 7272):
            x = torch.randn(rows, 5376, generator=gen, device=device).to(torch.bfloat16)
            qx, sx = fast.quantize_rows_reference(x)

            def three():
                return [torch._scaled_mm(qx, q.t(), scale_a=sx, scale_b=s.reshape(1, -1), out_dtype=torch.bfloat16)
                        for q, s in qw]

            def one():
                return torch._scaled_mm(qx, wcat[0].t(), scale_a=sx, scale_b=wcat[1], out_dtype=torch.bfloat16)
            e = {"rows": rows, "three_ms": bench(three), "one_concat_ms": bench(one)}
            e["flops"] = 2.0 * rows * 5376 * 3 * 7168
            e["three_tflops"], e["one_tflops"] = e["flops"] / e["three_ms"] / 1e9, e["flops"] / e["one_concat_ms"] / 1e9
            out.append(e)
            print(e, flush=True)
        return {"results": out}

    @section("profile")
    def _profile():
        if device != "cuda":
            return {"skipped": "the profile needs CUDA"}
        from torch.profiler import ProfilerActivity, profile

        from benchmark_forward import build_diffusers, build_h3lab_shared, make_inputs
        from h3lab.execution import fast, graphs, runtime
        from h3lab.config import H3Config

        cfg = H3Config(**{**H3Config.full().to_diffusers(), "num_layers": args.blocks})
        dm = build_diffusers(cfg, device, seed=1234)
        hm = build_h3lab_shared(cfg, dm, device)
        fast.prepare(hm)
        out = []
        for shape in ("512x512x22f", "864x480x56f"):
            layout, inputs = make_inputs(cfg, shape, 1, device, seed=7)
            runs = {
                "diffusers": lambda: dm(**inputs, return_dict=False),
                "fast-eager-cudnn": lambda: _fast(hm, inputs, "off"),
                "fast-eager-fp8attn": lambda: _fast(hm, inputs, "on"),
            }

            def _fast(model, inputs, attn):
                with runtime.use_mode("fast"), graphs.use_graphs("fast", False), fast.use_fp8_attention(attn):
                    return model(**inputs)
            for impl, fn in runs.items():
                with torch.no_grad():
                    fn()
                    torch.cuda.synchronize()
                    times = []
                    for _ in range(3):
                        s = time.perf_counter()
                        fn()
                        torch.cuda.synchronize()
                        times.append(time.perf_counter() - s)
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        fn()
                        torch.cuda.synchronize()
                kernels = {}
                for e in prof.key_averages():
                    t = getattr(e, "self_device_time_total", None)
                    t = e.self_cuda_time_total if t is None else t
                    if t > 0:
                        kernels[e.key] = (kernels.get(e.key, (0, 0))[0] + t, kernels.get(e.key, (0, 0))[1] + e.count)
                classes = {}
                for name, (t, n) in kernels.items():
                    c = classes.setdefault(op_class(name), {"us": 0.0, "launches": 0})
                    c["us"] += t
                    c["launches"] += n
                top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]
                entry = {"shape": shape, "rows": layout.sequence_length, "impl": impl, "blocks": args.blocks,
                         "wall_median_s": statistics.median(times), "kernel_us_total": sum(t for t, _ in kernels.values()),
                         "classes": classes, "top": [{"kernel": k[:160], "us": t, "count": n} for k, (t, n) in top]}
                out.append(entry)
                print(shape, impl, f"wall {entry['wall_median_s'] * 1e3:.1f} ms kernels {entry['kernel_us_total'] / 1e3:.1f} ms",
                      {k: round(v["us"] / 1e3, 2) for k, v in sorted(classes.items(), key=lambda kv: -kv[1]["us"])},
                      flush=True)
        return {"results": out}

    doc["results"] = []
    for sec in ("attention",):
        for e in (doc["sections"].get(sec) or {}).get("results", []):
            best = min((c for c in e["configs"] if "ms" in c), key=lambda c: c["ms"], default=None)
            doc["results"].append({"shape": f"attention {e['rows']}x{e['heads']}x{e['head_dim']}", "rows": e["rows"],
                                   "impl": "fp8_attention_best", "median_s": best["ms"] / 1e3 if best else None,
                                   "runs": 1, "peak_mem_gib": None, "best_config": best})
    write(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
