"""The whole ling3_tiny train step under context parallelism: per-device memory vs T, and collectives.

    python -m experiments.context_parallel.model_memory [--T 4096 16384 65536] [--cp 1 2 4 8] [--jobs 3] [--remeasure]
    python -m experiments.context_parallel.model_memory --compiler tpu --T 65536 --cp 1 8
    python -m experiments.context_parallel.model_memory --table-only     # re-render the png from the json

Part 1 (memory). One train step of ling3_tiny (forward, backward, clip, AdamW; B=1; fp32; KDA `chunked`, MLA
`flash` on one device and `ring` under CP, zigzag layout) is compiled for 8 fake CPU devices and its
per-device peak read from `.compile().memory_analysis()` (arguments + outputs + temporaries - aliased), for
each T and context size CP (CP devices on the `context` axis, nothing else split). Nothing runs: these are
XLA's buffer-assignment numbers of the compiled per-device program, independent of machine load.

Part 2 (collectives). In the same compiled HLO (and in one KDA layer and one MLA layer compiled alone,
forward + backward w.r.t. parameters and input, at T=16K under CP=8), every collective by kind: how many
execute (ops inside a `while` body count once per iteration, from XLA's known trip count) and their result
bytes per device.

Every configuration compiles in its own subprocess with a timeout; results are merged into
`results/model_memory.json` as they arrive, so an interrupted run keeps what it measured (rerun to fill in
the rest: finished configurations are skipped; `--remeasure` compiles them again on the current code).
`table` renders the `context_parallel_model` results block.

`--compiler tpu` compiles the train step alone with XLA:TPU (libtpu, v5p megacore chips; nothing runs), KDA
by its TPU kernel (`pallas_segment`, the kernel CP=1 and each CP block call alike) and MLA as on XLA:CPU
(flash on one device, the ring under CP); keyed `step@xla_tpu/T/CP`, rendered by `tpu_table` (the
`context_parallel_model_tpu` block).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import yaml  # noqa: E402

from lingpack.plan import hlo as hlo_lib  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "experiments/context_parallel/results"
VOCAB = 384              # the bundled corpus' vocabulary, padded (what `python run.py` builds)
LAYER_T, LAYER_CP = 16384, 8
COUNTER = 2             # version of `collectives`; the table skips counts from older versions
KINDS = ("all-gather", "collective-permute", "all-reduce", "reduce-scatter", "all-to-all")


def collectives(hlo: str) -> dict:
    """lingpack.plan.hlo's per-kind executed collectives, stamped with the counter version the table reads."""
    return dict(hlo_lib.collectives(hlo), counter=COUNTER)


# ---------------------------------------------------------------- one configuration (runs in a subprocess)

def model_config(compiler: str = "cpu"):
    from lingpack.models.ling3 import config_from_dict
    d = yaml.safe_load((ROOT / "conf/model/ling3_tiny.yaml").read_text())
    d.pop("vocab_size_divisible_by")
    d.update(vocab_size=VOCAB, attention_impl="flash", kda_impl="pallas_segment" if compiler == "tpu" else "chunked")
    return config_from_dict(d)


def peak(compiled) -> dict:
    m = compiled.memory_analysis()
    parts = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
    # the compiler's own peak of bytes live at once (no heap fragmentation; docs/parallelism.md)
    live = {"live_peak": int(m.peak_memory_in_bytes)} if getattr(m, "peak_memory_in_bytes", 0) else {}
    return dict(parts, **live, peak=parts["argument"] + parts["output"] + parts["temp"] - parts["alias"])


TPU_TOPOLOGY = {1: "v5p:1x1x1", 2: "v5p:2x2x1", 4: "v5p:2x2x1", 8: "v5p:2x2x2"}   # XLA:TPU mode: v5p megacore


