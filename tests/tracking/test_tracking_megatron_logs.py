"""Megatron-LM text logs (several versions' formats) and W&B history exports -> lingpack records."""

import json
import math

import pytest

from lingpack.tracking.megatron_logs import (load_baseline, normalize_key, parse_text_log,
                                             parse_wandb_export, series)

# 2019-2020 (megatron/training.py): no consumed samples, no grad norm, learning rate .3E. A skipped
# interval (fp16 overflow) prints no loss because the average 0.0 fails Megatron's `avg > 0.0`.
LOG_2020 = """\
using world size: 8, data-parallel-size: 8, tensor-model-parallel size: 1
> building GPT2 model ...
time (ms) | forward: 120.31 | backward: 250.12 | optimizer: 12.01 | batch generator: 1.20
 iteration       10/    1000 | elapsed time per iteration (ms): 512.3 | learning rate: 1.500E-04 | lm loss: 1.034567E+01 | loss scale: 4096.0 | number of skipped iterations:   0 | number of nan iterations:   0 |
 iteration       20/    1000 | elapsed time per iteration (ms): 498.1 | learning rate: 1.500E-04 | loss scale: 2048.0 | number of skipped iterations:  10 | number of nan iterations:   0 |
WARNING: overflow detected, skipping iteration
 iteration       30/    1000 | elapsed time per iteration (ms): 501.0 | learning rate: 1.500E-04 | lm loss: 9.876543E+00 | loss scale: 2048.0 | number of skipped iterations:   0 | number of nan iterations:   0 |
"""

# 2021-2023 under torchrun --tee (`[default0]:` prefixes): consumed samples, grad norm, num zeros,
# params norm; a NaN interval (grad norm nan, no loss printed).
LOG_2022 = """\
[default0]:> finished creating GPT datasets ...
[default0]:[after dataloaders are built] datetime: 2022-06-01 10:00:00
[default0]: iteration        1/     100 | consumed samples:           32 | elapsed time per iteration (ms): 9876.5 | learning rate: 6.000E-05 | global batch size:    32 | lm loss: 1.098765E+01 | loss scale: 1.0 | grad norm: 12.345 | num zeros: 0.0 | params norm: 234.567 | number of skipped iterations:   0 | number of nan iterations:   0 |
[default0]: iteration        2/     100 | consumed samples:           64 | elapsed time per iteration (ms): 812.0 | learning rate: 1.200E-04 | global batch size:    32 | lm loss: 1.087654E+01 | loss scale: 1.0 | grad norm: 10.001 | num zeros: 0.0 | params norm: 234.570 | number of skipped iterations:   0 | number of nan iterations:   0 |
[default1]:/usr/lib/python3/dist-packages/torch/functional.py:123: UserWarning: something deprecated
[default0]: iteration        3/     100 | consumed samples:           96 | elapsed time per iteration (ms): 811.9 | learning rate: 1.800E-04 | global batch size:    32 | loss scale: 1.0 | grad norm: nan | num zeros: 0.0 | params norm: 234.571 | number of skipped iterations:   1 | number of nan iterations:   1 |
[default0]: iteration        4/     100 | consumed samples:          128 | elapsed time per iteration (ms): 810.5 | learning rate: 2.400E-04 | global batch size:    32 | lm loss: 1.065432E+01 | loss scale: 1.0 | grad norm: 8.765 | num zeros: 0.0 | params norm: 234.600 | number of skipped iterations:   0 | number of nan iterations:   0 |
"""

# 2024 (megatron/training/training.py): timestamp prefix, throughput; a truncated line from a killed job.
LOG_2024 = """\
 [2024-05-02 10:11:12] iteration       10/    1000 | consumed samples:          640 | elapsed time per iteration (ms): 1234.5 | throughput per GPU (TFLOP/s/GPU): 145.2 | learning rate: 3.000E-04 | global batch size:    64 | lm loss: 1.023400E+01 | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |
[Rank 0] (after 10 iterations) memory (MB) | allocated: 1234.5 | max allocated: 2345.6 | reserved: 3000.0 | max reserved: 3000.0
 [2024-05-02 10:11:24] iteration       20/    1000 | consumed samples:         1280 | elapsed time per iteration (ms): 1200.1 | throughput per GPU (TFLOP/s/GPU): 149.0 | learning rate: 3.000E-04 | global batch size:    64 | lm loss: 9.512300E+00 | loss scale: 1.0 | grad norm: 0.987 | number of skipped iterations:   0 | number of nan iterations:   0 |
 [2024-05-02 10:11:36] iteration       30/    1000 | consumed samples:         1920 | elapsed time per
"""

