"""`python -m lingpack.export --run RUN_DIR [--step N] --out DIR [--no-mtp] [--max-shard-size 5GB]`."""

from __future__ import annotations

import argparse
import logging
import re
import sys

from lingpack.errors import ConfigError

UNITS = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    unit = (match.group(2) or "B").upper() if match else None
    if not match or unit not in UNITS:
        raise ConfigError(f"--max-shard-size {text!r}: give a size like 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * UNITS[unit])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lingpack.export", description=__doc__)
    parser.add_argument("--run", required=True, help="the run directory (holds .hydra/config.yaml and checkpoints/)")
    parser.add_argument("--out", required=True, help="the transformers model directory to write")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--no-mtp", action="store_true", help="leave the MTP layers out of the export")
    parser.add_argument("--max-shard-size", default="5GB", help="safetensors file size past which weights shard")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    from lingpack.export.runs import export_run
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as err:
        print(f"error: the export writes transformers' config and safetensors files ({err}); install them with "
              "pip install -e '.[parity]'", file=sys.stderr)
        return 2
    try:
        done = export_run(args.run, args.out, step=args.step, mtp=not args.no_mtp,
                          max_shard_bytes=parse_size(args.max_shard_size))
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if done["why"]:
        print(f"{done['architecture']} with its modeling files (trust_remote_code=True): KimiLinear cannot hold this "
              f"config ({done['why']})")
    else:
        print(f"{done['architecture']}: transformers' own class")
    print("MTP layers: " + ("kept, as mtp.{d}.* tensors" + (" (KimiLinear leaves them unused)"
                                                          if not done["why"] else "") if done["mtp"] else "left out"))
    print(f"step {done['step']}: {done['tensors']} tensors, {done['bytes'] / 1e6:.1f} MB float32 in {done['files']} "
          f"safetensors file(s); tokenizer: {done['tokenizer'] or 'none (the data has no tokenizer record)'}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
