"""Whole-model training speed: compile time, step time, tokens/s and MFU, and where a step's time goes.

    python -m experiments.bench_train.bench [--quick] [--models tiny,small,small4,small24] [--out FILE]

Models: conf/model/ling3_tiny.yaml, ling3_small.yaml, `small24` = ling3_small with the flagship's 24
layers and `small4` = ling3_small with 4 (compile time against depth). Each runs the real jitted train step
(`train.step.make_train_step`: forward, backward, clip, AdamW, expert-bias update) on one synthetic packed
batch (log-normal document lengths, some padding).

* compile: seconds of `lower` + `compile` of the step (tracing included), wall and process CPU; ops: the
  lowered step's StableHLO operations (what XLA must compile, free of load).
* step: median wall time of the compiled step; tokens/s = B*T / step.
* MFU: the analytic training FLOPs (`train.flops.flops_per_token`, what the step log uses) per second
  over the matmul ceiling: a 1024^2 fp32 matmul measured in THIS run, interleaved with the steps (A B A B),
  so machine load hits both (each slot the fastest of 5 back-to-back calls, median over slots).
  `xla_util` is the same with XLA's own FLOP count of the compiled step.
* breakdown: each component (KDA mixer, MLA mixer, MoE, dense FFN, embedding + head + loss, optimizer)
  jitted alone, forward + backward at the model's batch shape, timed the same way and multiplied by
  how often a step runs it; also XLA's FLOP count per component. With `remat` the step recomputes each
  layer's forward once more, which the isolated timings do not include.
* `--attention-ab T`: one MLA mixer at [1, T] packed with many documents, dense attention against
  tile-skipping flash, interleaved, with flash's computed / total tiles.
* `--hlo-ops`: operations in the lowered step, scanned and unrolled: what XLA must compile, free of load.
* `--compile-parts`: per component, its fwd+bwd's StableHLO ops and the CPU seconds of lowering and compiling.
Every number is a ratio or a time within this run on this machine; absolute times depend on the load.
The default mode writes results/bench_train.json, whose `table` is the `bench_train` results block of the docs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx

from experiments.provenance import commit
from lingpack.config import KernelConfig, model_config as resolve_model_config
from lingpack.kernels.attention.flash import tile_counts
from lingpack.models.block import DecoderLayer
from lingpack.models.ling3 import Ling3
from lingpack.train import flops as flops_lib
from lingpack.train.configs import LossConfig, OptimConfig
from lingpack.train.loss import token_xent
from lingpack.train.optim import make_optimizer
from lingpack.train.step import ModelDef, init_fn, make_train_step

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"

# (config file, overrides, batch rows B, row length T): small shapes so a step takes seconds on a laptop CPU.
MODELS = {
    "tiny": ("ling3_tiny", {}, 8, 256),
    "small": ("ling3_small", {}, 1, 256),
    "small24": ("ling3_small", {"num_layers": 24}, 1, 256),
    "small4": ("ling3_small", {"num_layers": 4}, 1, 256),   # the depth baseline of the compile-time goal
}


def model_config(name: str, **extra):
    file, overrides, B, T = MODELS[name]
    d = yaml.safe_load((ROOT / "conf" / "model" / f"{file}.yaml").read_text())
    d.update(overrides, **extra)
    data_vocab = yaml.safe_load((ROOT / "conf" / "data" / "bundled.yaml").read_text())["vocab_size"]
    kernel = KernelConfig(name=d.pop("kda_impl", "chunked"), chunk_size=d.pop("kda_chunk_size", 64),
                          max_segs=d.pop("kda_max_segs", None))  # the kernel group's keys (run.py: kernel=...)
    return resolve_model_config(d, kernel, data_vocab), B, T  # vocab_size null follows the bundled data, as run.py


def packed_batch(B: int, T: int, vocab: int, seed: int = 0, median_doc: int | None = None) -> dict:
    """Rows of log-normal documents (median `median_doc`, default T/4 tokens), the last row ending in padding."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((B, T), np.int32)
    pos = np.zeros((B, T), np.int32)
    for b in range(B):
        end = T - (T // 8 if b == B - 1 else 0)
        t, doc = 0, 1
        while t < end:
            n = min(end - t, max(1, int(rng.lognormal(np.log(median_doc or T / 4), 0.8))))
            seg[b, t:t + n], pos[b, t:t + n] = doc, np.arange(n)
            t, doc = t + n, doc + 1
    tokens = rng.integers(0, vocab, (B, T + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "inputs_segmentation": seg,
             "targets_segmentation": seg, "inputs_position": pos}
    return {k: jnp.asarray(np.where(seg != 0, v, 0) if k in ("inputs", "targets") else v) for k, v in batch.items()}


cpu_seconds = time.process_time  # user + system seconds of this process, all threads


def interleaved(fns: dict, repeats: int, cpu: dict | None = None) -> dict:
    """Median seconds per function, calls interleaved (A B A B ...) so load drift hits all alike; `cpu` (a dict)
    receives the median process CPU seconds per call (other jobs on the machine barely move it)."""
    for fn in fns.values():
        fn()  # warm-up
    times = {name: [] for name in fns}
    cpus = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), cpu_seconds()
            fn()
            times[name].append(time.perf_counter() - start)
            cpus[name].append(cpu_seconds() - start_cpu)
    if cpu is not None:
        cpu.update({name: statistics.median(c) for name, c in cpus.items()})
    return {name: statistics.median(t) for name, t in times.items()}


def matmul_fn(size: int = 1024, burst: int = 5):
    """(slot, FLOPs, samples): each call of `slot` times `burst` back-to-back matmuls and keeps the fastest in
    `samples` (a ceiling is a peak; the first call after a long step runs on cold caches)."""
    a = jnp.ones((size, size), jnp.float32) / size
    f = jax.jit(lambda x: x @ x)
    samples = []

    def slot():
        best = float("inf")
        for _ in range(burst):
            start = time.perf_counter()
            jax.block_until_ready(f(a))
            best = min(best, time.perf_counter() - start)
        samples.append(best)
    return slot, 2.0 * size ** 3, samples


def xla_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))


