"""The planner's measurements of one mesh: export for the chip, compile the XLA twin, read bytes, FLOPs and
collectives, and the roofline time (see lingpack/plan.py for what the planner reports and why).

Counting rules (lingpack.hlo): a `while` body counts its trip count times; the layer stack's mixer
`lax.cond` (models/stack.py) counts each branch by the share of scanned layers that take it (KDA or MLA);
any other conditional counts every branch (an upper bound: e.g. flash attention's skipped tiles).
Collective time: each op's bytes sent per device by the ring algorithm (all-gather, all-to-all: result x
(n-1)/n; reduce-scatter: result x (n-1); all-reduce: 2 x result x (n-1)/n; permute: result), over half the
chip's bidirectional link bandwidth (a device sends and receives at once), not overlapped with compute.
"""

from __future__ import annotations

import dataclasses
import math
import time

from lingpack.errors import ConfigError

KDA_TWINS = {"pallas_segment": "chunked", "pallas_varlen": "chunked_aligned"}   # same layout, XLA ops
ATTENTION_TWINS = {"splash": "flash", "pallas_triton": "flash"}
LAYER_STACK = "lingpack/models/stack.py"


def mesh_name(parallel, devices: int) -> str:
    from lingpack.train.sharding import mesh_shape
    sizes = mesh_shape(parallel, devices)
    name = " x ".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "one device"
    return name + (f" ({parallel.context_strategy})" if sizes["context"] > 1 else "")


def platform_attention(model_cfg, platform: str) -> str:
    """The attention kernel the model runs on `platform` (`auto` resolved as kernels/attention/api.py does)."""
    from lingpack.kernels.attention.api import AUTO
    return AUTO[platform] if model_cfg.attention_impl == "auto" else model_cfg.attention_impl


def twin(model_cfg, platform: str):
    """The model as it runs on `platform`, each Pallas kernel replaced by its XLA twin (what XLA:CPU compiles)."""
    if not hasattr(model_cfg, "kda_impl"):   # not a Ling3 config: compiled as it is
        return model_cfg
    attention = platform_attention(model_cfg, platform)
    return dataclasses.replace(model_cfg, kda_impl=KDA_TWINS.get(model_cfg.kda_impl, model_cfg.kda_impl),
                               attention_impl=ATTENTION_TWINS.get(attention, attention), kda_interpret=None)


def branch_weights(model_cfg):
    """`lingpack.hlo` branch weights for the layer stack's mixer cond: (KDA share, MLA share) of its layers."""
    if not hasattr(model_cfg, "scanned_layers"):
        return None
    scanned = model_cfg.scanned_layers()
    mixers = [mixer for mixer, _ in model_cfg.layer_kinds()[scanned.start:scanned.stop]]
    if not mixers or len(set(mixers)) < 2:
        return None
    share = mixers.count("mla") / len(mixers)
    # lax.cond(is_mla, mla, kda): branch 0 (false) is KDA, branch 1 is MLA
    return lambda op, source: [1 - share, share] if source and LAYER_STACK in source else None


def _per_device(leaf, sharding) -> int:
    return math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize


def state_bytes(program) -> dict:
    """Exact per-device bytes of the train state under its shardings (largest shard of each leaf)."""
    import jax
    total = lambda tree, shardings: sum(_per_device(a, s) for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))
    a, s = program.abstract_state, program.shardings
    out = {"params": total(a.params, s.params), "optimizer": total(a.opt_state, s.opt_state),
           "rest": total(a.rest, s.rest)}
    out["gradients"] = sum(math.prod(sh.shard_shape(p.shape)) * 4 for p, sh in   # the fp32 accumulator (train/step.py)
                           zip(jax.tree.leaves(a.params), jax.tree.leaves(s.params)))
    out["batch"] = sum(_per_device(b, b.sharding) for b in program.batch_specs().values())
    return out