def measure_step(T: int, cp: int, compiler: str = "cpu") -> dict:
    import contextlib

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from lingpack.models.ling3 import Ling3
    from lingpack.parallel.context import ContextParallel
    from lingpack.train import sharding as shard_lib
    from lingpack.train.configs import LossConfig, OptimConfig, ParallelConfig
    from lingpack.train.step import ModelDef, init_fn, make_train_step, state_shardings

    from experiments.provenance import commit as code_commit
    commit = code_commit()   # the code this worker imported
    cfg = model_config(compiler)
    parallel = ParallelConfig(data=1, context=cp, context_strategy="ring", load_balance=True)
    if compiler == "tpu":   # the same step compiled by libtpu for `cp` v5p chips (nothing runs)
        from experiments import xla_tpu
        from lingpack import backend
        devices, where = xla_tpu.devices(TPU_TOPOLOGY[cp])[:cp], backend.target("tpu")
    else:
        devices, where = jax.devices()[:cp], contextlib.nullcontext()
    where.__enter__()
    mesh = shard_lib.make_mesh(parallel, devices=devices)
    context = ContextParallel.from_config(parallel, mesh)
    build = lambda: Ling3(cfg, rngs=nnx.Rngs(0))
    model_def, optim = ModelDef.from_constructor(build, cfg), OptimConfig(decay_steps=1000)
    abstract = jax.eval_shape(init_fn(build, optim, 0))
    shardings = state_shardings(model_def, abstract, mesh, parallel.rules)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    row = jax.ShapeDtypeStruct((1, T), jnp.int32, sharding=shard_lib.batch_sharding(mesh, parallel.rules))
    batch = {k: row for k in ("inputs", "targets", "inputs_segmentation", "targets_segmentation", "inputs_position")}
    step = make_train_step(model_def, LossConfig(), optim, micro_batches=1, mesh=mesh, rules=parallel.rules,
                           shardings=shardings, context=context)
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    where.__exit__(None, None, None)
    state_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract))
    if os.environ.get("MODEL_MEMORY_HLO_DIR"):   # keep the per-device program for inspection
        Path(os.environ["MODEL_MEMORY_HLO_DIR"], f"step_{T}_{cp}.hlo").write_text(compiled.as_text())
    return dict(peak(compiled), T=T, cp=cp, compile_s=time.perf_counter() - start, state_bytes=int(state_bytes),
                collectives=collectives(compiled.as_text()), commit=commit,
                compiler="xla_tpu" if compiler == "tpu" else "xla_cpu")