def compiled_step(cfg, B: int, T: int):
    """(compiled train step, a `run()` that steps a fresh state once, StableHLO ops, (compile wall, CPU seconds))."""
    build = lambda: Ling3(cfg, rngs=nnx.Rngs(0))
    model_def = ModelDef.from_constructor(build, cfg)
    optim = OptimConfig(decay_steps=1000)
    state = [jax.jit(init_fn(build, optim, 0))()]
    batch = packed_batch(B, T, cfg.vocab_size)
    step = make_train_step(model_def, LossConfig(), optim, micro_batches=1)
    start, start_cpu = time.perf_counter(), cpu_seconds()
    lowered = step.lower(state[0], batch)
    compiled = lowered.compile()
    compile_s = (time.perf_counter() - start, cpu_seconds() - start_cpu)  # lowering + XLA compile
    ops = sum(" = " in line for line in lowered.as_text().splitlines())

    def run():
        state[0], metrics = compiled(state[0], batch)
        jax.block_until_ready(metrics)
    return compiled, run, ops, compile_s


def bench_step(cfg, B: int, T: int, repeats: int) -> dict:
    compiled, run, ops, (compile_s, compile_cpu_s) = compiled_step(cfg, B, T)
    mm, mm_flops, mm_best = matmul_fn()
    cpu = {}
    times = interleaved({"step": run, "matmul": mm}, repeats, cpu)
    ceiling = mm_flops / statistics.median(mm_best)
    model_flops = flops_lib.flops_per_token(cfg, T) * B * T
    return {"B": B, "T": T, "layers": cfg.num_layers, "compile_s": compile_s, "compile_cpu_s": compile_cpu_s,
            "stablehlo_ops": ops, "scanned_layers": len(cfg.scanned_layers()), "step_s": times["step"],
            "step_cpu_s": cpu["step"], "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2 ** 20,
            "tokens_per_s": B * T / times["step"], "ceiling_gflops": ceiling / 1e9,
            "model_gflop_per_step": model_flops / 1e9, "xla_gflop_per_step": xla_flops(compiled) / 1e9,
            "mfu": model_flops / times["step"] / ceiling, "xla_util": xla_flops(compiled) / times["step"] / ceiling}


