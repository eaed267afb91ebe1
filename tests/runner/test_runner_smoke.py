"""`run.py` end to end in a subprocess: a SIGTERM + resume that keeps one record per step, an overflowing
2-job sweep that still finishes with its summary, and one-line config errors."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.subprocess_env import xla_flags

ROOT = Path(__file__).resolve().parents[2]
# The smallest run that shows every behaviour: 2 layers (a dense and an MoE one; ling3_tiny has 4), 2 x 64 tokens.
FAST = ["train.log_every=1", "data.global_batch_size=2", "data.seq_length=64", "train.progress_bar=false",
        "checkpoint.save_every=2", "model.num_layers=2"]
ENV = dict(os.environ, WANDB_SILENT="true", WANDB_MODE="offline", JAX_PLATFORMS="cpu",
           XLA_FLAGS=xla_flags(1),
           PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))  # this tree's lingpack


def command(args, tmp_path):
    return [sys.executable, str(ROOT / "run.py"), *args, f"data.cache_dir={tmp_path / 'cache'}"]


def run_py(args, tmp_path, timeout=900, env=ENV):
    proc = subprocess.run(command(args, tmp_path), cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def offline_run_keys(run_dir: Path) -> str:
    """The bytes of the W&B offline run files (their records hold every logged key)."""
    files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert files, f"no W&B offline run under {run_dir}"
    return b"".join(f.read_bytes() for f in files).decode("latin-1")


def records(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow   # 35 s of the default suite; tests/train/test_train_loop.py resumes after SIGTERM in-process
def test_sigterm_then_resume_gives_one_record_per_step(tmp_path):
    run_dir = tmp_path / "run"
    args = [*FAST, "train.eval_every=2", "train.eval_batches=1", f"hydra.run.dir={run_dir}",
            f"distributed.compilation_cache_dir={tmp_path / 'xla'}",   # the rerun loads the first try's programs:
            "distributed.compilation_cache_min_compile_s=0", "optim.decay_steps=500"]   # one LR schedule, one program
    first = subprocess.Popen(command([*args, "train.steps=500"], tmp_path), cwd=tmp_path, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 900
    while not ((run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip()):
        assert first.poll() is None and time.time() < deadline, "the run ended before its first step was logged"
        time.sleep(0.2)
    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, out[-3000:] + err[-3000:]
    stopped = json.loads((run_dir / "summary.json").read_text())
    k = stopped["last_step"]
    assert stopped["status"] == "preempted" and 1 <= k < 500
    assert "packing_parity_rel" not in stopped and not (run_dir / "loss.png").exists()  # no checks after a signal
    console = out + err
    assert "[absl][INFO]" not in console and "| mfu" in console   # CPU: mfu against the measured matmul ceiling
    assert "mfu on CPU is approximate" in console
    assert console.count("step 1 | loss") == 1                      # one line per logged step
    assert console.count("compiling the train step ...") == 1 and console.count("compiled the train step in") == 1
    assert console.count("kernel chunked (chunk 64, segment-native)") == 1

    with open(run_dir / "metrics.jsonl", "a") as handle:   # as if a later try was killed after logging step k+1
        handle.write(json.dumps({"step": k + 1, "lm_loss": 99.0}) + "\n")
    # resumes from the checkpoint at step k; JAX_PLATFORMS unset, as a user runs it (JAX then probes for a TPU)
    quiet_env = {key: value for key, value in ENV.items() if key != "JAX_PLATFORMS"}
    proc = run_py([*args, f"train.steps={k + 2}"], tmp_path, env=quiet_env)
    logged = records(run_dir)
    assert [r["step"] for r in logged] == list(range(1, k + 3)) and logged[k]["lm_loss"] != 99.0
    for key in ("loss", "lm_loss", "grad_norm", "lr", "tokens", "tokens_per_s", "native_t_over_t",
                "dropped_documents", "dropped_tokens"):
        assert key in logged[-1], key
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == k + 2
    assert summary["first_lm_loss"] == logged[0]["lm_loss"] and summary["dropped_documents"] == 0
    # fp32 rounding alone (docs/parity.md#packing-parity): a few steps per token, exact sums of the tokens
    assert summary["packing_parity_rel"] < 1e-6 and summary["packing_parity_token_max_abs"] < 1e-5
    assert [r["step"] for r in logged if "val_lm_loss" in r] == list(range(2, k + 3, 2))  # both tries' evaluations
    assert summary["val_lm_loss"] > 0 and summary["test_lm_loss"] > 0 and summary["val_ppl"] > 1
    assert "on test set |" in proc.stdout
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "metrics.csv").read_text().count("\n") == k + 3   # header + one row per step
    run_ids = {p.name.rsplit("-", 1)[-1] for p in run_dir.glob("wandb/offline-run-*")}
    assert len(list(run_dir.glob("wandb/offline-run-*"))) == 2 and len(run_ids) == 1   # one W&B run, resumed
    assert "lm_loss" in offline_run_keys(run_dir) and "lingpack run summary" in proc.stdout
    # a quiet console: no JAX backend probing, no W&B banner or history, no Orbax restore warnings; the run
    # directory and the W&B run at start and end; the summary in labelled rows; labelled evaluations
    console = proc.stdout + proc.stderr
    for noise in ("Unable to initialize backend", "wandb:", "could not be restored", "[absl]", "[jax"):
        assert noise not in console, noise
    assert console.count(f"run directory: {run_dir}") == 2 and console.count("W&B offline run: ") == 2
    assert f"resumed from step {k} " in console
    after = proc.stdout.split("lingpack run summary")[1].splitlines()[1:]
    summary_rows = after[:next(i for i, row in enumerate(after) if not row.startswith("  "))]
    labels = [row.split()[0] for row in summary_rows if not row.startswith(" " * 14)]  # not a wrapped row's rest
    assert labels[:5] == ["run", "lm", "speed", "packing", "overflow"]
    assert max(len(row) for row in summary_rows) <= 120 and len(summary_rows) <= 12
    assert "(end of training: test batch" in console and "(periodic: valid batch" in console


def test_overflowing_sweep_finishes_with_its_summary(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_py(["-m", *FAST, "train.steps=2", "train.eval_every=0", "kernel=chunked_aligned", "kernel.max_segs=2,16",
                   "checkpoint.enabled=false", f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=${hydra.job.num}"],
                  tmp_path)
    jobs = [sweep / "0", sweep / "1"]
    for job in jobs:
        for name in ("summary.json", "metrics.csv", "loss.png"):
            assert (job / name).exists(), job / name
        assert "t_new_over_t" in offline_run_keys(job)
    tight, roomy = [json.loads((job / "summary.json").read_text()) for job in jobs]
    assert (tight["max_segs"], roomy["max_segs"]) == (2, 16)
    assert tight["dropped_documents"] > 0 and tight["dropped_tokens"] > 0 and roomy["dropped_documents"] == 0
    assert tight["packing_parity_rel"] < 1e-6   # the documents that trained match their per-document losses
    # phantom overhead grows with the slots reserved: T_new/T = ceil((B*T + max_segs*63)/64)*64 / (B*T)
    assert tight["phantom_overhead"] < roomy["phantom_overhead"]
    assert "sweep summary (2 jobs)" in proc.stdout
    header = (sweep / "sweep_summary.csv").read_text().splitlines()[0]
    assert "max_segs,phantom_overhead,dropped_documents,dropped_tokens,tokens_per_s" in header


def one_line_error(args, cwd, env=ENV) -> str:
    """run.py's output for a config it cannot run: exactly one line, `Error: ...`, status 1."""
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), *args, "logger=none"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("Error: "), lines
    return lines[0]


