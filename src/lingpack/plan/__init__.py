"""The planner: what a training step costs on a slice of N chips, before renting it (`python -m lingpack.plan`).

    cli      the command line: Hydra composition (lingpack.config's), PlanConfig, the plan of each mesh, the table
    measure  one mesh: build the run's TrainProgram, compile it (XLA:TPU for TPU chips), read memory and FLOPs
    cost     the step-time model of a compiled TPU program (fusions, Mosaic kernels, collectives)
    hlo      reading compiled HLO: instructions with loop trip counts, collectives, Pallas kernels
    chips    accelerator figures, each with its public source
"""

from lingpack.plan.cli import (OUTPUT_KEYS, PlanConfig, compose, find_conf_dir, gib, main, plan, plan_config,
                               run_config, split_arguments, table, use_fake_devices)

__all__ = ["OUTPUT_KEYS", "PlanConfig", "compose", "find_conf_dir", "gib", "main", "plan", "plan_config",
           "run_config", "split_arguments", "table", "use_fake_devices"]
