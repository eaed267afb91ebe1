"""lingpack's entry point: `python run.py [group=choice ...] [key=value ...]`, `python run.py -m ...` for sweeps.

    python run.py                                   # tiny Ling3, bundled corpus, packed, segment-native KDA
    python run.py kernel=chunked_aligned kernel.max_segs=32
    python run.py -m kernel=chunked_aligned kernel.max_segs=8,16,32
    python run.py experiment=loss_parity            # Megatron-semantics PyTorch reference side by side

A config value that cannot run prints one line (`Error: <key and fix>`) and exits with status 1, like
Hydra's own override errors.
"""

import sys

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    from lingpack.config import ConfigError
    from lingpack.experiment import run_from_hydra
    try:
        return run_from_hydra(cfg)
    except ConfigError as err:
        print(f"Error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
