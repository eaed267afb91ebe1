"""The README's quickstart block (between `<!-- quickstart -->` and `<!-- /quickstart -->`) runs as written on
the corpus its own preprocess command makes: every command in the default suite (in-process, the run's config
built but not trained), the whole block through bash in `make test-all`.

The compare step reads a Megatron-LM log of a run on the same data, which the quickstart's user brings; the
tests write one at the path the block names, with the losses lingpack's run logged (so parity must hold).
"""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
START, END = "<!-- quickstart -->", "<!-- /quickstart -->"
ACTIVATE = ". .venv/bin/activate"   # the block's first line: the tests put this interpreter first on PATH instead


def quickstart_commands() -> list[str]:
    """The block's commands after its activation of `make run`'s .venv, continuation lines joined, comments
    dropped."""
    text = (ROOT / "README.md").read_text()
    if START not in text:
        pytest.skip(f"README.md has no {START} block")
    block = text.split(START, 1)[1].split(END, 1)[0]
    body = re.search(r"```(?:bash|sh)?\n(.*?)```", block, re.S)
    assert body, f"the {START} block holds no fenced code block"
    joined = re.sub(r"\\\n\s*", " ", body.group(1))
    lines = [line.split("#")[0].strip() if line.startswith(ACTIVATE) else line.strip() for line in joined.splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")]
    assert commands[0] == ACTIVATE, f"the block starts with {ACTIVATE} (bare `python` is the venv's only then)"
    return commands[1:]


def checkout_view(tmp_path: Path) -> Path:
    """A working directory where the block's relative paths mean what they mean in the checkout."""
    for name in ("run.py", "conf", "src"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def write_megatron_log(run_dir: Path, path: Path) -> None:
    """Megatron-LM's `training_log` lines with the run's own per-step lm loss."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    total = records[-1]["step"]
    path.write_text("".join(f" iteration {r['step']:8d}/{total:8d} | consumed samples: {8 * r['step']:12d} | "
                            f"lm loss: {r['lm_loss']:.6E} |\n" for r in records))


def megatron_log_of(commands: list[str]) -> str:
    return shlex.split(commands[-1])[shlex.split(commands[-1]).index("--megatron-log") + 1]


def test_quickstart_commands_in_process(tmp_path, monkeypatch, capsys):
    """Each command of the block as written: preprocess and stats run, the run's config builds on that data."""
    from lingpack import config as config_lib
    from lingpack.data import preprocess, stats
    from lingpack.tracking import compare, megatron_args
    commands = quickstart_commands()
    heads = [" ".join(shlex.split(c)[:3 if shlex.split(c)[1] == "-m" else 2]) for c in commands]
    assert heads == ["python -m lingpack.data.preprocess", "python -m lingpack.data.stats", "python run.py",
                     "python -m lingpack.tracking.megatron_args", "python -m lingpack.tracking.compare"]
    monkeypatch.chdir(checkout_view(tmp_path))
    assert preprocess.main(shlex.split(commands[0])[3:]) == 0
    assert stats.main(shlex.split(commands[1])[3:]) == 0
    assert "recommend kernel.max_segs=" in capsys.readouterr().out
    words = shlex.split(commands[2])[2:]
    run_dir = next(w.split("=", 1)[1] for w in words if w.startswith("hydra.run.dir="))
    rc = config_lib.build(config_lib.compose([w for w in words if not w.startswith("hydra.")], run_dir=run_dir),
                          run_dir)
    assert rc.data.paths == ("data/shakespeare",) and (rc.data.vocab_size, rc.data.eod_id) == (258, 256)
    assert rc.data.num_samples == rc.train.steps * rc.data.global_batch_size
    megatron_words = shlex.split(commands[3])[3:]
    assert megatron_words[-2] == ">" and megatron_words[:-2] == [w for w in words if not w.startswith("hydra.")]
    assert megatron_args.main(megatron_words[:-2]) == 0   # the command of the run above, printed
    assert "    --data-path data/shakespeare \\\n" in capsys.readouterr().out
    compare_args = compare.build_parser().parse_args(shlex.split(commands[4])[3:])
    assert compare_args.run == run_dir


@pytest.mark.slow
def test_quickstart_block_runs_as_written(tmp_path):
    """The whole block through bash with this checkout's python first on PATH: trains, then compares."""
    commands = quickstart_commands()
    cwd = checkout_view(tmp_path)
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
               WANDB_MODE="offline", JAX_PLATFORMS="cpu")
    for command in commands:
        if command.startswith("python -m lingpack.tracking.compare"):
            run_dir = cwd / shlex.split(command)[shlex.split(command).index("--run") + 1]
            write_megatron_log(run_dir, cwd / megatron_log_of(commands))
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=1200)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_lm_loss"] < summary["first_lm_loss"]
    assert json.loads((run_dir / "parity" / "parity_summary.json").read_text())["passed"]
