"""A whole `h3lab.Session` generation on the GPU with a full-size random-weight DiT: 512x512x22f, 20 steps, mode strict
and mode off -- phase timings, peak GPU memory per run and the sealed trajectory digest.

No 66 GB snapshot fits the device's disk, so the DiT is built in memory exactly as benchmark_forward.py builds it
(Diffusers model, seeded random weights in the released dtypes, `H3Transformer` sharing its tensors; the Diffusers
module is then dropped) and handed to the session with `Session.set_transformer`. The rest of the session -- Qwen3-VL
text encoder, video and audio VAEs, schedulers -- comes from the tiny snapshot's "interface" preset
(`make_tiny_snapshot(..., preset="interface")`: released interface widths 5120 / 24 / 32, tiny internals), written
to a temp folder. The text encoder and VAEs are therefore tiny: the timings are the DiT's plus the session's own
overhead, and the VAE decode phases are not the released decoders' cost.

Per mode, in `--modes` order, `--repeats` generations of the same request: the very first is cold (text encoding,
component loading), every later one hits the text cache (text_encode 0). No MP4 is written (nothing imports
imageio-ffmpeg on this path; the JSON records that). Peak memory is `torch.cuda.max_memory_allocated`, reset per
request by the session. Writes one JSON (schema of DESIGN.md "Evidence") to --out. `--tiny` runs the same code on
the CPU with the interface snapshot's own transformer config (`INTERFACE_CONFIG`, no 33B) at 64x64, 2 steps, as a
smoke test of this script.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import header, prepare, write
from benchmark_forward import build_diffusers, build_h3lab_shared

PROMPT = "a red fox runs through fresh snow at dawn, its paws crunching, wind in the pines"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=None, help="default 512 (--tiny: 64)")
    ap.add_argument("--height", type=int, default=None, help="default 512 (--tiny: 64)")
    ap.add_argument("--frames", type=int, default=22)
    ap.add_argument("--steps", type=int, default=None, help="default 20 (--tiny: 2)")
    ap.add_argument("--modes", default="strict,off")
    ap.add_argument("--repeats", type=int, default=2, help="generations per mode (the first is cold)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--layers", type=int, default=None, help="override the DiT's num_layers (default: the config's)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run with the interface snapshot's tiny DiT")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = prepare(ap, cpu=args.tiny, flag="--tiny")
    width = args.width or (64 if args.tiny else 512)
    height = args.height or (64 if args.tiny else 512)
    steps = args.steps or (2 if args.tiny else 20)

    from h3lab.checkpoint.tiny import INTERFACE_CONFIG, make_tiny_snapshot
    from h3lab.config import H3Config
    from h3lab.app.session import Session

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    config = INTERFACE_CONFIG if args.tiny else H3Config.full()
    if args.layers is not None:
        config = H3Config(**{**config.to_diffusers(), "num_layers": args.layers})

    t0 = time.perf_counter()
    dm = build_diffusers(config, device, seed=1234)
    model = build_h3lab_shared(config, dm, device)
    del dm  # the h3lab module holds the (shared) tensors; one copy of the weights stays
    gc.collect()
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    print(f"built DiT ({params / 1e9:.3f} B params) in {build_s:.1f}s", flush=True)

    results, checks = [], []
    with tempfile.TemporaryDirectory(prefix="h3lab-bench-session-") as tmp:
        t0 = time.perf_counter()
        snapshot = make_tiny_snapshot(Path(tmp) / "h3-interface", seed=0, preset="interface")
        snapshot_s = time.perf_counter() - t0
        session = Session(snapshot, device=device)
        t0 = time.perf_counter()
        session.set_transformer(model, variant="transformer")  # fingerprints the weights once (device digest)
        if device == "cuda":
            torch.cuda.synchronize()
        inject_s = time.perf_counter() - t0
        print(f"interface snapshot in {snapshot_s:.1f}s, injected in {inject_s:.1f}s", flush=True)

        digests: dict[str, list[str]] = {}
        for mode in args.modes.split(","):
            runs = []
            for repeat in range(args.repeats):
                r = session.generate(PROMPT, width=width, height=height, frames=args.frames, steps=steps, mode=mode,
                                     seed=args.seed)
                run = {
                    "repeat": repeat,
                    "timings_s": dict(r.timings),
                    "total_s": r.total_seconds,
                    "peak_mem_gib": r.peak_memory / 2**30,
                    "memory_kind": r.memory_kind,
                    "trajectory_hash": r.trajectory_hash,
                    "text_cached": bool(r.cached["text"]),
                    "evaluations": r.evaluations,
                }
                runs.append(run)
                digests.setdefault(mode, []).append(r.trajectory_hash)
                print(f"{mode} #{repeat}: " + " ".join(f"{k}={v:.3f}" for k, v in r.timings.items())
                      + f" peak {run['peak_mem_gib']:.2f} GiB ({r.memory_kind}) digest {r.trajectory_hash[:16]}",
                      flush=True)
            denoise = [run["timings_s"]["denoise"] for run in runs]
            med = statistics.median(denoise)
            results.append({
                "shape": f"{width}x{height}x{r.settings.num_frames}f", "rows": r.layout.sequence_length,
                "impl": f"h3lab-{mode}", "median_s": med, "runs": len(runs),
                "peak_mem_gib": max(run["peak_mem_gib"] for run in runs),
                "metric": "denoise phase seconds (all passes)", "steps": steps, "per_pass_s": med / steps,
                "trajectory_hash": runs[0]["trajectory_hash"], "generations": runs,
            })
        for mode, hashes in digests.items():
            checks.append({"check": f"{mode}_repeat_digest_equal", "bytes_equal": len(set(hashes)) == 1,
                           "digests": hashes})
        if "strict" in digests and "off" in digests:
            same = digests["strict"][0] == digests["off"][0]
            checks.append({"check": "strict_vs_off_digest_equal", "bytes_equal": same,
                           "note": "informational: off runs vendor kernels, strict the deterministic ones"})
        checks.append({"check": "imageio_ffmpeg_not_imported", "ok": "imageio_ffmpeg" not in sys.modules})
        fingerprint = model.fingerprint

    doc = header(
        "session_full" if not args.tiny else "session_tiny_smoke", __file__, argv, device,
        config={"num_layers": config.num_layers, "hidden_size": config.hidden_size,
                "heads": config.num_attention_heads, "text_dim": config.text_dim, "in_channels": config.in_channels,
                "audio_in_channels": config.audio_in_channels, "params": params},
        weights="random (seeded 1234, benchmark_forward.build_diffusers), injected with Session.set_transformer",
        snapshot="make_tiny_snapshot(seed=0, preset='interface'): tiny text encoder and VAEs at the released widths",
        fingerprint=fingerprint, build_s=build_s, snapshot_s=snapshot_s, inject_s=inject_s, prompt=PROMPT,
        seed=args.seed, checks=checks,
    )
    doc["results"] = results
    write(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
