"""Whole-transformer forward: h3lab (`off`, `strict`) against Diffusers' `MiniMaxH3Transformer3DModel`, in one
process, on the full-size config with random weights (no weights can be downloaded).

The Diffusers model is materialised on the GPU with seeded random weights in the released dtypes (bfloat16, the
FP32_MODULES in float32); `H3Transformer` is then built on the meta device and *assigned the same parameter
tensors* (shared storage, so both fit on one 139 GiB H200). For each shape (t2va layouts built by `h3lab.run.layout`):

- `diffusers` and `h3lab-off` forwards: velocities compared byte for byte, medians of CUDA-event timings, peak memory;
- `h3lab-strict`: timing, the ratio to Diffusers measured in the same run, byte-equality of velocities for batch
  1 vs 2 vs 4 (every batch item) and for a consistent row permutation of the packed layout (outputs unchanged);
  Diffusers' own batch-1 vs batch-2 difference for contrast;
- accuracy (`--accuracy-layers N`): a truncated N-block model run in float32 (TF32 off) as the truth; relative L2 of
  Diffusers bf16 and of h3lab strict against it.

Writes one JSON (schema of DESIGN.md "Evidence") to --out. `--tiny` runs everything on H3Config.tiny() on the CPU
(strict through TRITON_INTERPRET=1) as a smoke test of this script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from _common import header, kernel_profile, materialise, prepare, rel_l2, timed_interleaved, write

SHAPES = {
    # name: (latent frames, latent h, latent w, audio latents per channel, text rows) -> rows
    "512x512x22f": (7, 32, 32, 37, 200),  # 1792 video + 74 audio + 200 text = 2066
    "864x480x56f": (17, 30, 54, 93, 201),  # 6885 + 186 + 201 = 7272
    # 1344x768 (t2va, 143 text rows, as the issue measured): 12 / 37 / 107 latent frames of 24x42 patches
    "1344x768x39f": (12, 48, 84, 65, 143),  # 12096 + 130 + 143 = 12369
    "1344x768x124f": (37, 48, 84, 207, 143),  # 37296 + 414 + 143 = 37853
    "1344x768x362f": (107, 48, 84, 603, 143),  # 107856 + 1206 + 143 = 109205 (15 s, the longest released clip)
    "tiny-64x64x22f": (7, 4, 4, 37, 12),
}


def output_sha256(video: torch.Tensor, audio: torch.Tensor) -> str:
    """SHA-256 over the dtype and bytes of both velocity tensors (host copies), video first."""
    import hashlib

    h = hashlib.sha256()
    for t in (video, audio):
        t = t.detach().contiguous().cpu()
        h.update(str(t.dtype).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def init_random_(model: torch.nn.Module, seed: int) -> None:
    """Seeded, shape-aware random weights: linear weights N(0, 1/fan_in), biases N(0, 0.02), norm weights 1+N(0,0.1)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32).mul_(p.shape[1] ** -0.5))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32))


def build_diffusers(config, device, seed: int):
    """Diffusers' model with `init_random_(seed)` weights, allocated once in the released dtypes (`materialise`)."""
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**config.to_diffusers())
    model = materialise(model, device)
    model.rope.inv_freq = 1.0 / (
        config.rope_theta
        ** (torch.arange(0, 2 * config.rope_freq_dim, 2, dtype=torch.float32, device=device) / (2 * config.rope_freq_dim))
    )
    init_random_(model, seed)
    return model.eval()


def build_h3lab_shared(config, diffusers_model, device):
    from h3lab import H3Transformer

    with torch.device("meta"):
        model = H3Transformer(config)
    model.load_state_dict(diffusers_model.state_dict(), assign=True, strict=True)
    model.reset_buffers(device)
    return model.eval()


