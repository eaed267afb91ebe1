"""Cost model of the Pallas KDA kernels: pallas_varlen (the aligned cu_seqlens layout) vs pallas_segment.

Nothing here runs on a TPU. Each implementation's forward and gradient are traced (`jax.make_jaxpr`) at
the production shape; for every `pallas_call` in the trace:
  * compute per grid step is counted from the kernel body's own jaxpr (`pallas_common.jaxpr_cost`):
    MXU FLOPs = 2*M*N*K per dot_general, VPU ops = output elements of every other vector op,
    transcendentals = elements of exp/log1p/logistic/rsqrt; times the number of grid steps;
  * HBM traffic is the pipeline's DMA traffic: every BlockSpec's index_map is evaluated over the whole
    grid (with the real scalar-prefetch tables for varlen); a block moves once per run of equal
    consecutive block indices (fetched for inputs, written back for outputs), times its bytes.
Per-step cost is independent of the segmentation; varlen's grid is static in T_new, so its cost grows
with max_segs whatever the batch holds. The wrapper's XLA layout copies (transposes, the aligned scatter)
are estimated apart (`layout_bytes`). `--time` adds CPU interpret-mode wall times at a small shape: a
sanity figure for the implementation, not a TPU measurement.

Budget table: per training call (forward + gradient) of each design and precision policy at T = 8K and
512K: grid steps, MXU FLOPs, bf16 MXU passes (an fp32 HIGHEST product = 6 passes, a bf16-operand one = 1)
and each kernel's pipeline VMEM (every in/out block double-buffered + scratch) with the vmem_limit_bytes it
sets, for the code measured now and for the rows of another tree kept in results/budget_<label>.json. To
trace another commit's kernels, put its `src` first on the path and write only its budget rows:

    python -m experiments.pallas_cost.cost_model [--time]     # writes results/results.json and budget_<commit>.json
    git archive 16217d5 src | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/src python -m experiments.pallas_cost.cost_model --budget-only --label 16217d5

`summary` renders the `pallas_cost` results block of the docs and `markdown` the full `pallas_cost_detail`
block of this folder's README, both from results/results.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.extend  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src.pallas import core as pallas_core  # noqa: E402
from jax._src.state.discharge import discharge_state  # noqa: E402

from experiments.provenance import commit  # noqa: E402
from lingpack.kernels.kda import api, pallas_common, pallas_varlen, segments  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"
# The recorded budget rows were labelled before labels named commits: the code each label measured.
TREES = {"before": "16217d5", "after": "a1ec57f"}
FP32_ONLY = {"before", "16217d5"}   # trees whose kernels had no precision policy: every matmul fp32 HIGHEST
B, T, H, K, V, C = 1, 8192, 16, 128, 128, 64
MAX_SEGS = [8, 16, 32, 64, 128]
IMPLS = ["pallas_varlen", "pallas_segment"]


def segmentation(n_docs: int, seed: int = 0) -> np.ndarray:
    """One row of T tokens holding exactly n_docs documents of random lengths (the configured capacity)."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, T), n_docs - 1, replace=False)) if n_docs > 1 else np.array([], int)
    lengths = np.diff(np.concatenate([[0], cuts, [T]]))
    return np.repeat(np.arange(1, n_docs + 1), lengths).astype(np.int32)[None]


def dma_bytes(eqn, prefetch) -> int:
    """HBM<->VMEM bytes moved by the pipeline of one pallas_call (see the module docstring)."""
    gm = eqn.params["grid_mapping"]
    grid = tuple(int(n) for n in gm.grid)
    points = np.stack(np.meshgrid(*[np.arange(n) for n in grid], indexing="ij"), -1).reshape(-1, len(grid))
    points = [jnp.asarray(points[:, d], jnp.int32) for d in range(len(grid))]   # row-major: last dim fastest
    total = 0
    for bm in gm.block_mappings:
        closed = discharge_state(bm.index_map_jaxpr)
        n_idx = len(bm.block_shape)
        fn = jax.extend.core.jaxpr_as_fun(closed)
        idx = jax.vmap(lambda *p: jnp.stack(fn(*p, *prefetch)[:n_idx]))(*points)   # [steps, ndim]
        runs = 1 + int(np.sum(np.any(np.diff(np.asarray(idx), axis=0) != 0, axis=1)))
        block = pallas_core._get_block_shape(bm.block_shape)   # squeezed dims count 1
        total += runs * math.prod(block) * jnp.dtype(bm.array_aval.dtype).itemsize
    return total