# 2025+ under `srun -l` (`0: ` prefixes): microsecond timestamps, lr .6E, MoE and MTP losses, a
# validation line, an all-skipped interval printing `lm loss: 0.000000E+00`, and a restart that
# re-logs iteration 3 from the last checkpoint.
LOG_2025 = """\
0: [WARNING  | megatron.core.transformer.moe] moe_router_topk is deprecated
0:  [2025-09-01 12:00:00.123456] iteration        1/      10 | consumed samples:            8 | elapsed time per iteration (ms): 3210.4 | throughput per GPU (TFLOP/s/GPU): 12.3 | learning rate: 1.000000E-04 | global batch size:     8 | lm loss: 1.200000E+01 | load_balancing_loss: 1.012345E+00 | mtp_1 loss: 1.210000E+01 | mtp_2 loss: 1.230000E+01 | loss scale: 1.0 | grad norm: 5.000 | number of skipped iterations:   0 | number of nan iterations:   0 |
0:  [2025-09-01 12:00:03.123456] iteration        2/      10 | consumed samples:           16 | elapsed time per iteration (ms): 3001.0 | throughput per GPU (TFLOP/s/GPU): 13.1 | learning rate: 2.000000E-04 | global batch size:     8 | lm loss: 0.000000E+00 | loss scale: 65536.0 | number of skipped iterations:   1 | number of nan iterations:   0 |
0:  [2025-09-01 12:00:06.123456] iteration        3/      10 | consumed samples:           24 | elapsed time per iteration (ms): 3002.0 | throughput per GPU (TFLOP/s/GPU): 13.0 | learning rate: 3.000000E-04 | global batch size:     8 | lm loss: 1.100000E+01 | load_balancing_loss: 1.01 | mtp_1 loss: 1.110000E+01 | mtp_2 loss: 1.130000E+01 | loss scale: 1.0 | grad norm: 4.000 | number of skipped iterations:   0 | number of nan iterations:   0 |
0: ------------------------------------------------------------------------------------------
0:  validation loss at iteration 3 | lm loss value: 1.105000E+01 | lm loss PPL: 6.296538E+04 |
0: ------------------------------------------------------------------------------------------
0: saving checkpoint at iteration       3 to /ckpt in torch_dist format
0: loading checkpoint from /ckpt at iteration 3
0:  validation loss at the end of training for val data | lm loss value: 1.104000E+01 | lm loss PPL: 6.233893E+04 |
0:  [2025-09-01 12:10:00.000001] iteration        3/      10 | consumed samples:           24 | elapsed time per iteration (ms): 2999.0 | throughput per GPU (TFLOP/s/GPU): 13.0 | learning rate: 3.000000E-04 | global batch size:     8 | lm loss: 1.100001E+01 | load_balancing_loss: 1.01 | mtp_1 loss: 1.110000E+01 | mtp_2 loss: 1.130000E+01 | loss scale: 1.0 | grad norm: 4.000 | number of skipped iterations:   0 | number of nan iterations:   0 |
"""


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_2020_format_without_consumed_samples_or_grad_norm(tmp_path):
    run = parse_text_log(_write(tmp_path, "train.log", LOG_2020))
    assert [r["step"] for r in run.records] == [10, 20, 30]
    first = run.records[0]
    assert first["lm_loss"] == pytest.approx(10.34567)
    assert first["lr"] == pytest.approx(1.5e-4)
    assert first["loss_scale"] == 4096.0 and first["iter_time_ms"] == pytest.approx(512.3)
    assert "grad_norm" not in first and "tokens" not in first
    assert "lm_loss" not in run.records[1] and run.records[1]["skipped_iterations"] == 10
    assert run.report.skipped_loss_steps == [20]
    assert run.report.iteration_lines == 3 and run.report.lines == 7 and not run.report.malformed
    assert run.train_iters == 1000
    assert series(run.records) == {10: pytest.approx(10.34567), 30: pytest.approx(9.876543)}


