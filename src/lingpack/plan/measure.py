"""The planner's measurements of one mesh: compile the step, read bytes, FLOPs and collectives, and its step time
(see lingpack/plan/cli.py for what the planner reports and why).

compiler "tpu" (TPU chips): the run's real step (Mosaic kernels, ragged_dot, the ragged expert exchange)
traced for TPU (`lingpack.backend.target("tpu")`) and compiled by libtpu for the chip's slice topology
(`chips.tpu_devices`); memory from XLA:TPU's memory_analysis(), time from `lingpack.plan.cost`.
compiler "cpu" (GPU chips, or `plan.compiler=cpu`): the XLA:CPU twin, each Pallas kernel replaced by its XLA
twin, time from the roofline of XLA:CPU's fusions; an estimate, labelled as such in every output.

Counting rules (lingpack.plan.hlo): a `while` body counts its trip count times; the layer stack's mixer
`lax.cond` (named scope `models.stack.MIXER_SCOPE`) counts each branch by the share of scanned layers that
take it (KDA or MLA); the splash ring's step cond (`parallel.ring_splash.STEP_SCOPE`) counts its early-block
branch only (zigzag: both branches are tiles of the same size; contiguous: the busiest device, whose every
step is early); any other conditional counts every branch (an upper bound).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time

from lingpack.errors import ConfigError
from lingpack.plan import hlo

KDA_TWINS = {"pallas_segment": "chunked", "pallas_varlen": "chunked_aligned"}   # same layout, XLA ops
ATTENTION_TWINS = {"splash": "flash", "pallas_triton": "flash"}


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
    from lingpack.models.moe import GROUPED_MATMUL_AUTO
    attention = platform_attention(model_cfg, platform)
    moe = model_cfg.moe
    if moe is not None and moe.grouped_matmul == "auto" and platform != "tpu":   # the chip's own grouped matmul
        moe = dataclasses.replace(moe, grouped_matmul=GROUPED_MATMUL_AUTO[platform])
    return dataclasses.replace(model_cfg, kda_impl=KDA_TWINS.get(model_cfg.kda_impl, model_cfg.kda_impl),
                               attention_impl=ATTENTION_TWINS.get(attention, attention), kda_interpret=None, moe=moe)


def branch_weights(model_cfg):
    """`lingpack.plan.hlo` weights: the layer stack's mixer cond by (KDA share, MLA share) of its layers, and the
    expert-parallel overflow loop at 0 trips (a plan is of the expected step: receive buffers sized by
    `moe.expert_parallel_capacity` hold a balanced load; an overflowing step takes one more round per layer)."""
    from lingpack.models.stack import MIXER_SCOPE
    from lingpack.parallel.expert import OVERFLOW_SCOPE
    from lingpack.parallel.ring_splash import STEP_SCOPE
    mixer = None
    if hasattr(model_cfg, "scanned_layers"):
        scanned = model_cfg.scanned_layers()
        mixers = [kind for kind, _ in model_cfg.layer_kinds()[scanned.start:scanned.stop]]
        if mixers and len(set(mixers)) == 2:
            share = mixers.count("mla") / len(mixers)
            mixer = [1 - share, share]   # lax.cond(is_mla, mla, kda): branch 0 (false) is KDA, branch 1 is MLA

    def weights(op, scope: str):
        scopes = scope.split("/")
        if op.opcode == "while" and OVERFLOW_SCOPE in scopes:
            return [0.0]
        if op.opcode == "conditional" and STEP_SCOPE in scopes:   # inside the mixer's MLA branch: checked first
            return [0.0, 1.0]   # lax.cond(key block precedes, early, late): branch 1 is the early block
        return mixer if mixer and op.opcode == "conditional" and MIXER_SCOPE in scopes else None
    return weights


MEGABLOX = re.compile(r"\bt?gmm\b")   # Megablox's kernels: gmm, tgmm and their jvp / transpose names


def _expert_parallel(model_cfg, parallel) -> bool:
    """Whether the MoE sends tokens to experts split over `parallel.expert` (parallel/expert.py)."""
    moe = getattr(model_cfg, "moe", None)
    return moe is not None and parallel.expert > 1 and moe.expert_parallel == "all_to_all"


def megablox_share(model_cfg, parallel, tokens_per_device: float, devices):
    """`lingpack.plan.cost` kernel shares, or None: Megablox's kernels on an expert-parallel receive buffer
    declare a CostEstimate over every row of it (2 m k n), but their grid visits only the row tiles of the rows
    routed there, sized at run time from the group sizes. A balanced step routes a device's M = tokens x top-k
    (per `expert_parallel_chunks` round and `expert_parallel_slices` slice) rows, in units of `expert.UNIT`
    rows, into a buffer of `parallel/expert.py` `buffer_rows`: the share is M, plus the expected padding (half
    a unit for each of the E (sender, expert) slices a device receives), over those rows (0.79 for the
    flagship at a capacity of 1.25)."""
    if not _expert_parallel(model_cfg, parallel):
        return None
    from lingpack import backend
    from lingpack.parallel import expert
    moe = model_cfg.moe
    exchange = moe.expert_parallel_exchange
    if exchange == "auto":
        with backend.target("tpu"):
            exchange = backend.expert_exchange(devices)
    slices = moe.expert_parallel_chunks * moe.expert_parallel_slices
    M, E, U = int(tokens_per_device) // slices * moe.top_k, moe.num_experts, expert.UNIT
    R = parallel.expert
    units = expert.buffer_rows(expert.padded_rows(M, E, U), R, E // R, moe.top_k, moe.expert_parallel_capacity,
                               exchange, U)[1]
    share = min(1.0, (M + E * (U - 1) / 2) / (units * U))
    return lambda name: share if MEGABLOX.search(name) else 1.0


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


def collective_totals(text: str, weights=None) -> tuple[dict, int]:
    """({kind: {"count", "bytes" (results), "sent" (bytes sent per device)}}, unknown trip counts) of HLO `text`."""
    from lingpack.plan.cost import traffic
    ops, unknown = hlo.collective_ops(text, weights)
    by_kind = {k: {"count": 0.0, "bytes": 0.0, "sent": 0.0} for k in hlo.KINDS}
    for op in ops:
        if op.group_size != 1:   # size-1 groups move nothing
            row = by_kind[op.kind]
            row["count"] += op.times
            row["bytes"] += op.times * op.bytes
            row["sent"] += op.times * traffic(op.kind, op.bytes, op.group_size)
    return by_kind, unknown


class CompileFinding(ConfigError):
    """The step does not compile for the chip (a Mosaic kernel's VMEM or block shapes, XLA:TPU out of HBM): the
    plan's finding, one line."""


def _first_line(err: Exception) -> str:
    lines = [l.strip() for l in str(err).splitlines() if l.strip()]
    useful = next((l for l in lines if "RESOURCE_EXHAUSTED" in l or "Mosaic" in l or "VMEM" in l), lines[0] if lines else "")
    return f"{type(err).__name__}: {useful[:400]}"


def compiled_metrics(program, model_cfg, chip, compiler: str, save_hlo: str | None = None, kernel_share=None) -> dict:
    """Numbers of the compiled per-device program (numeric, so that two depths extrapolate leaf by leaf)."""
    from lingpack import backend
    from lingpack.plan import cost as cost_lib
    start, wall = time.process_time(), time.time()
    try:
        if compiler == "tpu":
            with backend.target("tpu"):
                compiled = program.lower().compile()
        else:
            compiled = program.lower().compile()
    except ConfigError:
        raise
    except Exception as err:   # Mosaic (VMEM, block shapes) or XLA:TPU (out of HBM): the finding
        raise CompileFinding(f"does not compile for {chip.name}: {_first_line(err)}") from None
    compile_s, compile_wall_s = time.process_time() - start, time.time() - wall
    text = compiled.as_text()
    if save_hlo:
        with open(save_hlo, "w") as f:
            f.write(text)
    weights = branch_weights(model_cfg)
    m = compiled.memory_analysis()
    memory = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, (list, tuple)) else xla
    by_kind, unknown = collective_totals(text, weights)
    out = {"memory": memory, "xla_flops": float(xla.get("flops", 0.0)),
           "xla_bytes_accessed": float(xla.get("bytes accessed", 0.0)), "hlo_dots": hlo.dot_flops(text, weights),
           "collectives": by_kind, "unknown_trip_counts": unknown, "compile_cpu_s": compile_s,
           "compile_wall_s": compile_wall_s}
    if compiler == "tpu":
        coords = [list(d.coords) for d in program.mesh.devices.flat]
        costed = cost_lib.program_cost(text, chip, coords=coords, branch_weights=weights, kernel_share=kernel_share)
        out["cost"] = {k: costed[k] for k in ("step_s", "roofline_s", "xla_cycles_s", "hidden_s", "flops",
                                              "by_part", "by_kind", "flops_by_part", "flops_by_kind")}
        out["top"] = costed["top"]
        out["xla_optimal_seconds"] = float(xla.get("optimal_seconds", 0.0))
        out["mosaic_kernels"] = hlo.compiled_kernels(text)
    else:
        out["hlo_traffic"] = hlo.memory_traffic(text, weights)
    return out


