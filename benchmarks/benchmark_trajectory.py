"""A 10-pass full-size (random weights) trajectory at 512x512x22f: strict run twice (sealed digests must match),
the four experiment arms P/P, R/P, P/R, R/R (P = Diffusers transformer + scheduler, R = h3lab strict), and the
cost of hash capture (the trajectory recorder) against a plain strict denoise loop.

Models: Diffusers' `MiniMaxH3Transformer3DModel` with seeded random weights and `H3Transformer` sharing the same
parameter tensors (see benchmark_forward.py). Inputs: a t2va layout, random bf16 text rows and seeded float32
noise. Writes one JSON (schema of DESIGN.md "Evidence") to --out. `--tiny` runs it on H3Config.tiny() on the CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _common import header, peak_mem_gib, prepare, rel_l2, sync, write
from benchmark_forward import build_diffusers, build_h3lab_shared, t2va_spec


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats of the plain and recorded loops")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = prepare(ap, cpu=args.tiny, flag="--tiny")

    from h3lab.execution import runtime
    from h3lab.research.arms import rollout, run_arm, sides
    from h3lab.config import H3Config
    from h3lab.hashing import device_lanes, model_fingerprint
    from h3lab.run import denoise, model_forward
    from h3lab.run.trajectory import STEP_FIELDS, TrajectoryRecorder, record

    torch.backends.cuda.matmul.allow_tf32 = False
    config = H3Config.tiny() if args.tiny else H3Config.full()
    shape = "tiny-64x64x22f" if args.tiny else "512x512x22f"
    dm = build_diffusers(config, device, seed=1234)
    hm = build_h3lab_shared(config, dm, device)

    spec = t2va_spec(config, shape, args.passes, "strict", device)
    layout, schedule, inputs = spec.layout, spec.schedule, spec.inputs

    def plain() -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            denoise(spec, hm)
        sync(device)
        return time.perf_counter() - t0

    def recorded():
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            traj = record(spec, hm)
        sync(device)
        return time.perf_counter() - t0, traj

    class _Hollow(TrajectoryRecorder):
        """begin/finish of the recorder, every pass only counted: what the per-pass hashing costs is the rest."""

        def record(self, rec) -> None:
            self.steps.append({"index": rec.index, **{name: "" for name in STEP_FIELDS}})

    def hollow() -> tuple[float, float]:
        sync(device)
        t0 = time.perf_counter()
        rec = _Hollow()
        with torch.no_grad():
            denoise(spec, hm, rec)
        sync(device)
        t1 = time.perf_counter()
        rec.finish()  # the manifest of a real run (hashes of nothing per pass)
        return t1 - t0, time.perf_counter() - t1

    plain()  # warm-up: kernel compilation
    plain_times, rec_times, digests, hollow_times, finish_times = [], [], [], [], []
    for _ in range(args.repeats):  # interleaved so drift in clocks hits both equally
        plain_times.append(plain())
        t, traj = recorded()
        rec_times.append(t)
        digests.append(traj.digest)
        loop_s, finish_s = hollow()
        hollow_times.append(loop_s)
        finish_times.append(finish_s)
    print(f"recorder breakdown: loop with begin + counted passes {statistics.median(hollow_times):.3f} s, "
          f"finish {statistics.median(finish_times):.3f} s", flush=True)
    overhead = statistics.median(rec_times) / statistics.median(plain_times) - 1.0
    # the recorder's deferred side-stream copies must hash the bytes a synchronous copy hashes
    class _Synchronous(TrajectoryRecorder):
        deferred = False

    sync_rec = _Synchronous()
    with torch.no_grad():
        denoise(spec, hm, sync_rec)
    deferred_equal = sync_rec.finish().digest == digests[0]
    print(f"deferred recorder digest equals the synchronous one: {deferred_equal}", flush=True)
    print(f"strict 10-pass loop: plain {statistics.median(plain_times):.3f} s, recorded {statistics.median(rec_times):.3f} s,"
          f" overhead {overhead*100:.2f}%; digests equal: {len(set(digests)) == 1}", flush=True)

    # Where the recorder's time goes: the weight fingerprint (device scheme over every parameter, once per run),
    # the device checksum's throughput (Triton kernel vs the torch formulation), and one forward with every hook
    # point captured (drift's hash-only pass) against a plain strict forward.
    from h3lab.research.drift import Execution, capture

    sync(device)
    t0 = time.perf_counter()
    model_fingerprint(hm)
    sync(device)
    fingerprint_s = time.perf_counter() - t0
    probe = torch.randn(1 << 28 if device == "cuda" else 1 << 16, device=device).to(torch.bfloat16)  # 512 MiB on GPU
    digest_rates = {}
    for impl in ("kernel", "torch"):
        device_lanes(probe, impl=impl)  # warm-up / compilation
        sync(device)
        t0 = time.perf_counter()
        lanes = device_lanes(probe, impl=impl)
        sync(device)
        digest_rates[impl] = {"seconds": time.perf_counter() - t0, "gb": probe.numel() * 2 / 1e9, "lanes": list(lanes)}
    digest_rates["equal"] = digest_rates["kernel"]["lanes"] == digest_rates["torch"]["lanes"]
    ex = Execution(spec, hm, scope="forward", forward_pass=0, label="capture")
    capture(ex)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    cap = capture(ex)
    sync(device)
    capture_s = time.perf_counter() - t0
    with runtime.use_mode("strict"), torch.no_grad():
        sync(device)
        t0 = time.perf_counter()
        model_forward(hm, inputs, inputs.video, inputs.audio, 0)
        sync(device)
        forward_s = time.perf_counter() - t0
    costs = {"fingerprint_s": fingerprint_s, "params": sum(p.numel() for p in hm.parameters()),
             "digest": digest_rates, "captured_forward_s": capture_s, "plain_forward_s": forward_s,
             "captured_points": len(cap.digests)}
    print(f"fingerprint {fingerprint_s:.3f} s; digest kernel {digest_rates['kernel']['gb'] / digest_rates['kernel']['seconds']:.1f}"
          f" GB/s vs torch {digest_rates['torch']['gb'] / digest_rates['torch']['seconds']:.1f} GB/s (equal {digest_rates['equal']});"
          f" captured forward {capture_s:.3f} s ({len(cap.digests)} points) vs plain {forward_s:.3f} s", flush=True)

    sd = sides(hm, dm)
    with torch.no_grad():
        t0 = time.perf_counter()
        traj_r = rollout(sd["R"], inputs, schedule)
        t_r = time.perf_counter() - t0
        t0 = time.perf_counter()
        traj_p = rollout(sd["P"], inputs, schedule)
        t_p = time.perf_counter() - t0
    steps = []
    for i in range(schedule.num_passes):
        row = {"step": i}
        for key in ("video", "audio", "velocity_video", "velocity_audio"):
            a, b = traj_r.kept[f"{key}.{i:04d}"].double(), traj_p.kept[f"{key}.{i:04d}"].double()
            row[key] = {"rel_l2": rel_l2(a, b), "max_abs": float((a - b).abs().max())}
        steps.append(row)
    print(f"R vs P rollout final video latent rel L2 {steps[-1]['video']['rel_l2']:.3e}", flush=True)

    arms = {}
    for arm, (train, roll, traj) in {
        "P/P": ("P", "P", traj_p), "R/R": ("R", "R", traj_r), "R/P": ("R", "P", traj_p), "P/R": ("P", "R", traj_r),
    }.items():
        t0 = time.perf_counter()
        rep = run_arm(sd[train], sd[roll], inputs, schedule, trajectory=traj)
        arms[arm] = {
            "byte_equal": rep.byte_equal,
            "first_drift": rep.first_drift,
            "max_velocity_rel_l2": max(max(d["video"]["rel_l2"], d["audio"]["rel_l2"]) for d in rep.velocity_drift),
            "max_latent_rel_l2": max(max(d["video"]["rel_l2"], d["audio"]["rel_l2"]) for d in rep.latent_drift),
            "seconds": rep.seconds,
            "wall_s": time.perf_counter() - t0,
        }
        print(f"arm {arm}: byte_equal={rep.byte_equal} first_drift={rep.first_drift}", flush=True)

    doc = header("trajectory_full" if not args.tiny else "trajectory_tiny_smoke", __file__, argv, device,
                 weights="random (seeded), shared storage between Diffusers and h3lab")
    doc.update({
        "results": [
            {"shape": shape, "rows": layout.sequence_length, "impl": "h3lab-strict", "what": "10-pass loop, no recorder",
             "median_s": statistics.median(plain_times), "runs": len(plain_times), "times_s": plain_times,
             "peak_mem_gib": peak_mem_gib(device)},
            {"shape": shape, "rows": layout.sequence_length, "impl": "h3lab-strict", "what": "10-pass loop, recorder (sha256 per pass)",
             "median_s": statistics.median(rec_times), "runs": len(rec_times), "times_s": rec_times,
             "peak_mem_gib": peak_mem_gib(device),
             "overhead_vs_plain": overhead},
            {"shape": shape, "rows": layout.sequence_length, "impl": "diffusers", "what": "10-pass rollout (P side)",
             "median_s": t_p, "runs": 1, "peak_mem_gib": float("nan")},
            {"shape": shape, "rows": layout.sequence_length, "impl": "h3lab-strict", "what": "10-pass rollout (R side, kept tensors)",
             "median_s": t_r, "runs": 1, "peak_mem_gib": float("nan")},
        ],
        "recorder_costs": {**costs, "hollow_loop_s": hollow_times, "finish_s": finish_times},
        "strict_digests": digests,
        "strict_repeat_bit_equal": len(set(digests)) == 1,
        "deferred_recorder_equals_synchronous": deferred_equal,
        "r_vs_p_rollout": steps,
        "arms": arms,
    })
    write(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
