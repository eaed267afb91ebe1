"""`run.py` end to end in a subprocess: a short run, a 2-job multirun, W&B offline files and metric logs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAST = ["train.steps=3", "train.log_every=1", "data.global_batch_size=2", "data.seq_length=64",
        "train.progress_bar=false", "checkpoint.save_every=2"]


def run_py(args, tmp_path, timeout=900):
    env = dict(os.environ, WANDB_SILENT="true", WANDB_MODE="offline", JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    cmd = [sys.executable, str(ROOT / "run.py"), *args, f"data.cache_dir={tmp_path / 'cache'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def offline_run_keys(run_dir: Path) -> str:
    """The bytes of the W&B offline run file (its records hold every logged key)."""
    files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert files, f"no W&B offline run under {run_dir}"
    return b"".join(f.read_bytes() for f in files).decode("latin-1")


def test_single_run_writes_metrics_checkpoints_wandb_and_summary(tmp_path):
    proc = run_py([*FAST, "train.eval_every=2", "train.eval_batches=1", f"hydra.run.dir={tmp_path / 'run'}"],
                  tmp_path)
    run_dir = tmp_path / "run"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("loss", "lm_loss", "grad_norm", "lr", "tokens", "tokens_per_s", "native_t_over_t", "overflow"):
        assert key in records[-1], key
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["packing_parity_rel"] < 1e-5
    assert [r["step"] for r in records if "val_lm_loss" in r] == [2]  # the bundled corpus' valid split
    assert summary["val_lm_loss"] > 0 and summary["test_lm_loss"] > 0 and summary["val_ppl"] > 1
    assert "validation loss at iteration 2 |" in proc.stdout and "on test set |" in proc.stdout
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    wandb_records = offline_run_keys(run_dir)
    assert "lm_loss" in wandb_records and "native_t_over_t" in wandb_records
    assert "lingpack run summary" in proc.stdout


def test_multirun_two_jobs_and_sweep_summary(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_py(["-m", *FAST, "train.steps=2", "train.eval_every=0", "kernel=chunked_aligned", "kernel.max_segs=8,16",
                   "checkpoint.enabled=false", f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=${hydra.job.num}"],
                  tmp_path)
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and (p / "summary.json").exists())
    assert [p.name for p in jobs] == ["0", "1"]
    summaries = [json.loads((p / "summary.json").read_text()) for p in jobs]
    assert [s["max_segs"] for s in summaries] == [8, 16]
    # phantom overhead grows with the slots reserved: T_new/T = ceil((B*T + max_segs*63)/64)*64 / (B*T)
    assert summaries[0]["phantom_overhead"] < summaries[1]["phantom_overhead"]
    for job in jobs:
        assert "t_new_over_t" in offline_run_keys(job)
    assert "sweep summary (2 jobs)" in proc.stdout
    assert (sweep / "sweep_summary.csv").exists()


def test_bad_override_fails_with_the_key(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "kernel.name=fastest", "logger=none"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "kernel.name='fastest' is not one of" in proc.stderr + proc.stdout
