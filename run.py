"""lingpack's entry point: `python run.py [group=choice ...] [key=value ...]`, `python run.py -m ...` for sweeps.

    python run.py                                   # tiny Ling3, bundled corpus, packed, segment-native KDA
    python run.py kernel=chunked_aligned kernel.max_segs=32
    python run.py -m kernel=chunked_aligned kernel.max_segs=8,16,32
    python run.py experiment=loss_parity            # Megatron-semantics PyTorch reference side by side
    python run.py experiment=loss_parity_fp64       # the same in float64 on both sides (JAX x64 mode, per run)
    python run.py -m hydra/launcher=slurm ...       # from a SLURM login node (see slurm_or_tpu_launch/)

A config value, data file or device count that cannot run prints one line (`Error: <key and fix>`) and
exits with status 1; so do Hydra's own errors (an unknown group option keeps Hydra's list of the valid ones)
and a launch problem (`run.py: ...`). Anything
else is a bug of ours: its full traceback, status 1.
"""

import os
import shutil
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from lingpack import resolvers

resolvers.register()  # before Hydra composes conf/

# Variables that hold this process's rank on a multi-process launch (explicit, SLURM, TPU pod, multislice).
RANK_VARIABLES = ("JAX_PROCESS_ID", "SLURM_PROCID", "TPU_WORKER_ID", "MEGASCALE_SLICE_ID")


def launch_overrides(argv: list[str], environ) -> list[str]:
    """Hydra overrides run.py adds before Hydra starts; exits with one line when a launcher cannot work here.

    - `hydra/launcher=NAME` that no config provides: one line with the choices.
    - `hydra/launcher=slurm*` without the submitit plugin, or without `sbatch` on PATH: one line saying so
      and how to run locally.
    - every process but the first of a multi-process launch: no `.hydra/` and no run log file (process 0
      writes them; the others log to the console only).
    """
    launcher = next((a.split("=", 1)[1] for a in argv if a.startswith("hydra/launcher=")), "")
    if launcher:
        choices = launcher_choices()
        if launcher not in choices:
            sys.exit(f"run.py: hydra/launcher={launcher}: no such launcher; choose one of {', '.join(choices)} "
                     "(lingpack's are in conf/hydra/launcher/)")
    if launcher.startswith("slurm") and shutil.which("sbatch") is None:
        sys.exit(f"run.py: hydra/launcher={launcher} submits SLURM jobs, but sbatch/srun are not found on this "
                 "machine; run from a SLURM login node, or drop hydra/launcher=... to run here "
                 "(see slurm_or_tpu_launch/README.md)")
    if launcher.startswith(("slurm", "submitit")) and "submitit_slurm" not in launcher_choices():
        sys.exit(f"run.py: hydra/launcher={launcher} needs Hydra's submitit launcher: pip install -e '.[slurm]'")
    ranks = [environ.get(v, "") for v in RANK_VARIABLES]
    ranks += [a.split("=", 1)[1] for a in argv if a.startswith("distributed.process_id=")]
    if any(rank not in ("", "0", "null") for rank in ranks):
        return ["hydra.output_subdir=null", "hydra/job_logging=stdout"]
    return []


def launcher_choices() -> list[str]:
    """Every `hydra/launcher` option: Hydra's and its installed plugins' (basic, submitit_*) and conf/'s."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins
    Plugins.instance()  # imports the installed plugins, which register their launcher configs
    names = {Path(name).stem for name in ConfigStore.instance().list("hydra/launcher")}
    names |= {path.stem for path in (Path(__file__).parent / "conf" / "hydra" / "launcher").glob("*.yaml")}
    return sorted(names)


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
    except Exception:  # a bug of ours: the whole traceback (Hydra's report would cut it and bury it)
        import traceback
        traceback.print_exc()
        raise SystemExit(1) from None


def run_main() -> int:
    """`main()`, with Hydra's own errors (an unknown group option, a bad override) as one line, status 1.

    Hydra reports them itself, with its config-search-path listing; with HYDRA_FULL_ERROR=1 it raises them
    instead, so they reach us. A user who set HYDRA_FULL_ERROR gets Hydra's full trace, as Hydra documents.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    user_wants_trace = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        main()
    except (HydraException, OmegaConfBaseException) as err:
        if user_wants_trace:
            raise
        from lingpack.config import hydra_error_message
        print(f"Error: {hydra_error_message(err)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.argv += launch_overrides(sys.argv[1:], os.environ)
    sys.exit(run_main())