def _fwd_bwd(module, call):
    """Jitted (grads of params and input) of sum(call(module, x) * cotangent), with its inputs bound."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def loss(params, x):
        y = call(nnx.merge(graphdef, params, rest), x)
        return jnp.sum(y.astype(jnp.float32) * jnp.cos(y.astype(jnp.float32)))  # a non-trivial cotangent
    return jax.jit(jax.grad(loss, argnums=(0, 1))), params


def head_component(cfg, B: int, T: int):
    """(jitted fwd+bwd, args, calls per step) of the token embedding, the final norm, the vocab head and its
    cross-entropy; a step calls it once per head (main + each MTP depth)."""
    batch = packed_batch(B, T, cfg.vocab_size)
    x = jax.random.normal(jax.random.key(1), (B, T, cfg.emb_dim), jnp.dtype(cfg.dtype))
    model = Ling3(dataclasses.replace(cfg, num_layers=1, first_dense_layers=1, mtp_num_layers=0), rngs=nnx.Rngs(0))

    def head_call(m, h):
        xent, _ = token_xent(m.logits(h), batch["targets"])
        return xent + m.embed_tokens(batch["inputs"]).sum(-1)  # the lookup's gradient scatters into the table
    fn, params = _fwd_bwd(model, head_call)
    return fn, (params, x), 1 + cfg.mtp_num_layers


def components(cfg, B: int, T: int):
    """{name: (jitted fn, args, calls per step)} for one step of `cfg` at [B, T]."""
    kw = dict(dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype), rngs=nnx.Rngs(0))
    batch = packed_batch(B, T, cfg.vocab_size)
    seg, pos = batch["inputs_segmentation"], batch["inputs_position"]
    x = jax.random.normal(jax.random.key(1), (B, T, cfg.emb_dim), kw["dtype"])
    kinds = cfg.layer_kinds()
    n_mtp, mtp_moe = cfg.mtp_num_layers, cfg.mtp.use_moe
    counts = {"KDA mixer": sum(m == "kda" for m, _ in kinds), "MLA mixer": sum(m == "mla" for m, _ in kinds) + n_mtp,
              "MoE (router, dispatch, experts)": sum(f == "moe" for _, f in kinds) + n_mtp * mtp_moe,
              "dense FFN": sum(f == "dense" for _, f in kinds) + n_mtp * (not mtp_moe)}
    out = {}
    kda = DecoderLayer(cfg.layer_spec("kda", "dense"), **kw)
    mla = DecoderLayer(cfg.layer_spec("mla", "moe"), **kw)
    for name, module, call in [
        ("KDA mixer", kda.self_attn, lambda m, x: m(x, seg)),
        ("MLA mixer", mla.self_attn, lambda m, x: m(x, seg, pos)),
        ("MoE (router, dispatch, experts)", mla.mlp, lambda m, x: m(x, seg)[0]),
        ("dense FFN", kda.mlp, lambda m, x: m(x)),
    ]:
        if counts[name]:
            fn, params = _fwd_bwd(module, call)
            out[name] = (fn, (params, x), counts[name])

    out["embedding + head + loss"] = head_component(cfg, B, T)

    full = Ling3(cfg, rngs=nnx.Rngs(0))
    params = jax.tree.map(lambda p: p.astype(jnp.float32), nnx.state(full, nnx.Param).to_pure_dict())
    tx = make_optimizer(OptimConfig(decay_steps=1000))
    opt_state = tx.init(params)
    update = jax.jit(lambda p, s, g: optax.apply_updates(p, tx.update(g, s, p)[0]))
    out["optimizer (clip + AdamW)"] = (update, (params, opt_state, params), 1)
    return out


def breakdown(cfg, B: int, T: int, repeats: int, step_s: float) -> list:
    parts = components(cfg, B, T)
    fns = {name: (lambda f=fn, a=args: jax.block_until_ready(f(*a))) for name, (fn, args, _) in parts.items()}
    cpu = {}
    times = interleaved(fns, repeats, cpu)
    rows = []
    for name, (fn, args, count) in parts.items():
        flops = xla_flops(fn.lower(*args).compile())
        rows.append({"component": name, "calls": count, "seconds_each": times[name],
                     "seconds_per_step": times[name] * count, "share_of_step": times[name] * count / step_s,
                     "cpu_seconds_per_step": cpu[name] * count,
                     "xla_gflop_per_step": flops * count / 1e9})
        if name == "MLA mixer":  # query x key tiles flash computes on this batch (all of them for dot_product)
            seg = packed_batch(B, T, cfg.vocab_size)["inputs_segmentation"]
            computed, total = tile_counts(seg, block=cfg.attention_block_size)
            rows[-1]["attention_tiles"] = {"impl": cfg.attention_impl, "block": cfg.attention_block_size,
                                           "flash_computed": computed, "total": total}
    return sorted(rows, key=lambda r: -r["seconds_per_step"])


def attention_ab(cfg, T: int, median_doc: int, repeats: int) -> dict:
    """One MLA mixer forward + backward at [1, T] packed with many documents, with each attention kernel
    (`dot_product`: dense masked [T, T]; `flash`: tiles, fully masked ones skipped), interleaved."""
    kw = dict(dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype))
    batch = packed_batch(1, T, cfg.vocab_size, median_doc=median_doc)
    seg, pos = batch["inputs_segmentation"], batch["inputs_position"]
    x = jax.random.normal(jax.random.key(1), (1, T, cfg.emb_dim), kw["dtype"])
    fns, flops, grads = {}, {}, {}
    for impl in ("dot_product", "flash"):
        spec = dataclasses.replace(cfg.layer_spec("mla", "moe"), attention_impl=impl)
        fn, params = _fwd_bwd(DecoderLayer(spec, **dict(kw, rngs=nnx.Rngs(0))).self_attn, lambda m, x: m(x, seg, pos))
        fns[impl] = lambda f=fn, p=params: jax.block_until_ready(f(p, x))
        flops[impl] = xla_flops(fn.lower(params, x).compile()) / 1e9
        grads[impl] = jax.tree.leaves(fn(params, x))
    diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
               for a, b in zip(grads["dot_product"], grads["flash"]))
    times = interleaved(fns, repeats)
    computed, total = tile_counts(seg, block=cfg.attention_block_size)
    return {"T": T, "documents": int(seg.max()), "seconds": times, "xla_gflop": flops,
            "dense_over_flash": times["dot_product"] / times["flash"], "max_abs_grad_difference": diff,
            "flash_tiles": {"block": cfg.attention_block_size, "computed": computed, "total": total}}


def hlo_ops(cfg, B: int, T: int) -> int:
    """Operations in the lowered (StableHLO) train step, traced on abstract state: compile work, load-free."""
    build = lambda: Ling3(cfg, rngs=nnx.Rngs(0))
    optim = OptimConfig(decay_steps=1000)
    state = jax.eval_shape(init_fn(build, optim, 0))
    step = make_train_step(ModelDef.from_constructor(build, cfg), LossConfig(), optim, micro_batches=1)
    text = step.lower(state, packed_batch(B, T, cfg.vocab_size)).as_text()
    return sum(" = " in line for line in text.splitlines())


def compile_parts(cfg, B: int, T: int) -> list:
    """Compile cost of each component's forward+backward alone: StableHLO ops and process CPU seconds of
    lowering and of XLA's compile (CPU time, so other jobs on the machine barely move it)."""
    rows = []
    for name, (fn, args, count) in components(cfg, B, T).items():
        start = cpu_seconds()
        lowered = fn.lower(*args)
        ops = sum(" = " in line for line in lowered.as_text().splitlines())
        lowered_at = cpu_seconds()
        lowered.compile()
        rows.append({"component": name, "calls": count, "stablehlo_ops": ops,
                     "lower_cpu_s": lowered_at - start, "compile_cpu_s": cpu_seconds() - lowered_at})
    return rows