def pass_flops(jaxpr) -> int:
    """MXU FLOPs weighted by bf16 passes: 16-bit operands 1, fp32 at HIGHEST 6, at HIGH 3 (DEFAULT 1)."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            flops = 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(eqn.invars[0].aval.shape[d] for d in contract)
            precision = eqn.params.get("precision")
            precision = precision[0] if isinstance(precision, tuple) else precision
            passes = 1 if all(jnp.dtype(v.aval.dtype).itemsize <= 2 for v in eqn.invars) else {
                jax.lax.Precision.HIGHEST: 6, jax.lax.Precision.HIGH: 3}.get(precision, 1)
            total += flops * passes
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
                if hasattr(inner, "eqns"):
                    total += pass_flops(inner)
    return total


def vmem_bytes(eqn) -> int:
    """Pipeline VMEM of one pallas_call: every in/out block double-buffered, plus its scratch buffers."""
    gm = eqn.params["grid_mapping"]
    blocks = sum(math.prod(pallas_core._get_block_shape(bm.block_shape)) * jnp.dtype(bm.array_aval.dtype).itemsize
                 for bm in gm.block_mappings)
    scratch = eqn.params["jaxpr"].invars[len(eqn.params["jaxpr"].invars) - gm.num_scratch_operands:]
    return 2 * blocks + sum(math.prod(v.aval.shape) * jnp.dtype(v.aval.dtype).itemsize for v in scratch)


def kernel_costs(fn, args, prefetch, dma=True) -> dict:
    calls = pallas_common.pallas_calls(jax.make_jaxpr(fn)(*args).jaxpr)
    out = {"kernels": {}}
    for eqn in calls:
        steps = math.prod(int(n) for n in eqn.params["grid_mapping"].grid)
        per_step = pallas_common.jaxpr_cost(eqn.params["jaxpr"])
        entry = {k: steps * v for k, v in per_step.items()}
        params = eqn.params.get("compiler_params")
        entry.update(mxu_pass_flops=steps * pass_flops(eqn.params["jaxpr"]), vmem_bytes=vmem_bytes(eqn),
                     vmem_limit_bytes=getattr(params, "vmem_limit_bytes", None), steps=steps)
        entry.update(grid=[int(n) for n in eqn.params["grid_mapping"].grid],
                     hbm_bytes=dma_bytes(eqn, prefetch if eqn.params["grid_mapping"].num_index_operands else ())
                     if dma else 0)
        out["kernels"][eqn.params["name"]] = entry
    for key in ("mxu_flops", "mxu_pass_flops", "vpu_ops", "transcendentals", "hbm_bytes", "steps"):
        out[key] = sum(k[key] for k in out["kernels"].values())
    return out


def shapes():
    bf, f32 = jnp.bfloat16, jnp.float32
    return [jax.ShapeDtypeStruct((B, T, H, K), bf)] * 2 + [jax.ShapeDtypeStruct((B, T, H, V), bf),
                                                           jax.ShapeDtypeStruct((B, T, H, K), f32),
                                                           jax.ShapeDtypeStruct((B, T, H), f32)]


def costs_for(impl, seg, max_segs, safe_gate):
    kw = dict(segment_ids=jnp.asarray(seg), impl=impl, chunk_size=C, max_segs=max_segs, safe_gate=safe_gate,
              output_final_state=True, interpret=False)
    fwd = lambda *a: api.chunk_kda(*a, **kw)

    def loss(*a):
        o, s = fwd(*a)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)
    prefetch = ()
    if impl == "pallas_varlen":
        prefetch = tuple(pallas_varlen.aligned_layout(jnp.asarray(seg), max_segs, C).tables)
    train = kernel_costs(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), shapes(), prefetch)
    forward = kernel_costs(fwd, shapes(), prefetch)
    return {"forward": forward, "train": train}


BUDGET_T = [8192, 1 << 19]


def budget_rows(label: str) -> list:
    """Per training call at [1, T, 16, 128] bf16 for each design and precision policy (see the docstring)."""
    import inspect
    policies = [None, "highest"] if "precision" in inspect.signature(api.chunk_kda).parameters else [None]
    rows = []
    for impl in IMPLS:
        for precision in policies:
            for t in BUDGET_T:
                kw = dict(segment_ids=jnp.ones((B, t), jnp.int32), impl=impl, chunk_size=C, max_segs=64,
                          output_final_state=True, interpret=False)
                kw.update({"precision": precision} if precision else {})

                def loss(*a):
                    o, s = api.chunk_kda(*a, **kw)
                    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)
                bf, f32 = jnp.bfloat16, jnp.float32
                args = [jax.ShapeDtypeStruct((B, t, H, K), bf)] * 3 + [jax.ShapeDtypeStruct((B, t, H, K), f32),
                                                                       jax.ShapeDtypeStruct((B, t, H), f32)]
                c = kernel_costs(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), args, (), dma=False)
                limits = [k["vmem_limit_bytes"] for k in c["kernels"].values()]
                rows.append(dict(label=label, impl=impl, precision=precision or "by dtype", T=t, steps=c["steps"],
                                 mxu_flops=c["mxu_flops"], mxu_pass_flops=c["mxu_pass_flops"],
                                 kernels=sorted(c["kernels"]),
                                 max_vmem_bytes=max(k["vmem_bytes"] for k in c["kernels"].values()),
                                 vmem_limit_bytes=None if None in limits else max(limits)))
                print(label, impl, precision, t, "done", flush=True)
    return rows


def budget_markdown(rows) -> str:
    lines = ["| tree | impl | matmul precision | T | grid steps | MXU GFLOP | bf16 MXU passes (G) | "
             "max kernel VMEM MiB | vmem_limit MiB |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        precision = "fp32 HIGHEST (all)" if r["label"] in FP32_ONLY or r["precision"] == "highest" else \
            "bf16 bulk, fp32 cumsum + inverse"
        limit = "unset" if r["vmem_limit_bytes"] is None else f"{r['vmem_limit_bytes'] / 2**20:.0f}"
        lines.append(f"| {TREES.get(r['label'], r['label'])} | {r['impl']} | {precision} | {r['T']} | {r['steps']} | "
                     f"{r['mxu_flops'] / 1e9:.1f} | {r['mxu_pass_flops'] / 1e9:.1f} | "
                     f"{r['max_vmem_bytes'] / 2**20:.2f} | {limit} |")
    return "\n".join(lines) + "\n"


def xla_chunked_costs():
    """XLA's own cost analysis of the jnp implementations at the same shape (CPU compile, not run)."""
    out = {}
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32)
    for impl in ("chunked", "chunked_aligned"):
        f = jax.jit(lambda q, k, v, g, beta, s, impl=impl: api.chunk_kda(q, k, v, g, beta, segment_ids=s, impl=impl,
                                                                         max_segs=64, output_final_state=True))
        ca = f.lower(*shapes(), seg).compile().cost_analysis()
        ca = ca[0] if isinstance(ca, list) else ca
        out[impl] = {"flops": float(ca.get("flops", 0)), "bytes_accessed": float(ca.get("bytes accessed", 0))}
    return out


