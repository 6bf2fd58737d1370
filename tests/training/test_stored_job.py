"""Folders in the stored layout read, resume and verify: `stored_job/` holds what `h3lab train` wrote for `ARGV`
(config records with the optimiser's keys flat beside the others, as job.json and every sealed run keep them):

- `job/`: the job interrupted after step 3 (job.json, initial/, the checkpoint of step 2);
- `run/`: the sealed run of the same job run uninterrupted, and `expected.json` its digest and adapter record;
- `configs.json`: one stored record of each config (`TrainConfig`, `GrpoConfig`, `NftConfig`).

The job's data and snapshot are rebuilt from their seeds here (the same bytes: job.json's data digest and the run's
base fingerprint check it); job.json's two paths are pointed at them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from training_cases import make_clip, make_layout

from h3lab import H3Config
from h3lab.frontends import train
from h3lab.frontends import verify as verify_front_end
from h3lab.checkpoint.tiny import make_tiny_snapshot
from h3lab.training import OptimizerConfig, TrainConfig, load
from h3lab.training.dataset import save_dataset
from h3lab.training.grpo_step import GrpoConfig
from h3lab.training.nft import NftConfig

STORED = Path(__file__).parent / "stored_job"


def ARGV(clips: Path, out: Path, snapshot: Path) -> list[str]:
    return ["--clips", str(clips), "--out", str(out), "-d", str(snapshot), "--rank", "2", "--alpha", "4", "--steps",
            "4", "--batch-size", "2", "--lr", "1e-2", "--weight-decay", "0.01", "--checkpoint-every", "2", "--mode",
            "off", "--seed", "3", "--device", "cpu"]


def _inputs(tmp_path: Path) -> tuple[Path, Path]:
    snapshot = make_tiny_snapshot(tmp_path / "h3-tiny", seed=0)
    save_dataset(tmp_path / "clips", [make_clip(H3Config.tiny(), make_layout("fl2va"), seed=s) for s in (1, 2, 3)])
    return tmp_path / "clips", Path(snapshot)


def test_stored_config_records_read_back_to_the_same_json():
    records = json.loads((STORED / "configs.json").read_text(encoding="utf-8"))
    for cls in (TrainConfig, GrpoConfig, NftConfig):
        record = records[cls.__name__]
        config = cls.from_dict(record)
        assert json.dumps(config.to_dict()) == json.dumps(record), cls.__name__  # keys, values and their order
        assert config.optim == OptimizerConfig.from_record(record) and config.optim.lr == record["lr"]


def test_a_stored_job_resumes_to_the_run_it_sealed_uninterrupted(tmp_path, capsys):
    clips, snapshot = _inputs(tmp_path)
    out = tmp_path / "job"
    shutil.copytree(STORED / "job", out)
    stored = json.loads((out / "job.json").read_text(encoding="utf-8"))
    stored.update(clips=str(clips.resolve()), snapshot=str(snapshot.resolve()))
    (out / "job.json").write_text(json.dumps(stored), encoding="utf-8")
    assert train.main(ARGV(clips, out, snapshot) + ["--resume"]) == 0, capsys.readouterr().err
    expected = json.loads((STORED / "expected.json").read_text(encoding="utf-8"))
    run = load(out / "run")
    assert run.digest == expected["digest"] and run.manifest["adapter"] == expected["adapter"]
    assert run.manifest["config"] == stored["config"]


def test_a_stored_run_verifies(tmp_path, capsys):
    _, snapshot = _inputs(tmp_path)
    code = verify_front_end.main([str(STORED / "run"), "-d", str(snapshot), "--device", "cpu"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "OK" in out.out
