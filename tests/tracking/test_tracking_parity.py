"""Parity against hand-computed values, and the compare CLI end to end in a subprocess."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from lingpack.tracking.parity import compute_parity, log_interval


def test_pointwise_parity_hand_computed():
    megatron = {1: 10.0, 2: 8.0, 3: 6.0, 4: 5.0}
    lingpack = {1: 10.0005, 2: 8.0, 3: 6.06, 5: 4.0}
    result = compute_parity(megatron, lingpack, tolerance=1e-4, window=2)
    assert [r.step for r in result.rows] == [1, 2, 3]
    assert [r.abs_diff for r in result.rows] == pytest.approx([5e-4, 0.0, 0.06])
    assert [r.rel_diff for r in result.rows] == pytest.approx([5e-5, 0.0, 0.01])
    assert [r.exceeds for r in result.rows] == [False, False, True]
    assert result.first_failure.step == 3 and not result.passed
    assert result.only_megatron == [4] and result.only_lingpack == [5]
    assert result.max_rel == pytest.approx(0.01) and result.mean_rel == pytest.approx((5e-5 + 0.01) / 3)
    # windows of 2 steps: [1, 2] and [3, 4]
    assert [(w["start"], w["end"], w["n"]) for w in result.windows] == [(1, 2, 2), (3, 4, 1)]
    assert result.windows[0]["max_abs"] == pytest.approx(5e-4)
    assert result.windows[0]["mean_rel"] == pytest.approx(2.5e-5)
    assert result.windows[1]["max_rel"] == pytest.approx(0.01)
    assert result.summary()["first_failed_step"] == 3


def test_tolerance_boundary_and_nonfinite_fail():
    ok = compute_parity({1: 2.0}, {1: 2.0002}, tolerance=1e-4)
    assert ok.rows[0].rel_diff == pytest.approx(1e-4)
    assert compute_parity({1: 2.0}, {1: 2.00021}, tolerance=1e-4).rows[0].exceeds
    nan = compute_parity({1: 2.0, 2: 1.0}, {1: 2.0, 2: math.nan}, tolerance=1e-4)
    assert nan.rows[1].exceeds and math.isinf(nan.rows[1].rel_diff) and nan.first_failure.step == 2


def test_interval_average_matches_megatron_log_interval():
    # Megatron logged every 5 iterations, averaging (s-5, s]; lingpack logged every step.
    lingpack = {s: 10.0 - 0.1 * s for s in range(1, 11)}
    megatron = {5: sum(10.0 - 0.1 * s for s in range(1, 6)) / 5,
                10: sum(10.0 - 0.1 * s for s in range(6, 11)) / 5}
    assert log_interval(megatron) == 5
    result = compute_parity(megatron, lingpack, tolerance=1e-9)
    assert result.passed and [r.lingpack_n for r in result.rows] == [5, 5]
    assert result.rows[0].lingpack == pytest.approx(9.7)
    pointwise = compute_parity(megatron, lingpack, tolerance=1e-9, mode="pointwise")
    assert not pointwise.passed and pointwise.rows[0].lingpack == pytest.approx(9.5)
    # lingpack logging at Megatron's own interval: nothing to average, pointwise
    sparse = compute_parity(megatron, {5: 9.7, 10: 9.2}, tolerance=1e-9)
    assert [r.lingpack_n for r in sparse.rows] == [1, 1] and sparse.passed


def test_step_offset_and_bad_arguments():
    result = compute_parity({1: 3.0, 2: 2.0}, {0: 3.0, 1: 2.0}, step_offset=1)
    assert [r.step for r in result.rows] == [1, 2] and result.passed
    with pytest.raises(ValueError, match="tolerance"):
        compute_parity({1: 1.0}, {1: 1.0}, tolerance=-1)
    with pytest.raises(ValueError, match="mode"):
        compute_parity({1: 1.0}, {1: 1.0}, mode="nearest")


MEGATRON_LOG = "".join(
    f" [2025-01-01 00:00:{s:02d}] iteration {s:8d}/      20 | consumed samples: {8 * s:12d} | "
    f"elapsed time per iteration (ms): 100.0 | learning rate: 1.000000E-04 | global batch size:     8 | "
    f"lm loss: {10.0 - 0.25 * s:.6E} | loss scale: 1.0 | grad norm: 1.000 | "
    f"number of skipped iterations:   0 | number of nan iterations:   0 |\n"
    for s in range(1, 21)
)


def _run_dir(tmp_path, perturb_step=None):
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as handle:
        for s in range(1, 21):
            loss = 10.0 - 0.25 * s + (0.01 if s == perturb_step else 0.0)
            handle.write(json.dumps({"step": s, "lm_loss": loss, "tokens": 8 * 64 * s}) + "\n")
    return run


def _compare(*args):
    return subprocess.run([sys.executable, "-m", "lingpack.tracking.compare", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_compare_cli_passes(tmp_path):
    log = tmp_path / "megatron.log"
    log.write_text("> noise\n" + MEGATRON_LOG)
    run = _run_dir(tmp_path)
    out = tmp_path / "out"
    proc = _compare("--megatron-log", log, "--run", run, "--out", out, "--tolerance", "1e-6")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PARITY OK: all 20 aligned steps" in proc.stdout
    assert "step" in proc.stdout and "megatron" in proc.stdout and "rel" in proc.stdout
    assert (out / "parity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "parity.csv").read_text().count("\n") == 21
    summary = json.loads((out / "parity_summary.json").read_text())
    assert summary["passed"] and summary["aligned_steps"] == 20


def test_compare_cli_fails_and_logs_baseline_offline(tmp_path, monkeypatch):
    log = tmp_path / "megatron.log"
    log.write_text(MEGATRON_LOG)
    run = _run_dir(tmp_path, perturb_step=7)
    monkeypatch.setenv("WANDB_SILENT", "true")
    proc = _compare("--megatron-log", log, "--run", run, "--wandb-mode", "offline",
                    "--wandb-dir", tmp_path / "wb", "--seq-length", "64")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "PARITY FAILED: 1 of 20 aligned steps exceed rel tolerance 0.0001; first at step 7" in proc.stdout
    assert "FAIL" in proc.stdout.split("PARITY FAILED")[0]  # the failing row is flagged in the table
    rows = (run / "parity" / "parity.csv").read_text().splitlines()
    assert rows[7].startswith("7,") and rows[7].endswith(",1")
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and b"lm_loss" in runs[0].read_bytes() and b"baseline" in runs[0].read_bytes()


def test_compare_cli_bad_input(tmp_path):
    (tmp_path / "empty.log").write_text("nothing to see\n")
    run = _run_dir(tmp_path)
    proc = _compare("--megatron-log", tmp_path / "empty.log", "--run", run)
    assert proc.returncode == 2 and "no Megatron iteration lines" in proc.stderr
    (tmp_path / "megatron.log").write_text(MEGATRON_LOG)
    proc = _compare("--megatron-log", tmp_path / "megatron.log", "--run", tmp_path / "nowhere")
    assert proc.returncode == 2 and "no metrics file" in proc.stderr


def test_compare_cli_aligns_validation_losses(tmp_path):
    # Megatron's periodic, end-of-run validation and test lines, as lingpack's evaluate.megatron_line writes them.
    from lingpack.train.evaluate import eval_metrics, megatron_line

    def line(prefix, loss, key="val"):
        stats = {"lm_sum": loss, "lm_tokens": 1.0, "mtp_sum": np.zeros(0), "mtp_tokens": np.zeros(0),
                 "moe_z_sum": np.zeros(0), "moe_z_tokens": np.zeros(0)}
        return megatron_line(prefix, eval_metrics(stats, key), key=key) + "\n"

    log = tmp_path / "megatron.log"
    log.write_text(MEGATRON_LOG + line("iteration 10", 7.5) + line("iteration 20", 5.25)
                   + line("iteration 20 on validation set", 5.0) + line("iteration 20 on test set", 5.5, "test"))
    run = _run_dir(tmp_path)
    records = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    records[9]["val_lm_loss"], records[19]["val_lm_loss"] = 7.5, 5.25 * (1 + 3e-4)  # step 20 drifts
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "summary.json").write_text(json.dumps({"val_lm_loss": 5.0, "test_lm_loss": 5.5}))
    proc = _compare("--megatron-log", log, "--run", run)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "PARITY OK" not in proc.stdout  # training parity holds, but validation fails the run
    assert "VALIDATION PARITY FAILED: 1 of 4 evaluations" in proc.stdout
    rows = (run / "parity" / "validation_parity.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["step 10", "step 20", "end valid", "end test"]
    assert [r.split(",")[-1] for r in rows[1:]] == ["False", "True", "False", "False"]
    summary = json.loads((run / "parity" / "parity_summary.json").read_text())
    assert summary["passed"] and summary["validation"]["failed_steps"] == 1
