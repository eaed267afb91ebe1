"""Write src/lingpack/tracking/megatron_arguments.txt: the flags Megatron-LM's pretrain_gpt.py accepts.

    python -m experiments.megatron_arguments.list_arguments --megatron /path/to/Megatron-LM [--refs main dev]

`--megatron` is a git checkout (or bare clone) of NVIDIA/Megatron-LM; each ref's `megatron/` tree is
exported to a temporary directory and its parser is built there by collect.py (this interpreter, torch
on CPU). A flag found at every ref is written bare, one found at some refs only is followed by those refs.
The header records the repository, the file that defines the arguments and each ref's commit.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "src" / "lingpack" / "tracking" / "megatron_arguments.txt"


def git(checkout: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", checkout, *args], check=True, capture_output=True, **kwargs)


def flags_at(checkout: str, ref: str) -> tuple[str, list[str]]:
    commit = git(checkout, "rev-parse", ref, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tree:
        archive = git(checkout, "archive", commit, "megatron").stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        env = dict(os.environ, PYTHONPATH=tree, PYTHONWARNINGS="ignore")
        out = subprocess.run([sys.executable, str(Path(__file__).with_name("collect.py"))], env=env, cwd=tree,
                             capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"building Megatron-LM's parser at {ref} ({commit}) failed:\n{out.stderr[-3000:]}")
    return commit, [line for line in out.stdout.splitlines() if line.startswith("--")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", required=True, help="a git checkout of NVIDIA/Megatron-LM")
    parser.add_argument("--refs", nargs="+", default=["main", "dev"])
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    found = {ref: flags_at(args.megatron, ref) for ref in args.refs}
    lines = ["# Command-line flags of Megatron-LM's pretrain_gpt.py: the parser of add_megatron_arguments",
             "# (NVIDIA/Megatron-LM:megatron/training/arguments.py) built at each ref below.",
             "# Written by experiments/megatron_arguments/list_arguments.py; a flag some refs lack names the refs",
             "# that have it."]
    lines += [f"# {ref}: NVIDIA/Megatron-LM@{commit}" for ref, (commit, _) in found.items()]
    every = sorted(set().union(*(set(flags) for _, flags in found.values())))
    for flag in every:
        refs = [ref for ref, (_, flags) in found.items() if flag in flags]
        lines.append(flag if len(refs) == len(found) else f"{flag} {' '.join(refs)}")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"{len(every)} flags from {', '.join(args.refs)} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