def extrapolate(a, b, at_a: int, at_b: int, at: int):
    """Leaf by leaf, the value at `at` of the line through (at_a, a) and (at_b, b); non-numbers: b's."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: extrapolate(a.get(k, 0.0), b.get(k, 0.0), at_a, at_b, at) for k in {**a, **b}}
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return b
    return a + (b - a) * (at - at_a) / (at_b - at_a)


def remat_flops(model_cfg, seq_len: int, tokens_per_device: float, expert_rounds: int = 1) -> float:
    """The forward recompute a step adds, analytic: `train/flops.py` `remat_flops` (what the layers' remat policy
    recomputes, per part), plus the vocabulary-chunked heads' logits (main and MTP, `vocab_chunk_size`), which
    models/head.py recomputes in the backward whatever the policy: 2 x vocab x width per token each. The fused
    heads (`fused_head_rows`) recompute nothing: their gradients are formed in the forward."""
    from lingpack.train import flops as flops_lib
    if not hasattr(model_cfg, "vocab_size"):
        return 0.0
    heads = 1 + getattr(model_cfg, "mtp_num_layers", 0)
    recomputed = getattr(model_cfg, "vocab_chunk_size", 0) and not getattr(model_cfg, "fused_head_rows", 0)
    logits = 2.0 * model_cfg.vocab_size * model_cfg.emb_dim * heads if recomputed else 0.0
    layers = flops_lib.remat_flops(model_cfg, seq_len=seq_len, expert_rounds=expert_rounds)
    return (logits + layers) * tokens_per_device


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


def _export(program, chip) -> tuple[dict, list]:
    """The step exported for the chip's platform: whether it lowers, its Pallas kernels (the twin's proof)."""
    start, notes = time.process_time(), []
    try:
        _, kernels = program.export(chip.platform, with_kernels=True)
        exported = {"platform": chip.platform, "lowers": True, "mosaic_kernels": kernels["mosaic"],
                    "triton_kernels": kernels.get("triton", {}), "interpret_kernels": kernels["interpret"], "error": None}
    except ConfigError:
        raise
    except Exception as err:   # a lowering failure is the finding: report it, measure the rest
        exported = {"platform": chip.platform, "lowers": False, "mosaic_kernels": {}, "triton_kernels": {},
                    "interpret_kernels": {}, "error": _first_line(err)}
        notes.append(f"the step does NOT lower for {chip.platform}: {exported['error']}")
    exported["export_cpu_s"] = time.process_time() - start
    return exported, notes


def _depths(model, layers):
    full_depth = getattr(model, "num_layers", None)
    if layers is None or full_depth is None or layers >= full_depth:
        if layers is not None and full_depth is None:
            raise ConfigError("plan.layers scales a Ling3 layer stack per layer; this model has none: drop plan.layers")
        return (full_depth,)
    interval = model.inhomogeneous_layer_cycle_interval
    smallest = model.first_dense_layers + 2 * interval
    if not dataclasses.replace(model, num_layers=layers).scanned_layers() or not model.scanned_layers():
        raise ConfigError(f"plan.layers={layers} must leave a layer stack (at least {smallest} layers, with "
                          "model.scan_layers=true) so that every scanned layer costs the same; or drop plan.layers")
    return (layers, min(layers + interval, full_depth))


def measure(rc, parallel, chip, devices, *, layers: int | None = None, export: bool = True, compiler: str = "tpu",
            log=print, save_hlo: str | None = None) -> dict:
    """The plan of `rc` with mesh `parallel` on `len(devices)` chips of kind `chip`, compiled by XLA:TPU
    (`compiler="tpu"`, devices: TPU topology devices) or as the XLA:CPU twin (`"cpu"`, fake CPU devices)."""
    from lingpack.train import flops as flops_lib
    model = rc.model
    program = _build(rc, model, parallel, devices)
    notes, exported = [], None
    if compiler == "cpu":
        if export:
            exported, notes = _export(program, chip)
            log(f"plan: exported for {chip.platform} in {exported['export_cpu_s']:.0f} s CPU")
        compiled_model = twin(model, chip.platform)
        if compiled_model != model:
            notes.append(f"XLA:CPU twin: compiled with XLA twins of the Pallas kernels (KDA {model.kda_impl} -> "
                         f"{compiled_model.kda_impl}, attention {platform_attention(model, chip.platform)} -> "
                         f"{compiled_model.attention_impl}) and the {chip.platform} side of the MoE grouped matmul "
                         f"({getattr(compiled_model.moe, 'grouped_matmul', '-')}); the expert exchange is XLA:CPU's "
                         "dense one (XLA:CPU has no ragged all-to-all)")
        notes.append("XLA:CPU twin: memory is XLA:CPU's buffer assignment and the time the roofline of XLA:CPU's "
                     "fusions, an estimate; the state bytes are exact")
    else:
        compiled_model = model
    state = state_bytes(program)
    depths = _depths(model, layers)
    share = megablox_share(model, parallel, rc.data.global_batch_size * rc.data.seq_length / len(devices), devices)
    runs = []
    for depth in depths:
        cfg = compiled_model if len(depths) == 1 else dataclasses.replace(compiled_model, num_layers=depth)
        got = compiled_metrics(program if cfg == model else _build(rc, cfg, parallel, devices), cfg, chip, compiler,
                               save_hlo if depth == depths[-1] else None, kernel_share=share)
        log(f"plan: compiled {depth} layers with XLA:{compiler.upper()} in {got['compile_wall_s']:.0f} s "
            f"({got['compile_cpu_s']:.0f} s CPU)")
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
    flops = {"analytic": flops_lib.flops_per_token(model, T) * rows * T / n,
             "remat": remat_flops(model, T, rows * T / n,
                                  model.moe.expert_parallel_chunks if _expert_parallel(model, parallel) else 1),
             "xla_cost_analysis": metrics["xla_flops"], "hlo_dots": metrics["hlo_dots"]}
    if compiler == "tpu":
        flops["compiled"] = metrics["cost"]["flops"]
        exported = {"platform": "tpu", "lowers": True, "mosaic_kernels": metrics["mosaic_kernels"],
                    "triton_kernels": {}, "interpret_kernels": {}, "error": None}
    result = {
        "compiler": "xla_tpu" if compiler == "tpu" else "xla_cpu",
        "per_device_bytes": int(peak), "step_flops": flops,
        "collective_bytes": {k: v["bytes"] for k, v in metrics["collectives"].items()},
        "mesh": mesh_name(parallel, n), "parallel": dataclasses.asdict(parallel) | {"logical_axis_rules": None},
        "devices": n,
        "config": {"model": describe(model),
                   "seq_length": T, "global_batch_size": rows, "micro_batches": rc.train.micro_batches,
                   "kda_impl": getattr(model, "kda_impl", None),
                   "remat_policy": getattr(model, "remat_policy", None) if getattr(model, "remat", False) else None,
                   "attention_impl": platform_attention(model, chip.platform) if hasattr(model, "attention_impl") else None},
        "breakdown": {"state_bytes": {k: state[k] for k in ("params", "optimizer", "rest")},
                      "gradient_bytes": state["gradients"], "batch_bytes": state["batch"],
                      "compiled": dict(mem, peak=peak), "collectives": metrics["collectives"],
                      "xla_bytes_accessed": metrics["xla_bytes_accessed"],
                      "compiled_depths": list(depths), "compile_cpu_s": [r["compile_cpu_s"] for _, r in runs],
                      "compile_wall_s": [r["compile_wall_s"] for _, r in runs],
                      "sharding_dropped": [list(map(str, d)) for d in program.dropped]},
        "export": exported, "notes": notes,
    }
    if compiler == "tpu":
        result["breakdown"].update(cost=metrics["cost"], top=metrics["top"],
                                   xla_optimal_seconds=metrics["xla_optimal_seconds"])
    else:
        result["breakdown"]["hbm_traffic_bytes"] = metrics["hlo_traffic"]
    return assess(result, chip)


def assess(result: dict, chip) -> dict:
    """`result` (from `measure`) judged on `chip`: HBM fit, step time and the MFU it implies. XLA:TPU plans: the
    cost model's step (`lingpack.plan.cost`); XLA:CPU twins: the roofline of its matmuls, traffic and
    collectives. Never below the analytic FLOPs at peak."""
    b = result["breakdown"]
    floor = result["step_flops"]["analytic"] / chip.peak_flops
    if result.get("compiler") == "xla_tpu":
        roof = {"model_s": b["cost"]["step_s"], "analytic_at_peak_s": floor}
        est = max(b["cost"]["step_s"], floor)
    else:
        link = sum(k["sent"] for k in b["collectives"].values())
        roof = {"compute_s": result["step_flops"]["hlo_dots"] / chip.peak_flops,
                "memory_s": b["hbm_traffic_bytes"] / chip.hbm_bw, "collective_s": link / (chip.link_bw / 2),
                "link_bytes_sent": link, "analytic_at_peak_s": floor}
        est = max(max(roof["compute_s"], roof["memory_s"]) + roof["collective_s"], floor)
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