def test_2022_rank_prefixed_format_with_nan_grad_norm(tmp_path):
    run = parse_text_log(_write(tmp_path, "train.log", LOG_2022), seq_length=2048)
    assert [r["step"] for r in run.records] == [1, 2, 3, 4]
    assert run.records[1]["tokens"] == 64 * 2048 and run.records[1]["consumed_samples"] == 64
    assert run.records[0]["grad_norm"] == pytest.approx(12.345)
    assert run.records[0]["params_norm"] == pytest.approx(234.567)
    nan_step = run.records[2]
    assert math.isnan(nan_step["grad_norm"]) and nan_step["nan_iterations"] == 1
    assert "lm_loss" not in nan_step and run.report.skipped_loss_steps == [3]
    assert run.records[3]["global_batch_size"] == 32


def test_2024_timestamped_format_and_truncated_line_is_reported(tmp_path):
    run = parse_text_log(_write(tmp_path, "train.log", LOG_2024), seq_length=4096)
    assert [r["step"] for r in run.records] == [10, 20, 30]
    assert run.records[0]["tflops_per_gpu"] == pytest.approx(145.2)
    assert run.records[0]["tokens"] == 640 * 4096
    assert run.records[1]["lm_loss"] == pytest.approx(9.5123)
    # the truncated line keeps what it has, reports the broken field and the missing loss
    assert run.records[2] == {"step": 30, "consumed_samples": 1920, "tokens": 1920 * 4096}
    assert run.report.malformed == [(4, "unreadable field 'elapsed time per'")]
    assert run.report.skipped_loss_steps == [30]
    assert "malformed" in run.report.describe() and "line 4" in run.report.describe()


def test_2025_format_moe_mtp_validation_skipped_and_restart(tmp_path):
    run = parse_text_log(_write(tmp_path, "train.log", LOG_2025), seq_length=1024)
    steps = {r["step"]: r for r in run.records}
    assert sorted(steps) == [1, 2, 3]
    assert steps[1]["mtp_1_loss"] == pytest.approx(12.1) and steps[1]["mtp_2_loss"] == pytest.approx(12.3)
    assert steps[1]["mtp_loss"] == pytest.approx((12.1 + 12.3) / 2)
    assert steps[1]["load_balancing_loss"] == pytest.approx(1.012345)
    assert steps[3]["load_balancing_loss"] == pytest.approx(1.01)  # the newer `.2f` MoE format
    assert steps[1]["lr"] == pytest.approx(1e-4) and steps[1]["tokens"] == 8 * 1024
    # the all-skipped interval's `lm loss: 0.0` is the reset accumulator, not a loss
    assert "lm_loss" not in steps[2] and run.report.skipped_loss_steps == [2]
    # the restart re-logged iteration 3: the last one wins, and the repeat is reported
    assert steps[3]["lm_loss"] == pytest.approx(11.00001) and run.report.duplicate_steps == [3]
    assert run.validation == [{"step": 3, "val_lm_loss": pytest.approx(11.05),
                               "val_lm_loss_ppl": pytest.approx(62965.38)}]
    assert run.report.validation_lines == 1 and run.report.other_validation_lines == [10]
    assert "1 validation lines without an iteration" in run.report.describe()


def test_log_without_iteration_lines_names_file_and_fix(tmp_path):
    path = _write(tmp_path, "empty.log", "> building model\nWARNING: nothing here\n")
    with pytest.raises(ValueError, match=r"empty\.log: no Megatron iteration lines found in 2 lines"):
        parse_text_log(path)
    with pytest.raises(FileNotFoundError, match="missing.log"):
        load_baseline(tmp_path / "missing.log")


def test_normalize_key():
    assert normalize_key("lm loss") == "lm_loss"
    assert normalize_key("learning-rate") == "lr"
    assert normalize_key("mtp_3 loss") == "mtp_3_loss"
    assert normalize_key("throughput per GPU (TFLOP/s/GPU)") == "tflops_per_gpu"
    assert normalize_key("Some New Metric (ms)") == "some_new_metric_ms"


