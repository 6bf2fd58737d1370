"""benchmarks/benchmark_fast_default.py's CPU smoke run (`--cpu`: fast under `fast.use_emulation()`): the JSON has the
DESIGN.md schema, every prompt has an off and a fast generation with what each reads, fast differs from off and
says so in its drift lines, and every pass's latent distance is recorded."""


def test_cpu_smoke_run_writes_the_schema(benchmark_main):
    doc = benchmark_main("benchmark_fast_default", "--cpu", "--steps", "2")
    assert {"name", "date", "gpu", "torch", "triton", "git_rev", "command", "results"} <= set(doc)
    assert [r["prompt"] for r in doc["results"]] == ["a blue square moves right, a middle tone",
                                                     "a red circle moves left, a high tone",
                                                     "a yellow triangle moves down, a low tone"]
    for row in doc["results"]:
        assert row["off"]["trajectory_hash"] != row["fast"]["trajectory_hash"]
        assert row["fast"]["what_ran"].startswith("fast: 0 strict / 0 torch / ")
        assert set(row["fast"]["match"]) == {"colour", "direction", "tone", "pan"}
        assert row["drift_lines"][0].startswith("off:") and "first drift at pass 1" in row["drift_lines"][0]
        assert [p["pass"] for p in row["per_pass"]] == [0, 1]
        assert all(0 < p["latent_video_rel_l2"] < 0.2 and 0 < p["latent_audio_rel_l2"] < 0.2 for p in row["per_pass"])