# The default suite's one-line case is test_too_few_devices_is_one_line_naming_the_key (a ConfigError raised once
# JAX is up); these raise earlier, from the config build, which tests/runner/test_runner_config.py and
# tests/data/test_data_budget.py check in-process.
@pytest.mark.parametrize("override,message", [
    pytest.param("train.steps=-1", "TrainConfig.steps=-1 must be >= 1", marks=pytest.mark.slow),
    pytest.param("kernel.name=fastest", "kernel.name='fastest' is not one of", marks=pytest.mark.slow),
    pytest.param("model.num_layers=0", "num_layers must be >= 1", marks=pytest.mark.slow),
    pytest.param("kernel.max_segs=0", "kernel.max_segs=0 must be >= 1", marks=pytest.mark.slow),
    pytest.param("parallel=context data.seq_length=100", "data.seq_length=100 does not divide into 8 chunks",
                 marks=pytest.mark.slow),
])
def test_config_error_is_one_line(tmp_path, override, message):
    assert message in one_line_error(override.split(), tmp_path)


def test_wrong_group_option_is_one_line_with_hydras_options(tmp_path):
    """Hydra's own composition error, before JAX starts: its list of options, not its config search path."""
    assert one_line_error(["model=ling3_tny"], tmp_path) == (
        "Error: model=ling3_tny: no such option; choose one of ling3_flagship, ling3_small, ling3_tiny; did you "
        "mean model=ling3_tiny?")


def test_too_few_devices_is_one_line_naming_the_key(tmp_path):
    """parallel.cpu_devices gives the process its fake CPU devices before JAX starts (2 here, no count in
    XLA_FLAGS); a mesh that needs more is one line naming the key to set."""
    flags = " ".join(f for f in ENV["XLA_FLAGS"].split() if "device_count" not in f)
    line = one_line_error(["parallel.tensor=3", "parallel.cpu_devices=2"], tmp_path, env=dict(ENV, XLA_FLAGS=flags))
    assert line == ("Error: parallel: the mesh data=1 x fsdp=1 x tensor=3 x expert=1 x context=1 needs 3 devices, but "
                    "this run has 2 cpu devices; set parallel.cpu_devices=3 (fake CPU devices), or set one axis to -1 "
                    "('the rest') or make the axes multiply to 2")


@pytest.mark.slow
def test_truncated_data_file_is_one_line(tmp_path):
    """A data file cut short (a failed copy): named with the fix in one line, before any training starts."""
    from lingpack.data.corpus import bundled_corpus_prefix
    prefix = bundled_corpus_prefix(str(tmp_path / "corpus"), "scene")
    data = Path(prefix + ".bin").read_bytes()
    Path(prefix + ".bin").write_bytes(data[: len(data) // 2])
    line = one_line_error(["data=megatron", f"data.paths=[{prefix}]"], tmp_path)
    assert line.startswith(f"Error: {prefix}.bin: truncated data file: {len(data) // 2} bytes") and "re-copy" in line
