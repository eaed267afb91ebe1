"""lingpack's entry point: `python run.py [group=choice ...] [key=value ...]`, `python run.py -m ...` for sweeps.

    python run.py                                   # tiny Ling3, bundled corpus, packed, segment-native KDA
    python run.py kernel=chunked_aligned kernel.max_segs=32
    python run.py -m kernel=chunked_aligned kernel.max_segs=8,16,32
    python run.py experiment=loss_parity            # Megatron-semantics PyTorch reference side by side
"""

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    from lingpack.experiment import run_from_hydra
    return run_from_hydra(cfg)


if __name__ == "__main__":
    main()