def interpret_timings(repeats=3):
    """Wall time of forward and forward+backward in CPU interpret mode at a small shape (sanity only)."""
    Bs, Ts, Hs, Ks = 1, 512, 2, 64
    rng = np.random.default_rng(0)
    xs = [jnp.asarray(rng.standard_normal((Bs, Ts, Hs, Ks)), jnp.float32) for _ in range(3)]
    xs[1] = xs[1] / jnp.linalg.norm(xs[1], axis=-1, keepdims=True)
    g = -jnp.abs(jnp.asarray(rng.standard_normal((Bs, Ts, Hs, Ks)), jnp.float32))
    beta = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((Bs, Ts, Hs)), jnp.float32))
    seg = jnp.asarray(np.repeat([1, 2, 3, 4], [100, 200, 37, 175])[None], jnp.int32)
    out = {"shape": dict(B=Bs, T=Ts, H=Hs, K=Ks, V=Ks, dtype="float32", max_segs=8)}
    for impl in ["chunked", "pallas_varlen", "pallas_segment"]:
        fwd = jax.jit(lambda *a, impl=impl: api.chunk_kda(*a, segment_ids=seg, impl=impl, max_segs=8)[0])
        grad = jax.jit(jax.grad(lambda *a, impl=impl: jnp.sum(api.chunk_kda(*a, segment_ids=seg, impl=impl,
                                                                             max_segs=8)[0]), argnums=(0, 1, 2, 3, 4)))
        entry = {}
        for name, f in (("forward_s", fwd), ("forward_backward_s", grad)):
            jax.block_until_ready(f(*xs, g, beta))   # compile
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(f(*xs, g, beta))
                times.append(time.perf_counter() - t0)
            entry[name] = float(np.median(times))
        out[impl] = entry
    return out