WANDB_CSV = """\
_step,lm loss,learning-rate,grad-norm,samples vs steps,mtp_1 loss,_runtime,_timestamp,lm loss vs samples
1,10.5,1e-4,3.0,8,10.9,12.0,1700000000,
1,,,,,,,,
2,10.25,2e-4,2.5,16,10.7,24.0,1700000012,
3,NaN,3e-4,nan,24,,36.0,1700000024,
"""

# the W&B UI panel export: `<run name> - <key>` columns plus __MIN/__MAX envelopes
WANDB_UI_CSV = """\
Step,"megatron-base - lm-loss-training/lm loss","megatron-base - lm-loss-training/lm loss__MIN","megatron-base - lm-loss-training/lm loss__MAX"
10,9.5,9.5,9.5
20,9.0,9.0,9.0
"""


def test_wandb_csv_export(tmp_path):
    run = load_baseline(_write(tmp_path, "history.csv", WANDB_CSV), seq_length=100)
    assert [r["step"] for r in run.records] == [1, 2, 3]
    first = run.records[0]
    assert first == {"step": 1, "lm_loss": 10.5, "lr": 1e-4, "grad_norm": 3.0, "consumed_samples": 8,
                     "mtp_1_loss": 10.9, "mtp_loss": 10.9, "tokens": 800}
    assert math.isnan(run.records[2]["lm_loss"])
    assert set(run.report.ignored_columns) == {"_runtime", "_timestamp", "lm loss vs samples"}


def test_wandb_ui_panel_csv_export(tmp_path):
    run = load_baseline(_write(tmp_path, "panel.csv", WANDB_UI_CSV))
    assert series(run.records) == {10: 9.5, 20: 9.0}
    assert len(run.report.ignored_columns) == 2


@pytest.mark.parametrize("layout", ["records", "jsonl", "split", "columns"])
def test_wandb_json_exports(tmp_path, layout):
    rows = [{"_step": 5, "iteration": 5, "lm-loss-training/lm loss": 8.5, "learning-rate": 1e-4},
            {"_step": 10, "iteration": 10, "lm-loss-training/lm loss": 8.0, "learning-rate": 2e-4}]
    if layout == "records":
        text = json.dumps(rows)
    elif layout == "jsonl":
        text = "\n".join(json.dumps(r) for r in rows) + "\n"
    elif layout == "split":
        columns = list(rows[0])
        text = json.dumps({"columns": columns, "index": [0, 1], "data": [[r[c] for c in columns] for r in rows]})
    else:
        text = json.dumps({c: {str(i): r[c] for i, r in enumerate(rows)} for c in rows[0]})
    run = load_baseline(_write(tmp_path, f"history.{'jsonl' if layout == 'jsonl' else 'json'}", text))
    assert [(r["step"], r["lm_loss"], r["lr"]) for r in run.records] == [(5, 8.5, 1e-4), (10, 8.0, 2e-4)]


def test_sniffing_without_extension(tmp_path):
    assert load_baseline(_write(tmp_path, "log", LOG_2024)).records[0]["step"] == 10
    assert load_baseline(_write(tmp_path, "export", WANDB_CSV)).records[0]["step"] == 1
    with pytest.raises(ValueError, match="no step column"):
        parse_wandb_export(_write(tmp_path, "bad.csv", "a,b\n1,2\n"))


def test_end_of_run_validation_and_test_lines(tmp_path):
    # megatron/training/training.py: "iteration N on validation set" / "iteration N on test set" after training.
    text = LOG_2025.splitlines()[1] + "\n" + "\n".join([
        " validation loss at iteration 1 | lm loss value: 1.190000E+01 | lm loss PPL: 1.468864E+05 |",
        " validation loss at iteration 1 on validation set | lm loss value: 1.180000E+01 | lm loss PPL: 1.3e+05 |",
        " validation loss at iteration 1 on test set | lm loss value: 1.170000E+01 | lm loss PPL: 1.2e+05 |"])
    run = parse_text_log(_write(tmp_path, "train.log", text))
    assert [r["val_lm_loss"] for r in run.validation] == [11.9, 11.8]
    assert [r.get("final", False) for r in run.validation] == [False, True]
    assert run.test == [{"step": 1, "test_lm_loss": 11.7, "test_lm_loss_ppl": 1.2e5}]
