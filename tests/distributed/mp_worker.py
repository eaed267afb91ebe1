"""One training process of a multi-process test: `python mp_worker.py RUN_DIR OUT_JSON [hydra overrides]`.

The parent sets JAX_PLATFORMS=cpu, XLA_FLAGS (fake device count) and, for a multi-process run,
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID; this composes conf/ like run.py (no Hydra
run directory), calls `experiment.run` and writes what the test checks to OUT_JSON.
"""
import json
import sys
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]
jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py


def main(run_dir: str, out: str, overrides: list[str]) -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from lingpack import experiment
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"checkpoint.directory={run_dir}/checkpoints", *overrides])
    summary = experiment.run(OmegaConf.to_container(cfg, resolve=True), run_dir)
    Path(out).write_text(json.dumps({"process_index": jax.process_index(), "process_count": jax.process_count(),
                                     "local_devices": jax.local_device_count(), "devices": jax.device_count(),
                                     "summary": summary}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
