"""The planner: what a training step costs on a slice of N chips, before renting it (`python -m lingpack.plan`).

    cli      the command line: Hydra composition (lingpack.config's), PlanConfig, the plan of each mesh, the table
    measure  one mesh: build the run's TrainProgram, compile it (XLA:TPU for TPU chips), read memory and FLOPs
    cost     the step-time model of a compiled TPU program (fusions, Mosaic kernels, collectives)
    hlo      reading compiled HLO: instructions with loop trip counts, collectives, Pallas kernels
    chips    accelerator figures, each with its public source

The command line's functions live in `lingpack.plan.cli` (this package imports nothing, so that
`lingpack.plan.chips` or `lingpack.plan.hlo` can be imported from anywhere without the planner).
"""
