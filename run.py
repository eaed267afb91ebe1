"""lingpack's entry point: `python run.py [group=choice ...] [key=value ...]`, `python run.py -m ...` for sweeps.

    python run.py                                   # tiny Ling3, bundled corpus, packed, segment-native KDA
    python run.py kernel=chunked_aligned kernel.max_segs=32
    python run.py -m kernel=chunked_aligned kernel.max_segs=8,16,32
    python run.py experiment=loss_parity            # Megatron-semantics PyTorch reference side by side
    python run.py experiment=loss_parity_fp64       # the same in float64 on both sides (JAX x64 mode, per run)
    python run.py -m hydra/launcher=slurm ...       # from a SLURM login node (see slurm_or_tpu_launch/)

A config value that cannot run prints one line (`Error: <key and fix>`) and exits with status 1, like
Hydra's own override errors; so does a launch problem (`run.py: ...`).
"""

import os
import shutil
import sys

import hydra
from omegaconf import DictConfig

# Variables that hold this process's rank on a multi-process launch (explicit, SLURM, TPU pod, multislice).
RANK_VARIABLES = ("JAX_PROCESS_ID", "SLURM_PROCID", "TPU_WORKER_ID", "MEGASCALE_SLICE_ID")


def launch_overrides(argv: list[str], environ) -> list[str]:
    """Hydra overrides run.py adds before Hydra starts; exits with one line when a launcher cannot work here.

    - `hydra/launcher=slurm*` without `sbatch` on PATH: one line saying so and how to run locally.
    - every process but the first of a multi-process launch: no `.hydra/` and no run log file (process 0
      writes them; the others log to the console only).
    """
    launcher = next((a.split("=", 1)[1] for a in argv if a.startswith("hydra/launcher=")), "")
    if launcher.startswith("slurm") and shutil.which("sbatch") is None:
        sys.exit(f"run.py: hydra/launcher={launcher} submits SLURM jobs, but sbatch/srun are not found on this "
                 "machine; run from a SLURM login node, or drop hydra/launcher=... to run here "
                 "(see slurm_or_tpu_launch/README.md)")
    ranks = [environ.get(v, "") for v in RANK_VARIABLES]
    ranks += [a.split("=", 1)[1] for a in argv if a.startswith("distributed.process_id=")]
    if any(rank not in ("", "0", "null") for rank in ranks):
        return ["hydra.output_subdir=null", "hydra/job_logging=stdout"]
    return []


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    from lingpack.errors import ConfigError
    from lingpack.distributed import DistributedError
    from lingpack.experiment import run_from_hydra
    try:
        return run_from_hydra(cfg)
    except ConfigError as err:
        print(f"Error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except DistributedError as err:  # a launch problem, not a bug: one line, no traceback
        sys.exit(f"run.py: {err}")


if __name__ == "__main__":
    sys.argv += launch_overrides(sys.argv[1:], os.environ)
    main()