def layout_bytes(impl: str, t_buffer: int, train: bool) -> int:
    """The wrapper's XLA copies into and out of the kernel layout, assuming each fuses into one pass.

    pallas_varlen: q, k, v (bf16), g, beta (fp32) are read at T and scattered into the aligned buffer of
    T_new tokens, o gathered back (and in the backward do in, dq, dk, dv, dg, dbeta out).
    pallas_segment at K = V = 128 and T a chunk multiple: q, k, v, g, o, and their gradients, are free
    reshapes of [B, T, H*K]; only the beta table [B, H, NT, C] (and dbeta) is transposed, plus the id table.
    """
    per_token = H * (2 * K * 2 + V * 2 + K * 4 + 4) + H * V * 2          # q, k, v, g, beta; o
    if impl == "pallas_segment":
        fwd = B * T * (2 * H * 4 + 3 * 4)                                  # beta in; ids: read, fill, write
        return fwd + (B * T * 2 * H * 4 if train else 0)                   # dbeta out
    fwd = B * (T + t_buffer) * per_token
    return fwd * (2 if train else 1)


def markdown(results) -> str:
    """The full report (the `pallas_cost_detail` block), from results.json."""
    seg = results["rows"][0]["pallas_segment"]["exact"]
    code = TREES.get(results.get("commit", "after"), results.get("commit"))
    lines = [f"Per call at B={B}, T={T}, H={H}, K=V={K}, bf16 inputs, chunk {C}, exact path (any g <= 0), the kernels"
             f" at commit {code}. `train` = "
             "forward + backward (forward, state-recompute and reverse-gradient kernels). GFLOP = MXU matmul FLOPs as "
             "issued by the kernels; GB = kernel HBM traffic (every block the Pallas pipeline DMAs in or out); "
             "layout GB = the wrapper's XLA copies into the kernel layout and back (estimate, see cost_model.py).", "",
             "| max_segs | T_new | T_new/T | varlen fwd GFLOP | varlen train GFLOP | varlen fwd GB | varlen train GB | "
             "varlen train layout GB | segment-native saves (train FLOPs / kernel bytes) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in results["rows"]:
        v = row["pallas_varlen"]["exact"]
        lines.append(
            f"| {row['max_segs']} | {row['t_new']} | {row['t_new'] / T:.2f} | {v['forward']['mxu_flops'] / 1e9:.1f} | "
            f"{v['train']['mxu_flops'] / 1e9:.1f} | {v['forward']['hbm_bytes'] / 1e9:.2f} | "
            f"{v['train']['hbm_bytes'] / 1e9:.2f} | {layout_bytes('pallas_varlen', row['t_new'], True) / 1e9:.2f} | "
            f"{1 - seg['train']['mxu_flops'] / v['train']['mxu_flops']:.0%} / "
            f"{1 - seg['train']['hbm_bytes'] / v['train']['hbm_bytes']:.0%} |")
    lines += [f"| **segment-native**, any count | {T} | 1.00 | {seg['forward']['mxu_flops'] / 1e9:.1f} | "
              f"{seg['train']['mxu_flops'] / 1e9:.1f} | {seg['forward']['hbm_bytes'] / 1e9:.2f} | "
              f"{seg['train']['hbm_bytes'] / 1e9:.2f} | {layout_bytes('pallas_segment', T, True) / 1e9:.3f} | - |", "",
              "Per chunk of one head (a grid step processes several heads), the same for both designs; the exact "
              "path forms the pairs inside each 16-token sub-block explicitly (VPU + exp), the safe-gate path "
              "(g >= -5) with one factored matmul per product. bf16 inputs, so the bulk matmuls take bf16 operands "
              "(1 MXU pass) and the cumsum and the WY inverse stay fp32 HIGHEST (6 passes); the forward saves each "
              "chunk's inverse, so the states and gradient kernels do not recompute it:", "",
              "| kernel | path | MXU MFLOP | bf16 MXU passes (M) | VPU Mop | transcendentals (k) |",
              "|---|---|---:|---:|---:|---:|"]
    head_chunks = B * H * (T // C)
    for kernel in ("fwd", "states", "bwd"):
        for path in ("exact", "safe_gate"):
            k = results["rows"][0]["pallas_segment"][path]["train"]["kernels"][f"kda_segment_{kernel}"]
            lines.append(f"| {kernel} | {path} | {k['mxu_flops'] / head_chunks / 1e6:.1f} | "
                         f"{k['mxu_pass_flops'] / head_chunks / 1e6:.1f} | "
                         f"{k['vpu_ops'] / head_chunks / 1e6:.2f} | {k['transcendentals'] / head_chunks / 1e3:.0f} |")
    lines.append("")
    if results.get("budget"):
        lines += ["Per training call (forward + states + gradient kernels) of each recorded tree at B=1, H=16, "
                  "K=V=128, bf16 inputs, one document per row (the exact path; the fwd, states and bwd kernels):", "",
                  budget_markdown(results["budget"])]
    if "xla" in results:
        x = results["xla"]
        lines += [f"Cross-check, XLA's cost analysis of the jnp forward at the same shape (CPU compile): `chunked` "
                  f"{x['chunked']['flops'] / 1e9:.1f} GFLOP, `chunked_aligned` (max_segs=64) "
                  f"{x['chunked_aligned']['flops'] / 1e9:.1f} GFLOP. They are lower because XLA counts the state "
                  "recurrence (a while loop) once instead of once per chunk, and because `chunked` slices 16x16 "
                  "sub-blocks where the kernels issue masked full 64x64 products and a 2 log2(64)-matmul inverse "
                  "(on a 128x128 MXU the smaller products would not be cheaper).", ""]
    if "interpret" in results:
        t = results["interpret"]
        shape = ", ".join(f"{k}={v}" for k, v in t["shape"].items())
        lines += ["**Measured times: only CPU interpret mode exists** (no TPU or GPU run was possible; the Pallas "
                  f"kernels run as XLA loops on 2 shared CPU cores; a sanity figure, not a performance result) at "
                  f"{shape}:", "", "| impl | forward s | forward+backward s |", "|---|---:|---:|"]
        for impl in ("chunked", "pallas_varlen", "pallas_segment"):
            lines.append(f"| {impl}{' (XLA, not Pallas)' if impl == 'chunked' else ''} | {t[impl]['forward_s']:.3f} | "
                         f"{t[impl]['forward_backward_s']:.3f} |")
    return "\n".join(lines) + "\n"


def summary(results) -> str:
    """The `pallas_cost` results block: each recorded tree's budget at 8K, and segment-native against cu_seqlens."""
    budget = {(r["label"], r["impl"], r["T"]): r for r in results["budget"] if r["precision"] == "by dtype"}
    labels = list(dict.fromkeys(r["label"] for r in results["budget"]))
    lines = ["| tree (commit) | impl | grid steps | MXU GFLOP | bf16 MXU passes (G) | max kernel VMEM at T=512K |",
             "|---|---|---:|---:|---:|---:|"]
    for impl in ("pallas_segment", "pallas_varlen"):
        for label in labels:
            short, long = budget[(label, impl, T)], budget[(label, impl, max(BUDGET_T))]
            growth = "constant" if long["max_vmem_bytes"] == short["max_vmem_bytes"] else "grows with T"
            lines.append(f"| {TREES.get(label, label)} | `{impl}`"
                         f"{' (max_segs 64)' if impl == 'pallas_varlen' else ''} | {short['steps']} | "
                         f"{short['mxu_flops'] / 1e9:.1f} | {short['mxu_pass_flops'] / 1e9:.1f} | "
                         f"{long['max_vmem_bytes'] / 2**20:.1f} MiB ({growth}) |")
    seg = results["rows"][0]["pallas_segment"]["exact"]["train"]
    code = TREES.get(results.get("commit", "after"), results.get("commit"))
    lines += ["", f"Segment-native against the aligned cu_seqlens layout at commit {code} (forward+backward FLOPs / "
              "kernel bytes it saves):",
              "", "| max_segs | T_new/T | `pallas_varlen` GFLOP | `pallas_varlen` kernel GB | "
              "what `pallas_segment` saves (FLOPs / bytes) |", "|---:|---:|---:|---:|---:|"]
    for row in results["rows"]:
        v = row["pallas_varlen"]["exact"]["train"]
        lines.append(f"| {row['max_segs']} | {row['t_new'] / T:.2f} | {v['mxu_flops'] / 1e9:.1f} | "
                     f"{v['hbm_bytes'] / 1e9:.2f} | {1 - seg['mxu_flops'] / v['mxu_flops']:.0%} / "
                     f"{1 - seg['hbm_bytes'] / v['hbm_bytes']:.0%} |")
    lines.append(f"| `pallas_segment`, any count | 1.00 | {seg['mxu_flops'] / 1e9:.1f} |"
                 f" {seg['hbm_bytes'] / 1e9:.2f} | |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time", action="store_true", help="also time CPU interpret mode at a small shape")
    parser.add_argument("--no-xla", action="store_true", help="skip the XLA cost-analysis cross-check")
    parser.add_argument("--budget-only", action="store_true", help="only this tree's budget rows")
    parser.add_argument("--label", default=None, help="name of the tree in the budget table (default: its commit)")
    args = parser.parse_args()
    label = args.label or commit()
    budget = budget_rows(label)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"budget_{label}.json").write_text(json.dumps(budget, indent=1))
    if args.budget_only:
        return
    rows = []
    for max_segs in MAX_SEGS:
        seg = segmentation(max_segs)
        t_new = segments.aligned_length(B * T, max_segs, C)
        row = {"max_segs": max_segs, "t_new": t_new,
               "layout_train_bytes": {impl: layout_bytes(impl, t_new, True) for impl in IMPLS}}
        for impl in IMPLS:
            if impl == "pallas_segment" and rows:
                row[impl] = rows[0][impl]   # independent of max_segs and of the segmentation
                continue
            row[impl] = {path: costs_for(impl, seg, max_segs, path == "safe_gate") for path in ("exact", "safe_gate")}
        rows.append(row)
        print(f"max_segs={max_segs}: done", flush=True)
    results = {"shape": dict(B=B, T=T, H=H, K=K, V=V, chunk=C, dtype="bfloat16"), "rows": rows}
    if not args.no_xla:
        results["xla"] = xla_chunked_costs()
    if args.time:
        results["interpret"] = interpret_timings()
    others = [p for p in sorted(OUT.glob("budget_*.json")) if p.name != f"budget_{label}.json"]
    results["budget"] = [r for p in others for r in json.loads(p.read_text())] + budget
    results["commit"] = label
    (OUT / "results.json").write_text(json.dumps(results, indent=1))
    print(markdown(results))


if __name__ == "__main__":
    main()
