"""experiments/hardware_step/bench.py: a CPU dry run measures the real step, labels it CPU, reads a plan beside it."""

import json

from experiments.hardware_step import bench


def test_dry_run_on_cpu_measures_and_sits_beside_the_plan(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"compiler": "xla_tpu", "est_step_s": 0.5, "per_device_bytes": 2 ** 30, "other": 1}))
    out = tmp_path / "bench.json"
    assert bench.main(["--dry-run", "--plan", str(plan), "--out", str(out), "model=ling3_tiny", "data=synthetic",
                       "data.global_batch_size=2", "data.seq_length=64"]) == 0
    got = json.loads(out.read_text())
    assert got["platform"] == "cpu" and got["measured_on"].startswith("CPU") and "not a TPU or GPU" in got["measured_on"]
    m = got["measured"]
    assert m["steps"] == 2 and len(m["step_s"]) == 2 and m["median_step_s"] > 0
    assert m["tokens_per_s"] == 2 * 64 / m["median_step_s"]
    assert got["analytic"]["step_flops"] > 0 and 0 < m["mfu"]
    assert got["planned"] == {"compiler": "xla_tpu", "est_step_s": 0.5, "per_device_bytes": 2 ** 30, "path": str(plan)}
    assert got["measured_over_planned"]["step_s"] == m["median_step_s"] / 0.5
    assert got["config"]["rows"] == 2 and got["config"]["seq_length"] == 64
