"""The Megatron-LM command that trains what a lingpack run trains: `pretrain_gpt.py` and its arguments.

    python -m lingpack.tracking.megatron_args [run.py overrides...]    # the config `python run.py ...` runs
    python -m lingpack.tracking.megatron_args --run outputs/x          # a run's own config (.hydra/config.yaml)

Every field of the resolved config has one rule in `RULES` (megatron_rules.py): the Megatron-LM arguments it
maps to, a note when Megatron-LM cannot reproduce this run's value (printed in the `unmapped` comments
after the command, never dropped), or why the field does not change the loss. A field without a rule fails
the tests. Flag names come from Megatron-LM's own parser (megatron_arguments.txt, written by
experiments/megatron_arguments/); every flag printed is in that list.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import textwrap
from pathlib import Path

from lingpack.errors import ConfigError

ARGUMENTS_FILE = Path(__file__).with_name("megatron_arguments.txt")
EXIT_BAD_INPUT = 2


def megatron_arguments(ref: str = "main") -> tuple[dict[str, str], frozenset[str]]:
    """({ref: 'NVIDIA/Megatron-LM@commit'}, the flags Megatron-LM's parser has at `ref`)."""
    refs, flags = {}, set()
    for line in ARGUMENTS_FILE.read_text().splitlines():
        if line.startswith("# ") and "NVIDIA/Megatron-LM@" in line:
            name, _, source = line[2:].partition(": ")
            refs[name] = source
        elif line.startswith("--"):
            flag, *only = line.split()
            if not only or ref in only:
                flags.add(flag)
    if ref not in refs:
        raise ConfigError(f"{ARGUMENTS_FILE.name} has no flags of Megatron-LM ref {ref!r}; it holds {sorted(refs)}")
    return refs, frozenset(flags)


def config_of_run(run_dir: str):
    """The RunConfig of a finished (or started) run: its `.hydra/config.yaml`, resolved as run.py did."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from lingpack import config as config_lib
    path = Path(run_dir) / ".hydra" / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"--run {run_dir}: no {path} (a run directory of `python run.py` holds one); give the "
                          "run's directory, or the run's overrides instead of --run")
    try:
        plain = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        plain = config_lib._replace_run_dir(plain, str(run_dir))
        plain = OmegaConf.to_container(OmegaConf.create(plain), resolve=True)
    except OmegaConfBaseException as err:
        raise ConfigError(f"--run {run_dir}: {path} does not resolve: {' '.join(str(err).split())}") from None
    return _build(plain, str(run_dir))


def config_of_overrides(overrides: list[str]):
    """The RunConfig `python run.py OVERRIDES` would train."""
    from lingpack import config as config_lib
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        raise ConfigError(f"unknown option {bad[0]!r}: give run.py overrides (key=value, group=option) or --run DIR")
    return _build(config_lib.compose(list(overrides), run_dir="outputs/megatron_args"), "outputs/megatron_args")


def _build(plain: dict, run_dir: str):
    from lingpack import config as config_lib
    from lingpack.train import optim as optim_lib
    rc = config_lib.build(plain, run_dir, open_data=False)
    return dataclasses.replace(rc, optim=optim_lib.resolve(rc.optim, rc.train.steps))   # as train/loop.py does


@dataclasses.dataclass(frozen=True)
class Command:
    """The launch line, the (flag, value) pairs in order, and what Megatron-LM does not reproduce."""
    launch: str
    flags: tuple[tuple[str, object], ...]
    unmapped: tuple[tuple[str, str], ...]    # (config field, why)

    def names(self) -> list[str]:
        return [flag for flag, _ in self.flags]


def command(rc) -> Command:
    """Apply every rule to the run config (see megatron_rules.py)."""
    from lingpack.tracking import megatron_rules as rules
    flags, unmapped = [], []
    for field, rule in rules.RULES.items():
        got_flags, note = rule.apply(rc)
        flags += got_flags
        if note:
            unmapped.append((field, note))
    for flag, value, _ in rules.FIXED:
        flags.append((flag, value))
    seen = {}
    for flag, value in flags:
        if flag in seen and seen[flag] != value:
            raise AssertionError(f"two rules give {flag}: {seen[flag]!r} and {value!r}")   # a bug in the table
        seen[flag] = value
    ranks = rc.loss.megatron_dp_size
    return Command(launch=f"torchrun --nproc-per-node {ranks} pretrain_gpt.py", flags=tuple(seen.items()),
                   unmapped=tuple(unmapped))


def _value(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(_value(v) for v in value)
    return shlex.quote(repr(value) if isinstance(value, float) else str(value))


def _comment(text: str, first: str = "# ", rest: str = "# ") -> list[str]:
    return textwrap.wrap(text, width=110, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False)


def render(rc, cmd: Command, *, refs: dict[str, str]) -> str:
    ranks = rc.loss.megatron_dp_size
    lines = _comment(f"Megatron-LM run of lingpack run {rc.name!r}. Flags checked against Megatron-LM's parser at main "
                     f"({refs.get('main', '?')}). Run from a Megatron-LM checkout; data paths as the lingpack run "
                     f"gave them (relative to where it started). {ranks} data-parallel rank(s) "
                     "(loss.megatron_dp_size); tensor, pipeline and context parallelism are free to choose (the loss "
                     "does not depend on them).")
    lines.append(f"{cmd.launch} \\")
    for i, (flag, value) in enumerate(cmd.flags):
        tail = "" if i == len(cmd.flags) - 1 else " \\"
        lines.append(f"    {flag}{'' if value is None else ' ' + _value(value)}{tail}")
    lines.append("# unmapped: what this command does not reproduce (Megatron-LM has no argument for it, or lingpack "
                 "cannot map it)")
    for _, why in cmd.unmapped:
        lines += _comment(why, "#   - ", "#     ")
    if not cmd.unmapped:
        lines.append("#   (nothing)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lingpack.tracking.megatron_args",
                                     description="Print the Megatron-LM pretrain_gpt.py command of a lingpack run.")
    parser.add_argument("--run", metavar="DIR", help="a run directory of `python run.py` (its .hydra/config.yaml)")
    parser.add_argument("overrides", nargs="*", help="run.py overrides (key=value, group=option)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    try:
        overrides = list(args.overrides) + rest
        if args.run and overrides:
            raise ConfigError(f"--run {args.run} reads that run's own config: drop the overrides {overrides}")
        rc = config_of_run(args.run) if args.run else config_of_overrides(overrides)
        refs, _ = megatron_arguments()
        print(render(rc, command(rc), refs=refs))
    except ConfigError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
