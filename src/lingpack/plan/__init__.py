"""The planner: what a training step costs on a slice of N chips, before renting it (`python -m lingpack.plan`).

    cli      the command line: Hydra composition (lingpack.config's), PlanConfig, the plan of each mesh, the table
    measure  one mesh: build the run's TrainProgram, compile it (XLA:TPU for TPU chips), read memory and FLOPs
    cost     the step-time model of a compiled TPU program (fusions, Mosaic kernels, collectives)
    hlo      reading compiled HLO: instructions with loop trip counts, collectives, Pallas kernels
    chips    accelerator figures, each with its public source

The package itself imports nothing, so the training code can read `lingpack.plan.hlo` without the CLI (and
lingpack.config) coming along: `from lingpack.plan import cli` for the command line's functions.
"""