def make_inputs(config, shape: str, batch: int, device, seed: int):
    from h3lab.run.layout import build_layout

    frames, lh, lw, audio, text = SHAPES[shape]
    layout = build_layout("t2va", torch.ones(text, dtype=torch.int64), frames, lh, lw, audio)
    gen = torch.Generator().manual_seed(seed)
    nv, na = layout.video_indices.numel(), layout.audio_indices.numel()
    inputs = {
        "hidden_states": torch.randn(1, nv, config.video_patch_dim, generator=gen).expand(batch, -1, -1),
        "audio_hidden_states": torch.randn(1, na, config.audio_in_channels, generator=gen).expand(batch, -1, -1),
        "encoder_hidden_states": torch.randn(1, text, config.text_dim, generator=gen).to(torch.bfloat16).expand(batch, -1, -1),
    }
    # Make every batch item distinct: item b gets its own noise, item 0 is the batch-1 request.
    if batch > 1:
        for key in inputs:
            extra = torch.randn((batch - 1,) + inputs[key].shape[1:], generator=gen).to(inputs[key].dtype)
            inputs[key] = torch.cat([inputs[key][:1], extra], 0)
    unique_t, t_idx = layout.row_timesteps(0.3, 0.55)
    inputs = {k: v.contiguous().to(device) for k, v in inputs.items()}
    inputs.update(timestep=unique_t.to(device), timestep_indices=t_idx.to(device), **layout.model_inputs(device))
    return layout, inputs


