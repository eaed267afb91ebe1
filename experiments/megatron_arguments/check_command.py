"""Megatron-LM's own checks of the commands `python -m lingpack.tracking.megatron_args` prints.

    python -m experiments.megatron_arguments.check_command --megatron /path/to/Megatron-LM [--refs main dev]

For each config in CONFIGS, the printed pretrain_gpt.py arguments are parsed by Megatron-LM's parser at each
ref, passed through its `validate_args` and turned into its transformer config (collect.py --check, on CPU);
results/check_command.json records the commits, the commands and what each ref made of them. Building the
model itself needs Transformer Engine and a GPU, so that step is not run here.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments import provenance
from experiments.megatron_arguments.list_arguments import git
from lingpack.tracking import megatron_args

HERE = Path(__file__).resolve().parent
CONFIGS = {
    "default": [],
    "bf16_per_token_blend": ["model.dtype=bfloat16", "loss=per_token", "data.paths=[0.3,bundled,0.7,bundled:scene]",
                             "train.micro_batches=2"],
    "mla_only_normalised_topk": ["model.inhomogeneous_layer_cycle_interval=1", "model.moe.norm_topk_prob=true"],
    "ling3_small": ["model=ling3_small"],
    "ling3_flagship": ["model=ling3_flagship"],
}


def arguments_of(overrides: list[str]) -> tuple[str, list[str]]:
    """(the printed output, the pretrain_gpt.py arguments) of megatron_args for `overrides`."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert megatron_args.main(overrides) == 0, overrides
    text = out.getvalue()
    body = " ".join(line.rstrip("\\\\").strip() for line in text.splitlines() if not line.startswith("#"))
    words = shlex.split(body)
    return text, words[words.index("pretrain_gpt.py") + 1:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", required=True)
    parser.add_argument("--refs", nargs="+", default=["main", "dev"])
    args = parser.parse_args(argv)
    commands = {name: arguments_of(overrides) for name, overrides in CONFIGS.items()}
    results = {"commit": provenance.commit(), "refs": {}, "configs": {k: v for k, v in CONFIGS.items()},
               "commands": {name: " ".join(shlex.quote(w) for w in words) for name, (_, words) in commands.items()},
               "checks": {}}
    for ref in args.refs:
        commit = git(args.megatron, "rev-parse", ref, text=True).stdout.strip()
        results["refs"][ref] = f"NVIDIA/Megatron-LM@{commit}"
        with tempfile.TemporaryDirectory() as tree:
            archive = git(args.megatron, "archive", commit, "megatron").stdout
            subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
            env = dict(os.environ, PYTHONPATH=tree, PYTHONWARNINGS="ignore")
            for name, (_, words) in commands.items():
                flags = Path(tree) / f"{name}.args"
                flags.write_text(" ".join(shlex.quote(w) for w in words))
                out = subprocess.run([sys.executable, str(HERE / "collect.py"), "--check", str(flags)], env=env,
                                     cwd=tree, capture_output=True, text=True)
                lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
                check = json.loads(lines[-1]) if lines else {"validate_args": "failed", "error": out.stderr[-2000:]}
                results["checks"].setdefault(name, {})[ref] = check
                print(f"{ref:5s} {name:26s} {check['validate_args']} {check.get('error', check.get('config_class'))}")
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "check_command.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