def traffic(op) -> float:
    """Bytes one device sends for one run of collective `op` (ring algorithms; see the module docstring)."""
    n = op.group_size or 2   # replica groups not stated (collective-permute: its factor ignores n)
    factor = {"all-gather": (n - 1) / n, "all-to-all": (n - 1) / n, "ragged-all-to-all": (n - 1) / n,
              "reduce-scatter": n - 1, "all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}[op.kind]
    return op.bytes * factor


def collective_totals(text: str, weights=None) -> tuple[dict, int]:
    """({kind: {"count", "bytes" (results), "sent" (bytes sent per device)}}, unknown trip counts) of HLO `text`."""
    from lingpack import hlo
    ops, unknown = hlo.collective_ops(text, weights)
    by_kind = {k: {"count": 0.0, "bytes": 0.0, "sent": 0.0} for k in hlo.KINDS}
    for op in ops:
        if op.group_size != 1:   # size-1 groups move nothing
            row = by_kind[op.kind]
            row["count"] += op.times
            row["bytes"] += op.times * op.bytes
            row["sent"] += op.times * traffic(op)
    return by_kind, unknown


def compiled_metrics(program, model_cfg) -> dict:
    """Numbers of the compiled per-device program (all numeric, so that two depths extrapolate leaf by leaf)."""
    from lingpack import hlo
    start = time.process_time()
    compiled = program.lower().compile()
    compile_s = time.process_time() - start
    text = compiled.as_text()
    weights = branch_weights(model_cfg)
    m = compiled.memory_analysis()
    memory = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    by_kind, unknown = collective_totals(text, weights)
    return {"memory": memory, "xla_flops": float(cost.get("flops", 0.0)),
            "xla_bytes_accessed": float(cost.get("bytes accessed", 0.0)), "hlo_dots": hlo.dot_flops(text, weights),
            "hlo_traffic": hlo.memory_traffic(text, weights), "collectives": by_kind,
            "unknown_trip_counts": unknown, "compile_cpu_s": compile_s}


def extrapolate(a, b, at_a: int, at_b: int, at: int):
    """Leaf by leaf, the value at `at` of the line through (at_a, a) and (at_b, b)."""
    if isinstance(a, dict):
        return {k: extrapolate(a[k], b[k], at_a, at_b, at) for k in a}
    return a + (b - a) * (at - at_a) / (at_b - at_a)


def describe(model_cfg) -> str:
    if hasattr(model_cfg, "num_layers"):
        return f"Ling3 {model_cfg.num_layers} layers x {model_cfg.emb_dim}, vocab {model_cfg.vocab_size}"
    return type(model_cfg).__name__


def _build(rc, model_cfg, parallel, devices):
    from lingpack.train.program import TrainProgram
    try:
        return TrainProgram.build(model_cfg, rc.loss, rc.optim, parallel, rc.train, rows=rc.data.global_batch_size,
                                  seq_length=rc.data.seq_length, devices=devices)
    except ValueError as err:   # mesh sizes vs devices, rows vs micro-batches x row shards
        raise ConfigError(str(err)) from None


def measure(rc, parallel, chip, devices, *, layers: int | None = None, export: bool = True, log=print) -> dict:
    """The plan of `rc` with mesh `parallel` on `len(devices)` chips of kind `chip`."""
    from lingpack.train import flops as flops_lib
    model = rc.model
    program = _build(rc, model, parallel, devices)
    notes = []
    exported = None
    if export:
        start = time.process_time()
        try:
            module, kernels = program.export(chip.platform, with_kernels=True)
            exported = {"platform": chip.platform, "lowers": True, "mosaic_kernels": kernels["mosaic"],
                        "triton_kernels": kernels.get("triton", {}), "interpret_kernels": kernels["interpret"],
                        "error": None}
        except ConfigError:
            raise
        except Exception as err:   # a lowering failure is the finding: report it, measure the rest
            exported = {"platform": chip.platform, "lowers": False, "mosaic_kernels": {}, "triton_kernels": {},
                        "interpret_kernels": {}, "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
            notes.append(f"the step does NOT lower for {chip.platform}: {exported['error']}")
        exported["export_cpu_s"] = time.process_time() - start
        log(f"plan: exported for {chip.platform} in {exported['export_cpu_s']:.0f} s CPU")
    state = state_bytes(program)
    compiled_model = twin(model, chip.platform)
    if compiled_model != model:
        notes.append(f"compiled with XLA twins of the Pallas kernels (KDA {model.kda_impl} -> {compiled_model.kda_impl}, "
                     f"attention {platform_attention(model, chip.platform)} -> {compiled_model.attention_impl}): "
                     "XLA:CPU compiles no Pallas TPU or GPU call")
    notes.append("memory is XLA:CPU's buffer assignment of the partitioned step; XLA:TPU/GPU schedule and fuse "
                 "differently; the state bytes are exact")
    full_depth = getattr(model, "num_layers", None)
    if layers is None or full_depth is None or layers >= full_depth:
        if layers is not None and full_depth is None:
            raise ConfigError("plan.layers scales a Ling3 layer stack per layer; this model has none: drop plan.layers")
        depths = (full_depth,)
    else:
        interval = model.inhomogeneous_layer_cycle_interval
        depths = (layers, min(layers + interval, full_depth))
        smallest = model.first_dense_layers + 2 * interval
        if not dataclasses.replace(model, num_layers=layers).scanned_layers() or not model.scanned_layers():
            raise ConfigError(f"plan.layers={layers} must leave a layer stack (at least {smallest} layers, with "
                              "model.scan_layers=true) so that every scanned layer costs the same; or drop plan.layers")
    runs = []
    for depth in depths:
        cfg = compiled_model if len(depths) == 1 else dataclasses.replace(compiled_model, num_layers=depth)
        got = compiled_metrics(program if cfg == model else _build(rc, cfg, parallel, devices), cfg)
        log(f"plan: compiled {depth} layers in {got['compile_cpu_s']:.0f} s CPU")
        runs.append((len(cfg.scanned_layers()) if len(depths) > 1 else depth, got))
    if len(runs) == 1:
        metrics = runs[0][1]
    else:
        full = len(model.scanned_layers())
        (at_a, a), (at_b, b) = runs
        metrics = extrapolate(a, b, at_a, at_b, full)
        notes.append(f"compiled {depths[0]} and {depths[1]} layers, scaled per scanned layer to {model.num_layers}")
    if metrics["unknown_trip_counts"]:
        notes.append(f"{metrics['unknown_trip_counts']} loops with unknown trip counts counted once")
    mem = metrics["memory"]
    peak = mem["argument"] + mem["output"] + mem["temp"] - mem["alias"]
    T, rows, n = rc.data.seq_length, rc.data.global_batch_size, len(devices)
    result = {
        "per_device_bytes": int(peak),
        "step_flops": {"analytic": flops_lib.flops_per_token(model, T) * rows * T / n,
                       "xla_cost_analysis": metrics["xla_flops"], "hlo_dots": metrics["hlo_dots"]},
        "collective_bytes": {k: v["bytes"] for k, v in metrics["collectives"].items()},
        "mesh": mesh_name(parallel, n), "parallel": dataclasses.asdict(parallel) | {"logical_axis_rules": None},
        "devices": n,
        "config": {"model": describe(model),
                   "seq_length": T, "global_batch_size": rows, "micro_batches": rc.train.micro_batches,
                   "kda_impl": getattr(model, "kda_impl", None),
                   "attention_impl": platform_attention(model, chip.platform) if hasattr(model, "attention_impl") else None},
        "breakdown": {"state_bytes": {k: state[k] for k in ("params", "optimizer", "rest")},
                      "gradient_bytes": state["gradients"], "batch_bytes": state["batch"],
                      "compiled": dict(mem, peak=peak), "collectives": metrics["collectives"],
                      "hbm_traffic_bytes": metrics["hlo_traffic"], "xla_bytes_accessed": metrics["xla_bytes_accessed"],
                      "compiled_depths": list(depths), "compile_cpu_s": [r["compile_cpu_s"] for _, r in runs],
                      "sharding_dropped": [list(map(str, d)) for d in program.dropped]},
        "export": exported, "notes": notes,
    }
    return assess(result, chip)


def assess(result: dict, chip) -> dict:
    """`result` (from `measure`) judged on `chip`: HBM fit, roofline step time and the MFU it implies."""
    b = result["breakdown"]
    link = sum(k["sent"] for k in b["collectives"].values())
    roof = {"compute_s": result["step_flops"]["hlo_dots"] / chip.peak_flops,
            "memory_s": b["hbm_traffic_bytes"] / chip.hbm_bw, "collective_s": link / (chip.link_bw / 2),
            "link_bytes_sent": link}
    est = max(roof["compute_s"], roof["memory_s"]) + roof["collective_s"]
    mfu = result["step_flops"]["analytic"] / (est * chip.peak_flops) if est else 0.0
    return dict(result, hbm_bytes=int(chip.hbm_bytes), fits=bool(result["per_device_bytes"] <= chip.hbm_bytes),
                est_step_s=est, mfu_at_est=mfu, chip=dataclasses.asdict(chip), breakdown=dict(b, roofline=roof))


def candidate_meshes(rc, devices: int, limit: int) -> list:
    """Up to `limit` meshes next to the configured one: a factor of 2 moved from one axis to another, valid for
    the model and batch; tensor and data splits last, context only for rows of 32K tokens or more."""
    from lingpack.train.configs import MESH_AXES
    from lingpack.train.sharding import mesh_shape
    model, T = rc.model, rc.data.seq_length
    micro_rows = rc.data.global_batch_size // rc.train.micro_batches
    heads = math.gcd(getattr(getattr(model, "kda", None), "num_heads", 1), getattr(getattr(model, "mla", None),
                                                                                     "num_heads", 1))
    experts = getattr(getattr(model, "moe", None), "num_experts", 1)
    block = getattr(model, "attention_block_size", 1)
    start = mesh_shape(rc.parallel, devices)
    movable = [a for a in MESH_AXES if a != "context" or T >= 32768 or start["context"] > 1]

    def valid(sizes) -> bool:
        cp = sizes["context"]
        return (heads % sizes["tensor"] == 0 and experts % sizes["expert"] == 0
                and micro_rows % (sizes["data"] * sizes["fsdp"] * sizes["expert"]) == 0
                and T % ((2 if rc.parallel.load_balance else 1) * cp * (block if cp > 1 else 1)) == 0
                and (rc.parallel.context_strategy != "usp" or cp % rc.parallel.context_ulysses == 0))

    found = {}
    for source in movable:
        for target in movable:
            sizes = dict(start)
            if source == target or sizes[source] % 2:
                continue
            sizes[source] //= 2
            sizes[target] *= 2
            if valid(sizes) and sizes != start:
                found[tuple(sizes.values())] = sizes
    rank = lambda sz: (sz["tensor"], sz["data"], sz["context"] != start["context"], -sz["expert"])
    chosen = sorted(found.values(), key=rank)[:limit]
    return [dataclasses.replace(rc.parallel, **sz) for sz in chosen]