def t2va_spec(config, shape: str, passes: int, mode: str, device, seed: int = 42):
    """A `RunSpec` of `passes` over the t2va layout of `shape`: random bf16 text rows, seeded float32 noise rows."""
    from h3lab.run.layout import build_layout
    from h3lab.run import DenoiseInputs, RunSpec
    from h3lab.run.sampler import DualSchedule

    frames, lh, lw, audio, text = SHAPES[shape]
    layout = build_layout("t2va", torch.ones(text, dtype=torch.int64), frames, lh, lw, audio)
    schedule = DualSchedule.from_passes(passes)
    gen = torch.Generator().manual_seed(seed)
    nv, na = layout.video_indices.numel(), layout.audio_indices.numel()
    inputs = DenoiseInputs.from_layout(
        layout, schedule,
        text=torch.randn(1, text, config.text_dim, generator=gen).to(torch.bfloat16),
        video=torch.randn(1, nv, config.video_patch_dim, generator=gen),
        audio=torch.randn(1, na, config.audio_in_channels, generator=gen),
        seeds={"noise": seed},
    ).to(device)
    return RunSpec(inputs, schedule, mode=mode, layout=layout)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="512x512x22f,864x480x56f")
    ap.add_argument("--impls", default="diffusers,h3lab-off,h3lab-strict")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--batches", default="1,2,4", help="batch sizes for the strict batch-invariance check")
    ap.add_argument("--accuracy-layers", type=int, default=4)
    ap.add_argument("--layers", type=int, default=None, help="override num_layers (default: the config's)")
    ap.add_argument("--profile", action="store_true",
                    help="also record each impl's GPU time per kernel family (torch.profiler, one forward per shape)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on H3Config.tiny()")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = prepare(ap, cpu=args.tiny, flag="--tiny")
    from h3lab.execution import runtime
    from h3lab.config import H3Config

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    config = H3Config.tiny() if args.tiny else H3Config.full()
    if args.layers is not None:
        config = H3Config(**{**config.to_diffusers(), "num_layers": args.layers})
    shapes = ["tiny-64x64x22f"] if args.tiny else args.shapes.split(",")
    impls = args.impls.split(",")
    batches = [int(b) for b in args.batches.split(",")]

    t0 = time.time()
    dm = build_diffusers(config, device, seed=1234)
    hm = build_h3lab_shared(config, dm, device)
    print(f"built models ({sum(p.numel() for p in dm.parameters())/1e9:.3f} B params) in {time.time()-t0:.1f}s", flush=True)

    results, checks = [], []

    def h3(mode, inputs):
        with runtime.use_mode(mode), torch.no_grad():
            return hm(**inputs)

    for shape in shapes:
        layout, inputs = make_inputs(config, shape, 1, device, seed=7)
        rows = layout.sequence_length
        with torch.no_grad():
            ref_v, ref_a = dm(**inputs, return_dict=False)
        base = {}
        fns = {}
        for impl in impls:
            if impl == "diffusers":
                fns[impl] = lambda: dm(**inputs, return_dict=False)  # noqa: E731
            else:
                mode = impl.split("-", 1)[1]
                try:
                    h3(mode, inputs)  # a strict failure is a result to record, not a crash of the benchmark
                except Exception as exc:
                    results.append({"shape": shape, "rows": rows, "impl": impl, "error": f"{type(exc).__name__}: {exc}"})
                    print(f"{shape} {impl}: FAILED {exc}", flush=True)
                    continue
                fns[impl] = lambda mode=mode: h3(mode, inputs)
        with torch.no_grad():
            measured = timed_interleaved(fns, args.runs, device)  # a, b, a, b, ...: clock drift hits all alike
        for impl, (times, peak) in measured.items():
            med = statistics.median(times)
            base[impl] = med
            entry = {"shape": shape, "rows": rows, "impl": impl, "median_s": med, "runs": len(times),
                     "times_s": times, "peak_mem_gib": peak, "layers": config.num_layers, "timing": "interleaved"}
            if impl != "diffusers" and "diffusers" in base:
                entry["ratio_vs_diffusers"] = med / base["diffusers"]
            v, a = ref_v, ref_a
            if impl != "diffusers":
                v, a = h3(impl.split("-", 1)[1], inputs)
            # Byte identity of the batch-1 velocities: comparable across runs and code revisions (same seeds).
            entry["output_sha256"] = output_sha256(v, a)
            if impl == "h3lab-off":
                entry["bytes_equal_diffusers"] = bool(torch.equal(v, ref_v) and torch.equal(a, ref_a))
            if impl == "h3lab-strict":
                entry["rel_l2_vs_diffusers_video"] = rel_l2(v, ref_v)
                entry["rel_l2_vs_diffusers_audio"] = rel_l2(a, ref_a)
                trace = runtime.last_trace()
                entry["trace_summary"] = trace.summary() if trace else None
            results.append(entry)
            print(f"{shape} rows={rows} {impl}: median {med*1e3:.2f} ms peak {peak:.1f} GiB "
                  + (f"ratio {entry.get('ratio_vs_diffusers', 1):.3f}" if impl != 'diffusers' else ''), flush=True)

        if args.profile and device == "cuda":
            for impl, fn in fns.items():
                checks.append({"shape": shape, "impl": impl, "check": "kernel_profile", "kernels": kernel_profile(fn)})
                print(f"{shape} {impl} top kernels: " + ", ".join(
                    f"{k['name'][:40]} {k['ms']:.1f} ms x{k['calls']}" for k in checks[-1]["kernels"][:6]), flush=True)

        # Batch invariance: every item of batch N equals the batch-1 forward of the same request.
        for impl in [i for i in impls if i in ("diffusers", "h3lab-strict") and i in base]:
            one = None
            for b in batches:
                _, inp_b = make_inputs(config, shape, b, device, seed=7)
                if impl == "diffusers":
                    with torch.no_grad():
                        vb, ab = dm(**inp_b, return_dict=False)
                else:
                    vb, ab = h3("strict", inp_b)
                if one is None:
                    one = (vb[:1].clone(), ab[:1].clone())
                    continue
                equal = bool(torch.equal(vb[:1], one[0]) and torch.equal(ab[:1], one[1]))
                maxdiff = float(max((vb[:1].float() - one[0].float()).abs().max(), (ab[:1].float() - one[1].float()).abs().max()))
                checks.append({"shape": shape, "impl": impl, "check": f"batch1_vs_batch{b}", "bytes_equal": equal,
                               "max_abs_diff": maxdiff})
                print(f"{shape} {impl} batch1 vs batch{b}: equal={equal} maxdiff={maxdiff:.3g}", flush=True)
        # Consistent permutation of the packed rows: selected outputs unchanged.
        if "h3lab-strict" in base:
            gen = torch.Generator().manual_seed(3)
            perm = torch.randperm(layout.sequence_length, generator=gen)
            playout = layout.permute(perm)
            pinputs = dict(inputs)
            unique_t, t_idx = playout.row_timesteps(0.3, 0.55)
            pinputs.update(timestep=unique_t.to(device), timestep_indices=t_idx.to(device), **playout.model_inputs(device),
                           key_order=playout.key_order().to(device))
            v0, a0 = h3("strict", inputs)
            v1, a1 = h3("strict", pinputs)
            equal = bool(torch.equal(v0, v1) and torch.equal(a0, a1))
            checks.append({"shape": shape, "impl": "h3lab-strict", "check": "consistent_row_permutation",
                           "bytes_equal": equal, "max_abs_diff": float((v0.float() - v1.float()).abs().max())})
            print(f"{shape} strict permutation: equal={equal}", flush=True)
            v2, a2 = h3("strict", inputs)
            checks.append({"shape": shape, "impl": "h3lab-strict", "check": "repeat", "bytes_equal": bool(torch.equal(v0, v2) and torch.equal(a0, a2))})

    # Accuracy against a float32 truth on a truncated model (first N blocks, shared weights upcast).
    if args.accuracy_layers and "h3lab-strict" in impls:
        from h3lab import H3Transformer

        n = min(args.accuracy_layers, config.num_layers)
        small = H3Config(**{**config.to_diffusers(), "num_layers": n})
        sd = {k: v for k, v in dm.state_dict().items()
              if not k.startswith("transformer_blocks.") or int(k.split(".")[1]) < n}
        from diffusers import MiniMaxH3Transformer3DModel

        # Every model below shares (or upcasts) the big model's first-n-block tensors: no second random init.
        with torch.device("meta"):
            dsmall = MiniMaxH3Transformer3DModel(**small.to_diffusers())
            hsmall = H3Transformer(small)
            href = H3Transformer(small, dtype_policy="float32")
        dsmall.load_state_dict(sd, strict=True, assign=True)
        dsmall.rope.inv_freq = dm.rope.inv_freq.clone()
        hsmall.load_state_dict(sd, strict=True, assign=True)
        hsmall.reset_buffers(device)
        href.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True, assign=True)
        href.reset_buffers(device)
        for shape in shapes:
            _, inputs = make_inputs(small, shape, 1, device, seed=11)
            with torch.no_grad(), runtime.use_mode("off"):
                tv, ta = href(**{**inputs, "encoder_hidden_states": inputs["encoder_hidden_states"].float()})
                dv, da = dsmall(**inputs, return_dict=False)
            with torch.no_grad(), runtime.use_mode("strict"):
                sv, sa = hsmall(**inputs)
            acc = {"shape": shape, "check": f"accuracy_{n}_layers_vs_float32",
                   "diffusers_rel_l2_video": rel_l2(dv, tv), "diffusers_rel_l2_audio": rel_l2(da, ta),
                   "strict_rel_l2_video": rel_l2(sv, tv), "strict_rel_l2_audio": rel_l2(sa, ta)}
            checks.append(acc)
            print(json.dumps(acc), flush=True)
        del dsmall, hsmall, href

    doc = header("forward_full" if not args.tiny else "forward_tiny_smoke", __file__, argv, device,
                 config={"num_layers": config.num_layers, "hidden_size": config.hidden_size,
                         "heads": config.num_attention_heads},
                 weights="random (seeded), shared storage between Diffusers and h3lab", checks=checks)
    doc["results"] = results
    write(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
