"""Strict TP / CP (Ulysses) / SP forwards of the full-size H3 transformer (random weights) against one GPU: time,
peak memory per GPU, communication separated from compute, and byte equality with TP1.

    torchrun --nproc-per-node 2 benchmarks/benchmark_distributed.py --topologies tp2,cp2,tp2+sp --out dist.json
    python benchmarks/benchmark_distributed.py --out dist_ws1.json          # world size 1: tp1 vs plain strict
    python benchmarks/benchmark_distributed.py --tiny --topologies tp1 --out x.json   # CPU smoke (interpreter)

Every rank builds the same model (H3Config.full(), `benchmark_forward.init_random_` with one seed, released
dtypes) on its GPU. Per shape (benchmark_forward's t2va layouts) the plain one-process strict forward is run first on
the full model (TP1: batch 1 timed, batch 2 kept as the reference bytes); then for each topology the model is
rebuilt (same bytes), `parallelize`d on a mesh of that topology and measured:
- `median_s` over --runs forwards (CUDA events, after one warm-up), `peak_mem_gib` of every rank (`peak_mem_gib_ranks`),
- `comm_median_s`: the transport calls of the strict collectives (CUDA events around each NCCL call, so waiting for
  the slowest rank counts) plus the per-forward agreement exchange; `compute_median_s` = the rest,
- `bytes_equal_tp1`: video and audio of both items of a batch of 2 equal TP1's bytes on every rank (and item 0 the
  batch-1 bytes), `output_sha256` of the batch-1 velocities, the collective summary of one forward.
A topology whose world size is not the launch's is recorded as skipped. World size 1 ("tp1", the default without
torchrun) runs the distributed code path on one GPU next to the plain strict model (shared weights, timings
interleaved): `ratio_vs_plain` and byte equality. `--diffusers-cp` adds Diffusers' own Ulysses
(`ContextParallelConfig(ulysses_degree=world)`) for contrast where it loads: its time and how far it is from its
own one-GPU output (it does not promise bytes).

`--row-parallel k_chunks|n_split|auto` picks the row-parallel strategy (the GPU comparison that decides the default).
One JSON (DESIGN.md schema) from rank 0 to --out. Set NCCL_NVLS_ENABLE=0 on the lent H200 machines.

`--share-device` (bytes only, one GPU): every rank on cuda:0 over gloo with host-staged collectives
(`init_mesh(share_device=True)`). The weights are the counter-random init of `h3lab.distributed.shard_load`, so
each rank builds only its TP shard (`random_sharded_transformer`) and 8 ranks of the 33B model fit one GPU; rank 0
alone builds the full model first for the one-process reference (batch 1 and 2, and with `--trajectory-passes N` the
sealed digest of an N-pass strict t2va trajectory), frees it, and broadcasts the reference bytes. Per topology:
`bytes_equal_tp1` on every rank, the trajectory's `digest_equal_one_gpu`, `peak_mem_gib_ranks` (each rank's own
allocations on the shared GPU), the transport, and `timing_label` "bytes only ...": its times are recorded for
completeness and are never scaling (no `ratio_vs_plain`).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from datetime import timedelta

import torch

from _common import header, materialise, prepare, timed_interleaved, write

TOPOLOGY_HELP = "comma-separated tpT[xcpC][+sp], e.g. tp2,cp2,tp2xcp2,tp2+sp (world size T*C each)"


def parse_topology(name: str) -> dict:
    """'tp2xcp2+sp' -> {"tp": 2, "cp": 2, "sp": True}; 'cp2' -> {"tp": 1, "cp": 2, "sp": False}."""
    sp = name.endswith("+sp")
    out = {"tp": 1, "cp": 1, "sp": sp}
    for part in name.removesuffix("+sp").split("x"):
        key = part.rstrip("0123456789")
        if key not in ("tp", "cp") or not part[len(key):].isdigit():
            raise SystemExit(f"topology {name!r}: {TOPOLOGY_HELP}")
        out[key] = int(part[len(key):])
    return out


def build_model(config, device, seed: int):
    """H3Transformer with `init_random_(seed)` weights in the released dtypes, built on `device`."""
    from benchmark_forward import init_random_

    from h3lab import H3Transformer

    with torch.device("meta"):
        model = H3Transformer(config)
    model = materialise(model, device)
    init_random_(model, seed)
    model.reset_buffers(device)
    return model.eval().requires_grad_(False)


def shared_copy(model, device):
    """A second H3Transformer over the same parameter tensors (no extra weight memory)."""
    from h3lab import H3Transformer

    with torch.device("meta"):
        other = H3Transformer(model.config)
    other.load_state_dict(model.state_dict(), assign=True, strict=True)
    other.reset_buffers(device)
    other.fingerprint = model.fingerprint
    return other.eval().requires_grad_(False)


def forward(model, inputs):
    from h3lab.execution import runtime

    with runtime.use_mode("strict"), torch.no_grad():
        return model(**inputs)


def timed_forwards(model, inputs, runs: int, device: str) -> dict:
    """Seconds of each forward (after one warm-up), its communication seconds (0 for a plain model), peak GiB,
    and the last forward's outputs."""
    from h3lab.distributed.collectives import last_log, use_timing

    cuda = device == "cuda"
    forward(model, inputs)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, comm = [], []
    for _ in range(runs):
        with use_timing():
            before = last_log()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = forward(model, inputs)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                out = forward(model, inputs)
                times.append(time.perf_counter() - t0)
            log = last_log()
        comm.append(log.transport_seconds() + log.control_seconds if log is not None and log is not before else 0.0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    return {"times_s": times, "comm_s": comm, "peak_mem_gib": peak, "out": out}


def free(dev) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.ipc_collect()  # blocks other ranks mapped (shared-device runs) and have let go of
        torch.cuda.empty_cache()


def gather(obj):
    import torch.distributed as dist

    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topologies", default=None, help=TOPOLOGY_HELP + " (default: tp<world>, or tp1 alone)")
    ap.add_argument("--shapes", default="512x512x22f,864x480x56f")
    ap.add_argument("--runs", type=int, default=7, help="timed forwards per topology and shape (median; >= 5 on GPU)")
    ap.add_argument("--layers", type=int, default=None, help="override num_layers (default: the config's)")
    ap.add_argument("--row-parallel", default="auto", choices=("auto", "k_chunks", "n_split"))
    ap.add_argument("--diffusers-cp", action="store_true", help="also time Diffusers' Ulysses CP (contrast)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on H3Config.tiny() (gloo, interpreter)")
    ap.add_argument("--share-device", action="store_true",
                    help="every rank on one GPU over gloo, host-staged collectives: bytes only (module docstring)")
    ap.add_argument("--trajectory-passes", type=int, default=0,
                    help="with --share-device: also an N-pass strict trajectory per topology (sealed digest)")
    ap.add_argument("--trajectory-topologies", default=None,
                    help="with --trajectory-passes: the topologies that record one (default: all)")
    ap.add_argument("--trajectory-shapes", default=None,
                    help="with --trajectory-passes: the shapes that record one (default: all)")
    ap.add_argument("--shared-transport", default="shared", choices=("shared", "staged"),
                    help="with --share-device: collectives through mapped slots (CUDA IPC; /dev/shm on CPU) or "
                         "host-staged over gloo")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="instead of running: merge these --share-device result files into --out (one table)")
    ap.add_argument("--note", action="append", default=[], help="with --merge: a line for the table's notes")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.merge:
        return merge_shared(args.merge, args.out, argv, args.note)
    device = prepare(ap, cpu=args.tiny, flag="--tiny")
    if args.share_device:
        return shared_device_main(args, argv, device)
    import torch.distributed as dist
    from benchmark_forward import make_inputs, output_sha256

    from h3lab.execution import runtime
    from h3lab.config import H3Config
    from h3lab.distributed import init_mesh, parallelize

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    world = int(os.environ.get("WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    config = H3Config.tiny() if args.tiny else H3Config.full()
    if args.layers is not None:
        config = H3Config(**{**config.to_diffusers(), "num_layers": args.layers})
    shapes = ["tiny-64x64x22f"] if args.tiny else args.shapes.split(",")
    names = (args.topologies or (f"tp{world}" if world > 1 else "tp1")).split(",")
    if world > 1 and not dist.is_initialized():  # under torchrun: start the process group through a first mesh
        first = parse_topology(names[0])
        init_mesh(tp=first["tp"], cp=first["cp"], sp=first["sp"], device="cpu" if args.tiny else None)
    rank = dist.get_rank() if dist.is_initialized() else 0
    dev = torch.device("cpu") if args.tiny else torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)

    results, checks = [], []
    t0 = time.time()
    model = build_model(config, dev, seed=1234)
    print(f"rank {rank}: built ({sum(p.numel() for p in model.parameters())/1e9:.3f} B params) in "
          f"{time.time() - t0:.1f} s", flush=True)

    # TP1: the plain one-process strict forward on the full model; batch 2 is the reference bytes.
    reference = {}
    for shape in shapes:
        layout, one = make_inputs(config, shape, 1, dev, seed=7)
        _, two = make_inputs(config, shape, 2, dev, seed=7)
        measured = timed_forwards(model, one, args.runs, device)
        v1, a1 = measured.pop("out")
        v2, a2 = forward(model, two)
        reference[shape] = (layout.sequence_length, one, two, (v1.cpu(), a1.cpu()), (v2.cpu(), a2.cpu()),
                            statistics.median(measured["times_s"]))
        results.append({"shape": shape, "rows": layout.sequence_length, "impl": "h3lab-strict", "topology": "plain",
                        "median_s": statistics.median(measured["times_s"]), "runs": args.runs,
                        "times_s": measured["times_s"], "peak_mem_gib": measured["peak_mem_gib"],
                        "output_sha256": output_sha256(v1, a1), "rank": rank})
        print(f"rank {rank} {shape} plain strict: {results[-1]['median_s'] * 1e3:.2f} ms", flush=True)

    if world > 1:  # each topology rebuilds the same weights and shards them in place
        del model
        model = None
        free(dev)
    for name in names:
        topo = parse_topology(name)
        if topo["tp"] * topo["cp"] != world:
            results.append({"shape": "-", "rows": 0, "impl": f"h3lab-strict-{name}", "topology": name,
                            "skipped": f"world size {topo['tp'] * topo['cp']} != launch world size {world}"})
            continue
        mesh = init_mesh(tp=topo["tp"], cp=topo["cp"], sp=topo["sp"], device=dev, config=config,
                         row_parallel=args.row_parallel)
        # world size 1: the distributed code path beside the plain model, on the same weights
        placed = shared_copy(model, dev) if world == 1 else build_model(config, dev, seed=1234)
        parallelize(placed, mesh)
        for shape in shapes:
            rows, one, two, ref1, ref2, plain_s = reference[shape]
            if world == 1:  # plain and placed calls interleaved (a, b, a, b): clock drift hits both alike
                pair = timed_interleaved({"plain": lambda: forward(model, one), "placed": lambda: forward(placed, one)},
                                         args.runs, device)
                plain_s = statistics.median(pair["plain"][0])
                measured = {"times_s": pair["placed"][0], "comm_s": [0.0] * args.runs,
                            "peak_mem_gib": pair["placed"][1], "out": forward(placed, one)}
            else:
                measured = timed_forwards(placed, one, args.runs, device)
            trace = runtime.last_trace()  # of the last batch-1 forward
            v1, a1 = measured.pop("out")
            v2, a2 = forward(placed, two)
            equal = bool(torch.equal(v2.cpu(), ref2[0]) and torch.equal(a2.cpu(), ref2[1])
                         and torch.equal(v1.cpu(), ref1[0]) and torch.equal(a1.cpu(), ref1[1])
                         and torch.equal(v2[:1].cpu(), ref1[0]) and torch.equal(a2[:1].cpu(), ref1[1]))
            per_rank = gather({"equal": equal, "peak": measured["peak_mem_gib"],
                               "median_s": statistics.median(measured["times_s"]),
                               "comm_s": statistics.median(measured["comm_s"])})
            med = statistics.median(measured["times_s"])
            comm = statistics.median(measured["comm_s"])
            entry = {"shape": shape, "rows": rows, "impl": f"h3lab-strict-{name}", "topology": name,
                     "world_size": world, "row_parallel": mesh.topology.strategy, "median_s": med,
                     "runs": args.runs, "times_s": measured["times_s"], "peak_mem_gib": measured["peak_mem_gib"],
                     "peak_mem_gib_ranks": [r["peak"] for r in per_rank],
                     "median_s_ranks": [r["median_s"] for r in per_rank],
                     "comm_median_s": comm, "compute_median_s": med - comm,
                     "comm_median_s_ranks": [r["comm_s"] for r in per_rank],
                     "bytes_equal_tp1": all(r["equal"] for r in per_rank),
                     "ratio_vs_plain": med / plain_s, "output_sha256": output_sha256(v1, a1),
                     "collectives": trace.collectives.summary() if trace and trace.collectives else None}
            results.append(entry)
            print(f"rank {rank} {shape} {name}: {med * 1e3:.2f} ms (comm {comm * 1e3:.2f} ms), peak "
                  f"{measured['peak_mem_gib']:.1f} GiB, bytes equal TP1: {entry['bytes_equal_tp1']}, ratio vs plain "
                  f"{entry['ratio_vs_plain']:.3f}", flush=True)
        del placed
        free(dev)

    if args.diffusers_cp:
        checks += diffusers_contrast(config, dev, shapes, world, args.runs, device)

    doc = header("distributed" if not args.tiny else "distributed_tiny_smoke", __file__, argv, device,
                 config={"num_layers": config.num_layers, "hidden_size": config.hidden_size,
                         "heads": config.num_attention_heads},
                 world_size=world, weights="random (seeded, the same on every rank)", checks=checks)
    doc["results"] = results
    if rank == 0:
        write(args.out, doc)
    return doc


def shared_device_main(args, argv, device: str) -> dict:
    """--share-device: the bytes-only verification run (module docstring)."""
    import torch.distributed as dist
    from benchmark_forward import make_inputs, output_sha256, t2va_spec

    from h3lab.config import H3Config
    from h3lab.distributed import init_mesh, parallelize
    from h3lab.distributed.replicas import replica_shared_transformer, weight_nbytes
    from h3lab.distributed.shard_load import random_sharded_transformer
    from h3lab.run.trajectory import record

    torch.backends.cuda.matmul.allow_tf32 = False
    config = H3Config.tiny() if args.tiny else H3Config.full()
    if args.layers is not None:
        config = H3Config(**{**config.to_diffusers(), "num_layers": args.layers})
    shapes = ["tiny-64x64x22f"] if args.tiny else args.shapes.split(",")
    world = int(os.environ.get("WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    names = (args.topologies or f"tp{world}").split(",")
    traj_names = set(args.trajectory_topologies.split(",")) if args.trajectory_topologies else set(names)
    traj_shapes = set(args.trajectory_shapes.split(",")) if args.trajectory_shapes else set(shapes)
    dev = torch.device("cpu") if args.tiny else torch.device("cuda", 0)
    first = parse_topology(names[0])
    if not dist.is_initialized():  # start the gloo process group through a first mesh
        init_mesh(tp=first["tp"], cp=first["cp"], sp=first["sp"], device=dev, share_device=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    seed = 1234
    # the other ranks wait for rank 0's reference here: a group whose timeout outlasts building the full model
    waiting = dist.new_group(backend="gloo", timeout=timedelta(hours=2)) if dist.is_initialized() else None

    reference: dict = {}
    results: list[dict] = []
    if rank == 0:  # the one-process reference: the full counter-random model, built, measured, freed
        t0 = time.time()
        model = random_sharded_transformer(config, None, seed, device=dev)
        print(f"rank 0: full model built in {time.time() - t0:.1f} s", flush=True)
        for shape in shapes:
            layout, one = make_inputs(config, shape, 1, dev, seed=7)
            _, two = make_inputs(config, shape, 2, dev, seed=7)
            measured = timed_forwards(model, one, args.runs, device)
            v1, a1 = measured.pop("out")
            v2, a2 = forward(model, two)
            digest = ""
            if args.trajectory_passes and shape in traj_shapes:
                digest = record(t2va_spec(config, shape, args.trajectory_passes, "strict", dev), model).digest
            reference[shape] = {"rows": layout.sequence_length, "one": (v1.cpu(), a1.cpu()),
                                "two": (v2.cpu(), a2.cpu()), "digest": digest}
            results.append({"shape": shape, "rows": layout.sequence_length, "impl": "h3lab-strict",
                            "topology": "plain (one process, full model)", "median_s": statistics.median(
                                measured["times_s"]), "runs": args.runs, "times_s": measured["times_s"],
                            "peak_mem_gib": measured["peak_mem_gib"], "output_sha256": output_sha256(v1, a1),
                            "trajectory_passes": args.trajectory_passes, "trajectory_digest": digest})
            print(f"rank 0 {shape} plain strict: {results[-1]['median_s'] * 1e3:.2f} ms, digest {digest[:16]}",
                  flush=True)
        del model
        free(dev)
    box = [reference]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0, group=waiting)
    reference = box[0]

    for name in names:
        topo = parse_topology(name)
        if topo["tp"] * topo["cp"] != world:
            results.append({"shape": "-", "rows": 0, "impl": f"h3lab-strict-{name}", "topology": name,
                            "skipped": f"world size {topo['tp'] * topo['cp']} != launch world size {world}"})
            continue
        mesh = init_mesh(tp=topo["tp"], cp=topo["cp"], sp=topo["sp"], device=dev, config=config,
                         row_parallel=args.row_parallel, share_device=True)
        mesh.shared_memory = args.shared_transport == "shared"
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        placed = replica_shared_transformer(config, mesh, seed, device=dev)  # one copy per CP group (replicas.py)
        parallelize(placed, mesh)
        build_s = time.time() - t0
        load_peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
        weights_gib = weight_nbytes(placed) / 2**30
        owns = placed.h3lab_weights_owner == rank
        for shape in shapes:
            ref = reference[shape]
            _, one = make_inputs(config, shape, 1, dev, seed=7)
            _, two = make_inputs(config, shape, 2, dev, seed=7)
            measured = timed_forwards(placed, one, args.runs, device)
            v1, a1 = measured.pop("out")
            v2, a2 = forward(placed, two)
            equal = bool(all(torch.equal(x.cpu(), y) for x, y in zip((v1, a1, v2, a2), (*ref["one"], *ref["two"]))))
            digest = ""
            traj = bool(args.trajectory_passes) and name in traj_names and shape in traj_shapes and ref["digest"]
            if traj:
                spec = t2va_spec(config, shape, args.trajectory_passes, "strict", dev).replace(
                    placement={"tp": topo["tp"], "cp": topo["cp"], "sp": topo["sp"],
                               "row_parallel": args.row_parallel})
                digest = record(spec, placed).digest
            per_rank = gather({"equal": equal, "peak": measured["peak_mem_gib"], "digest": digest,
                               "load_peak": load_peak, "weights": weights_gib, "owns": owns,
                               "owner": placed.h3lab_weights_owner})
            trace = runtime_trace()
            med = statistics.median(measured["times_s"])
            entry = {"shape": shape, "rows": ref["rows"], "impl": f"h3lab-strict-{name}", "topology": name,
                     "world_size": world, "row_parallel": mesh.topology.strategy, "share_device": True,
                     "transport": mesh.transport, "timing_label": mesh.timing_label,
                     "median_s": med, "runs": args.runs, "times_s": measured["times_s"],
                     "comm_median_s": statistics.median(measured["comm_s"]),
                     "peak_mem_gib": measured["peak_mem_gib"],
                     "peak_mem_gib_ranks": [r["peak"] for r in per_rank],
                     "build_peak_mem_gib_ranks": [r["load_peak"] for r in per_rank], "build_s": build_s,
                     "weights_gib_ranks": [r["weights"] for r in per_rank],
                     "weights_owner_ranks": [r["owner"] for r in per_rank],
                     # what each rank would hold on a GPU of its own: its measured peak, plus the weights it maps
                     # from its CP group's rank 0 when it did not allocate them itself
                     "own_gpu_peak_mem_gib_ranks": [r["peak"] + (0.0 if r["owns"] else r["weights"])
                                                    for r in per_rank],
                     "bytes_equal_tp1": all(r["equal"] for r in per_rank),
                     "output_sha256": output_sha256(v1, a1),
                     "collectives": trace.collectives.summary() if trace and trace.collectives else None}
            if traj:
                entry.update(trajectory_passes=args.trajectory_passes, trajectory_digest=digest,
                             digest_equal_one_gpu=all(r["digest"] == ref["digest"] for r in per_rank))
            results.append(entry)
            print(f"rank {rank} {shape} {name} (bytes only): bytes equal TP1 {entry['bytes_equal_tp1']}, peak "
                  f"{measured['peak_mem_gib']:.1f} GiB, digest equal {entry.get('digest_equal_one_gpu')}", flush=True)
        release_replicas(placed, rank, dev)
        del placed
        free(dev)
        _shared_doc(args, argv, device, config, world, results, rank)  # after every topology: a cut run keeps
    return _shared_doc(args, argv, device, config, world, results, rank)  # what it finished


def _shared_doc(args, argv, device, config, world, results, rank) -> dict:
    doc = header("distributed_shared_device" if not args.tiny else "distributed_shared_device_tiny_smoke", __file__,
                 argv, device, config={"num_layers": config.num_layers, "hidden_size": config.hidden_size,
                                       "heads": config.num_attention_heads},
                 world_size=world, weights="counter-random (h3lab.distributed.shard_load, seed 1234): each rank "
                 "builds only its shard; the CP ranks of one TP shard map one copy (h3lab.distributed.replicas)",
                 label="bytes only: every rank shares one GPU; collectives "
                 + ("through shared memory (CUDA IPC slots, mailbox.py)" if args.shared_transport == "shared"
                    else "staged through host memory over gloo") + "; times are not scaling",
                 shared_transport=args.shared_transport, checks=[])
    doc["results"] = results
    if rank == 0:
        write(args.out, doc)
    return doc


def release_replicas(model, rank: int, dev) -> None:
    """Drop a topology's weights on every rank (whatever still holds the model object), the ranks mapping a CP owner's
    weights first, so that the owner's exported blocks are returned before the next topology is built (else a CP4
    owner's 62 GiB stays held into the next topology, out of memory on the H200). CUDA IPC releases one reference per
    opening, so `mailbox.export` sends one handle per mapping rank."""
    import torch.distributed as dist

    def drop() -> None:
        for module in model.modules():
            module._parameters.clear()
            module._buffers.clear()
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.ipc_collect()

    if model.h3lab_weights_owner != rank:
        drop()
    if dist.is_initialized():
        dist.barrier()
    if model.h3lab_weights_owner == rank:
        drop()
    if dist.is_initialized():
        dist.barrier()


def merge_shared(files: list[str], out: str, argv, notes: list[str] = ()) -> dict:
    """One table from several --share-device runs (one torchrun launch per world size): their results in the given
    order, each tagged with its launch's command, world size and git revision; the header of the first; `notes`
    (what did not run, and why) kept beside them."""
    import json

    docs = [json.loads(open(f).read()) for f in files]
    doc = {k: v for k, v in docs[0].items() if k not in ("results", "command", "world_size")}
    doc["command"] = "python benchmarks/benchmark_distributed.py " + " ".join(sys.argv[1:] if argv is None else argv)
    doc["launches"] = [{"command": d["command"], "world_size": d["world_size"], "git_rev": d["git_rev"],
                        "date": d["date"]} for d in docs]
    doc["results"] = [{**r, "launch": i} for i, d in enumerate(docs) for r in d["results"]]
    doc["notes"] = list(notes)
    write(out, doc)
    return doc


def runtime_trace():
    from h3lab.execution import runtime

    return runtime.last_trace()


def diffusers_contrast(config, dev, shapes, world, runs, device) -> list[dict]:
    """Diffusers' own context parallelism (Ulysses over all ranks), where it loads: time, and max |diff| from its
    own one-GPU forward (it makes no byte promise). Any failure is recorded, not raised."""
    from benchmark_forward import build_diffusers, make_inputs

    out = []
    try:
        from diffusers import ContextParallelConfig

        dm = build_diffusers(config, dev, seed=1234)
        single = {}
        for shape in shapes:
            _, one = make_inputs(config, shape, 1, dev, seed=7)
            with torch.no_grad():
                single[shape] = dm(**one, return_dict=False)
        dm.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        for shape in shapes:
            layout, one = make_inputs(config, shape, 1, dev, seed=7)
            times = []
            for i in range(runs + 1):
                t0 = time.perf_counter()
                with torch.no_grad():
                    v, a = dm(**one, return_dict=False)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                if i:
                    times.append(time.perf_counter() - t0)
            diff = max(float((v.float() - single[shape][0].float()).abs().max()),
                       float((a.float() - single[shape][1].float()).abs().max()))
            out.append({"check": "diffusers_ulysses", "shape": shape, "rows": layout.sequence_length,
                        "ulysses_degree": world, "median_s": statistics.median(times),
                        "max_abs_diff_vs_one_gpu": diff, "bytes_equal_one_gpu": diff == 0.0})
    except Exception as exc:  # noqa: BLE001 - a contrast that does not load is a result, not a crash
        out.append({"check": "diffusers_ulysses", "error": f"{type(exc).__name__}: {exc}"})
    return out


if __name__ == "__main__":
    main()