def measure_layer(kind: str, T: int, cp: int) -> dict:
    """One KDA or MLA layer alone, grads of its parameters and input, under CP=`cp` (ring MLA, zigzag)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from lingpack.models.kda import KDA, KDAKernel
    from lingpack.models.mla import MLA
    from lingpack.parallel.context import ContextParallel, context_parallel
    from lingpack.train import sharding as shard_lib
    from lingpack.train.configs import ParallelConfig

    from experiments.provenance import commit as code_commit
    commit = code_commit()   # the code this worker imported
    cfg = model_config()
    if kind == "kda":
        layer = KDA(cfg.kda, cfg.emb_dim, kernel=KDAKernel(chunk_size=cfg.kda_chunk_size), rngs=nnx.Rngs(0))
        call = lambda m, x, seg, pos: m(x, seg)
    else:
        layer = MLA(cfg.mla, cfg.emb_dim, attention_impl="flash", attention_block=cfg.attention_block_size,
                    rngs=nnx.Rngs(0))
        call = lambda m, x, seg, pos: m(x, seg, pos)
    graphdef, params = nnx.split(layer)
    mesh = shard_lib.make_mesh(ParallelConfig(data=1, context=cp), devices=jax.devices()[:cp])
    context = ContextParallel(mesh, strategy="ring")

    def loss(params, x, seg, pos):
        with context_parallel(context):
            return jnp.sum(call(nnx.merge(graphdef, params), x, seg, pos))

    row, rep = NamedSharding(mesh, P(None, "context")), NamedSharding(mesh, P())
    args = (jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=rep), params),
            jax.ShapeDtypeStruct((1, T, cfg.emb_dim), jnp.float32, sharding=row),
            jax.ShapeDtypeStruct((1, T), jnp.int32, sharding=row),
            jax.ShapeDtypeStruct((1, T), jnp.int32, sharding=row))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
    H, K = cfg.kda.num_heads, cfg.kda.head_dim
    return dict(peak(compiled), kind=kind, T=T, cp=cp, collectives=collectives(compiled.as_text()), commit=commit,
                kda_summary_bytes=H * K * 2 * K * 4)   # one block's fp32 [H, K, K + V] (K = V here)


# ---------------------------------------------------------------- driver, table, plot

def run_one(key: str, args: list[str], timeout: int) -> dict | None:
    cmd = [sys.executable, "-m", "experiments.context_parallel.model_memory", "--worker", *args]
    print(f"{key}: compiling ...", flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        print(f"{key}: timed out after {timeout} s", flush=True)
        return {"timeout_s": timeout}
    if proc.returncode:
        print(f"{key}: failed\n{proc.stderr[-3000:]}", flush=True)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def _steps(res: dict) -> dict:
    return {(r["T"], r["cp"]): r for k, r in res.items() if k.startswith("step/") and "peak" in r}


def _code(rows) -> str:
    commits = sorted({r.get("commit") or "unrecorded" for r in rows})
    return f"commit{'s' if len(commits) > 1 else ''} {', '.join(commits)}"


def table(res: dict) -> str:
    """The `context_parallel_model` results block, from results/model_memory.json."""
    steps = _steps(res)
    Ts, cps = sorted({t for t, _ in steps}), sorted({c for _, c in steps})
    lines = ["Per-device peak of one ling3_tiny train step (MiB; B=1, fp32, 4 layers: 3 KDA + 1 MLA, AdamW), compiled "
             "for the row split over `context`=CP (zigzag; KDA state passing, ring MLA; CP=1: one device, flash MLA), "
             f"measured on {_code(steps.values())}. In brackets: peak / CP=1 peak at that T (goal ~1/CP).", "",
             "| T | " + " | ".join(f"CP={c}" for c in cps) + " |", "|---" * (len(cps) + 1) + "|"]
    for T in Ts:
        base = steps.get((T, 1))
        cells = []
        for c in cps:
            r = steps.get((T, c))
            cells.append("-" if r is None else mib(r["peak"]) + (f" ({r['peak'] / base['peak']:.3f})" if base else ""))
        lines.append(f"| {T // 1024}K | " + " | ".join(cells) + " |")
    timed_out = sorted(k for k, r in res.items() if "timeout_s" in r)
    if timed_out:
        lines += ["", "Not measured (compile timed out): " + ", ".join(timed_out)]
    any_step = next(iter(steps.values()), None)
    if any_step:
        state = mib(any_step["state_bytes"])
        lines += ["", f"Train state (params + AdamW moments, replicated on every device): {state} "
                  "MiB. Breakdown of the largest T (MiB): arguments / outputs / temporaries / aliased.", "",
                  "| CP | arguments | outputs | temporaries | aliased | peak |", "|---|---|---|---|---|---|"]
        for c in cps:
            r = steps.get((Ts[-1], c))
            if r:
                lines.append(f"| {c} | {mib(r['argument'])} | {mib(r['output'])} | {mib(r['temp'])} | "
                             f"{mib(r['alias'])} | {mib(r['peak'])} |")
    lines += ["", "Collectives executed per device (count / KiB of results; `while` bodies times their trip count; "
              "trivial: over size-1 mesh axes, no traffic, not in the other columns).",
              "", "| program | " + " | ".join(KINDS) + " | trivial |", "|---" * (len(KINDS) + 2) + "|"]
    rows = [(f"KDA layer fwd+bwd, T={r['T'] // 1024}K, CP={r['cp']}", r) for k, r in sorted(res.items())
            if k.startswith("layer/kda") and "collectives" in r]
    rows += [(f"MLA layer (ring) fwd+bwd, T={r['T'] // 1024}K, CP={r['cp']}", r) for k, r in sorted(res.items())
             if k.startswith("layer/mla") and "collectives" in r]
    rows += [(f"train step, T={T // 1024}K, CP={c}", r) for (T, c), r in sorted(steps.items()) if c > 1]
    rows = [(name, r) for name, r in rows if r["collectives"].get("counter") == COUNTER]
    for name, r in rows:
        by = r["collectives"]["by_kind"]
        lines.append(f"| {name} | " + " | ".join(f"{by[k]['count']} / {by[k]['bytes'] / 1024:.1f}" if k in by else "0"
                                                 for k in KINDS) + f" | {r['collectives']['trivial']} |")
    kda = res.get(f"layer/kda/{LAYER_T}/{LAYER_CP}")
    if kda:
        lines += ["", f"LASP-2 / FLA pattern per KDA layer: one all-gather of the per-block [H, K, K+V] fp32 summary "
                  f"({kda['kda_summary_bytes'] / 1024:.0f} KiB per block; {2 * kda['cp']} blocks under zigzag = "
                  f"{2 * kda['cp'] * kda['kda_summary_bytes'] / 1024:.0f} KiB gathered) forward, and its transpose "
                  "(a reduce-scatter) backward."]
    return "\n".join(lines) + "\n"


def tpu_table(res: dict) -> str:
    """The `context_parallel_model_tpu` block: the XLA:TPU step peaks and their ratio to CP=1, beside XLA:CPU's."""
    tpu = {(r["T"], r["cp"]): r for k, r in res.items() if k.startswith("step@xla_tpu/") and "peak" in r}
    cpu = _steps(res)
    lines = ["The same ling3_tiny train step compiled by XLA:TPU (libtpu, v5p megacore: CP=1 on `v5p:1x1x1`, CP=8 on "
             "`v5p:2x2x2`; KDA by its TPU kernel `pallas_segment`, MLA flash on one device and the ring under CP) "
             "beside XLA:CPU's figure of the table above (fake devices, KDA `chunked`). MiB per device; in brackets: "
             "peak / CP=1 peak of the same compiler (goal <= 0.13 at CP=8, 64K). XLA:TPU peak: arguments + outputs + "
             "temporaries - aliased, what the planner counts; live peak: the compiler's peak of bytes live at once "
             "(`peak_memory_in_bytes`), without the temporaries' unused space.", "",
             "| T | CP | XLA:TPU peak | XLA:TPU temporaries | XLA:TPU live peak | XLA:CPU peak | commit (XLA:TPU) |",
             "|---|---|---|---|---|---|---|"]
    for (T, c), r in sorted(tpu.items()):
        base, other = tpu.get((T, 1)), cpu.get((T, c))
        ratio = f" ({r['peak'] / base['peak']:.3f})" if base else ""
        cpu_cell = "-" if other is None else mib(other["peak"]) + (
            f" ({other['peak'] / cpu[(T, 1)]['peak']:.3f})" if (T, 1) in cpu else "")
        live = "-" if "live_peak" not in r else mib(r["live_peak"]) + (
            f" ({r['live_peak'] / base['live_peak']:.3f})" if base and "live_peak" in base else "")
        lines.append(f"| {T // 1024}K | {c} | {mib(r['peak'])}{ratio} | {mib(r['temp'])} | {live} | {cpu_cell} | "
                     f"{r['commit']} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = {(r["T"], r["cp"]): r for k, r in res.items() if k.startswith("step/") and "peak" in r}
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, c in enumerate(sorted({c for _, c in steps})):
        Ts = sorted(t for t, cc in steps if cc == c)
        a.plot(Ts, [steps[(t, c)]["peak"] / 2**20 for t in Ts], f"C{i}-o", label=f"CP={c}")
        base = [t for t in Ts if (t, 1) in steps]
        b.plot(base, [steps[(t, c)]["peak"] / steps[(t, 1)]["peak"] for t in base], f"C{i}-o", label=f"CP={c}")
        b.axhline(1 / c, color=f"C{i}", lw=0.7, ls=":")
    Ts = sorted({t for t, _ in steps})
    for ax, ylabel in ((a, "per-device peak (MiB)"), (b, "peak / CP=1 peak (dotted: 1/CP)")):
        ax.set(xscale="log", yscale="log", xlabel="T (tokens per row)", ylabel=ylabel)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xticks(Ts, [f"{t // 1024}K" for t in Ts])
        ax.legend(fontsize=8)
    a.set_title("ling3_tiny train step, compiled per-device peak (XLA:CPU)")
    b.set_title("ratio to one device")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write(res: dict, key: str | None = None) -> None:
    """Rewrite the json (and the plot); with `key`, merge only res[key] into what the file holds now, so a CPU
    and a TPU run going at once both keep their rows."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "model_memory.json"
    if key is not None and path.exists():
        res.update({k: v for k, v in json.loads(path.read_text()).items() if k != key})
    path.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    if any(k.startswith("step/") and "peak" in r for k, r in res.items()):
        plot(res, OUT / "model_memory.png")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per configuration's compile")
    parser.add_argument("--retry-timeouts", action="store_true", help="recompile configurations that timed out")
    parser.add_argument("--remeasure", action="store_true", help="compile the configurations asked for again, on the "
                        "current code, replacing what the json holds for them")
    parser.add_argument("--jobs", type=int, default=1, help="configurations compiled at once (one process each)")
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--compiler", choices=["cpu", "tpu"], default="cpu", help="tpu: the train step only, compiled "
                        "by XLA:TPU (libtpu) for CP v5p chips; keyed step@xla_tpu/T/CP")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        what, T, cp = args.worker[0], int(args.worker[1]), int(args.worker[2])
        compiler = args.worker[3] if len(args.worker) > 3 else "cpu"
        print(json.dumps(measure_step(T, cp, compiler) if what == "step" else measure_layer(what, T, cp)))
        return 0
    path = OUT / "model_memory.json"
    res = json.loads(path.read_text()) if path.exists() else {}
    if args.compiler == "tpu":
        todo = [(f"step@xla_tpu/{T}/{cp}", ["step", str(T), str(cp), "tpu"]) for T in args.T for cp in args.cp]
        todo = [(key, a) for key, a in todo if key not in res or args.remeasure]
        for key, worker_args in todo:   # one at a time: merged into the json as each arrives
            got = run_one(key, worker_args, args.timeout)
            if got is not None:
                res[key] = got
                write(res, key)
                print(f"{key}: {json.dumps({k: v for k, v in got.items() if k != 'collectives'})}", flush=True)
        print(tpu_table(res))
        return 0
    todo = [(f"layer/{k}/{LAYER_T}/{LAYER_CP}", [k, str(LAYER_T), str(LAYER_CP)]) for k in ("kda", "mla")]
    todo += [(f"step/{T}/{cp}", ["step", str(T), str(cp)]) for T in args.T for cp in args.cp]
    todo = [(key, a) for key, a in todo
            if key not in res or args.remeasure or ("timeout_s" in res[key] and args.retry_timeouts)]
    lock = threading.Lock()

    def one(item):
        key, worker_args = item
        got = run_one(key, worker_args, args.timeout)
        if got is not None:
            with lock:   # merge and rewrite the artifacts as each configuration arrives
                res[key] = got
                write(res, key)
            print(f"{key}: {json.dumps({k: v for k, v in got.items() if k != 'collectives'})}", flush=True)

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, [] if args.table_only else todo))
    if not todo or args.table_only:
        write(res)
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