def table(result: dict) -> str:
    """The `bench_train` results block: one row per model of a default-mode run (its JSON)."""
    models = result["models"]
    lines = [f"Train step of each model (lingpack at commit {result['commit']}; B x T tokens of synthetic packed rows,"
             f" fp32; {result['repeats']} timed steps, median; load average {result['load_average_at_start'][0]:.1f}"
             " at the start). MFU: the analytic training FLOPs over a 1024^2 fp32 matmul timed in the same run.", "",
             "| model | layers (scanned) | B x T | compile s (CPU s) | StableHLO ops | step s (CPU s) | tokens/s"
             " | MFU (ceiling GFLOP/s) |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for name, r in models.items():
        lines.append(f"| {name} | {r['layers']} ({r['scanned_layers']}) | {r['B']} x {r['T']} | {r['compile_s']:.1f}"
                     f" ({r['compile_cpu_s']:.1f}) | {r['stablehlo_ops']:,} | {r['step_s']:.3f} ({r['step_cpu_s']:.3f})"
                     f" | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% ({r['ceiling_gflops']:.1f}) |")
    if "small4" in models and "small24" in models:
        deep, shallow = models["small24"], models["small4"]
        ratio = lambda key: deep[key] / shallow[key]
        lines += ["", f"ling3_small widths, 24 against 4 layers: compile {ratio('compile_s'):.2f}x (CPU"
                  f" {ratio('compile_cpu_s'):.2f}x), StableHLO ops {ratio('stablehlo_ops'):.2f}x,"
                  f" step {ratio('step_s'):.2f}x."]
    for name, r in models.items():
        if r.get("breakdown"):
            lines += ["", f"{name}: each component jitted alone (forward + backward) x its calls per step, as a share"
                      f" of the step's {r['step_s']:.3f} s", "",
                      "| component | calls | share of step | XLA GFLOP per step |", "|---|---:|---:|---:|"]
            lines += [f"| {c['component']} | {c['calls']} | {100 * c['share_of_step']:.1f}% |"
                      f" {c['xla_gflop_per_step']:.2f} |" for c in r["breakdown"]]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 repeats, no breakdown")
    parser.add_argument("--models", default="tiny,small,small4,small24")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a top-level model key for every model (e.g. remat=false)")
    parser.add_argument("--attention-ab", type=int, default=0, metavar="T",
                        help="only the MLA attention A/B (dense vs tile-skipping flash) at [1, T], documents of ~T/16")
    parser.add_argument("--compile-parts", action="store_true",
                        help="only the compile cost (ops, CPU seconds) of each component's fwd+bwd alone")
    parser.add_argument("--hlo-ops", action="store_true", help="only the lowered step's ops, scanned and unrolled")
    parser.add_argument("--out", default=None, help="default: results/bench_train[_MODE].json")
    args = parser.parse_args()
    repeats = 2 if args.quick else 5
    extra = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    mode = "attention" if args.attention_ab else "compile_parts" if args.compile_parts else \
        "hlo_ops" if args.hlo_ops else None
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cores, {mode or 'step'}, {extra}")
    result = {"mode": mode or "step", "commit": commit(), "overrides": extra, "repeats": repeats,
              "load_average_at_start": os.getloadavg(), "models": {}}
    out = Path(args.out or RESULTS / f"bench_train{'_' + mode if mode else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        cfg, B, T = model_config(name, **extra)
        if args.hlo_ops:
            row = {scan: hlo_ops(dataclasses.replace(cfg, scan_layers=scan), B, T) for scan in (True, False)}
            lines = [f"{name:8s} lowered step ops: scanned {row[True]}, unrolled {row[False]}"]
        elif args.compile_parts:
            row = compile_parts(cfg, B, T)
            lines = [f"{name:8s} {r['component']:34s} x{r['calls']:2d} {r['stablehlo_ops']:6d} ops | lower"
                     f" {r['lower_cpu_s']:5.1f} s | compile {r['compile_cpu_s']:5.1f} s CPU" for r in row]
        elif args.attention_ab:
            row = attention_ab(cfg, args.attention_ab, args.attention_ab // 16, repeats)
            lines = [f"{name:8s} MLA mixer fwd+bwd, T={row['T']}, {row['documents']} documents: {row['seconds']} s,"
                     f" XLA GFLOP {row['xla_gflop']}, flash tiles {row['flash_tiles']}"]
        else:
            row = bench_step(cfg, B, T, repeats)
            lines = [f"{name:8s} layers {row['layers']:2d} B={B} T={T}: compile {row['compile_s']:6.1f} s"
                     f" ({row['compile_cpu_s']:.1f} s CPU) | step"
                     f" {row['step_s']:7.3f} s ({row['step_cpu_s']:.3f} s CPU, temp {row['temp_mib']:.0f} MiB) |"
                     f" {row['tokens_per_s']:8.0f} tok/s | MFU {100 * row['mfu']:5.1f}%"
                     f" (XLA flops {100 * row['xla_util']:5.1f}%) of {row['ceiling_gflops']:.1f} GFLOP/s"]
            if not args.quick:
                row["breakdown"] = breakdown(cfg, B, T, repeats, row["step_s"])
                lines += [f"    {r['component']:34s} x{r['calls']:2d} {r['seconds_per_step']:7.3f} s"
                          f" ({100 * r['share_of_step']:5.1f}% of the step) {r['xla_gflop_per_step']:8.2f} GFLOP"
                          f" {r.get('attention_tiles', '')}" for r in row["breakdown"]]
        print("\n".join(lines), flush=True)
        result["models"][name] = row
        out.write_text(json.dumps(result, indent=2))  # after every model: a long run that dies keeps its rows
    if not mode:
        print(table(result))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
