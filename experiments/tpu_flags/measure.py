"""Each XLA:TPU flag group's effect on a compiled FSDP layer stack for 8 v5p chips (compile only, nothing runs).

    python -m experiments.tpu_flags.measure            # every flag set, one fresh process each -> results/flags.json
    python -m experiments.tpu_flags.measure --table    # the `tpu_flags` results block from the json

Program: forward + backward of a scan over L SwiGLU-free MLP layers (x @ W1 -> gelu -> @ W2 + x), weights
[L, D, F] split over `fsdp` (8 chips, `v5p:2x2x2` megacore), rows split over `fsdp`: each layer all-gathers
its weights, its backward reduce-scatters their gradients. libtpu reads LIBTPU_INIT_ARGS once, at backend
init, so each flag set compiles in its own process. Read from the compiled (scheduled) HLO: the async
collectives (`*-start` / `*-done` pairs), how many compute instructions (fusions, convolutions, custom
calls) the schedule places between each start and its done (work the collective can hide behind), and
XLA's memory_analysis / cost_analysis (`optimal_seconds`, which counts a while body once).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "results"
L, D, F, ROWS, T = 4, 2048, 8192, 8, 2048
COMPUTE = ("fusion", "convolution", "custom-call", "dot")


def flag_sets() -> dict:
    from lingpack import tpu_flags
    sets = {"libtpu defaults": []}
    sets |= {group: tpu_flags.flags_for("v5p", (group,)) for group in tpu_flags.GENERATIONS["v5p"]}
    sets["v5p table (all)"] = tpu_flags.flags_for("v5p")
    return sets


def schedule(text: str) -> dict:
    """Async collective pairs and the compute instructions scheduled between each start and its done."""
    ops = []   # (name, opcode) in printed (schedule) order, every computation
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = [^=]*?\s([a-z][\w\-]*)\(", line)
        if m:
            ops.append((m.group(1), m.group(2), line))
    pairs, position = [], {name: i for i, (name, _, _) in enumerate(ops)}
    for i, (name, opcode, line) in enumerate(ops):
        if opcode.endswith("-done"):
            started = re.search(r"-done\(%?([\w.\-]+)", line)
            j = position.get(started.group(1)) if started else None
            if j is not None and j < i:
                between = sum(op.startswith(COMPUTE) for _, op, _ in ops[j + 1:i])
                pairs.append((ops[j][1], between))
    kinds = sorted({k for k, _ in pairs})
    return {"async_pairs": {k: sum(1 for kk, _ in pairs if kk == k) for k in kinds},
            "overlapped": {k: sum(1 for kk, b in pairs if kk == k and b > 0) for k in kinds},
            "compute_between": {k: sum(b for kk, b in pairs if kk == k) for k in kinds},
            "sync_collectives": {op: sum(1 for _, o, _ in ops if o == op)
                                 for op in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all")
                                 if any(o == op for _, o, _ in ops)}}


def one() -> dict:
    from experiments import xla_tpu
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = xla_tpu.devices("v5p:2x2x2")
    mesh = Mesh(devices, ("fsdp",))
    w_spec, x_spec = NamedSharding(mesh, P(None, "fsdp", None)), NamedSharding(mesh, P("fsdp", None, None))

    def loss(w1_LDF, w2_LFD, x_BTD):
        def layer(x, w):
            h = jax.nn.gelu(jnp.einsum("btd,df->btf", x, w[0]))
            return x + jnp.einsum("btf,fd->btd", h, w[1]), None
        x, _ = jax.lax.scan(jax.checkpoint(layer), x_BTD, (w1_LDF, w2_LFD))
        return jnp.mean(x.astype(jnp.float32) ** 2)

    args = (jax.ShapeDtypeStruct((L, D, F), jnp.bfloat16, sharding=w_spec),
            jax.ShapeDtypeStruct((L, F, D), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "fsdp", None))),
            jax.ShapeDtypeStruct((ROWS, T, D), jnp.bfloat16, sharding=x_spec))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)), out_shardings=(w_spec, w_spec))   # gradients stay split: reduce-scatter
    compiled = grads.lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return dict(xla_tpu.memory(compiled), **schedule(compiled.as_text()), flops=float(cost.get("flops", 0)),
                optimal_seconds=float(cost.get("optimal_seconds", -1)))


def run_all() -> dict:
    results = {"compiler": "xla_tpu", "topology": "v5p:2x2x2", "program": dict(L=L, D=D, F=F, rows=ROWS, T=T),
               "sets": {}}
    from experiments.provenance import commit
    results["commit"] = commit()
    for name, flags in flag_sets().items():
        env = dict(os.environ, LIBTPU_INIT_ARGS=" ".join(flags), JAX_PLATFORMS="cpu")
        proc = subprocess.run([sys.executable, "-m", "experiments.tpu_flags.measure", "--one"], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=1200)
        got = (json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0
               else {"error": proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else "failed"})
        results["sets"][name] = dict(got, flags=flags)
        print(name, json.dumps(got), flush=True)
        OUT.mkdir(exist_ok=True)
        (OUT / "flags.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def table(res: dict) -> str:
    lines = [f"XLA:TPU compile of an FSDP layer stack (L={res['program']['L']}, D={res['program']['D']}, "
             f"F={res['program']['F']}, bf16, forward + backward, rows split over fsdp) for 8 v5p chips "
             f"(`{res['topology']}`), one fresh process per flag set (commit {res['commit']}). Async pairs: "
             "collective start/done pairs in the scheduled HLO (overlapped: with compute scheduled between start "
             "and done); `optimal_seconds` is XLA's estimate (a while body counted once).", "",
             "| flag set | async pairs (overlapped) | sync collectives | temporaries MiB | optimal_seconds |",
             "|---|---|---|---:|---:|"]
    for name, r in res["sets"].items():
        if "error" in r:
            lines.append(f"| {name} | compile failed: {r['error']} | | | |")
            continue
        pairs = ", ".join(f"{k} {n} ({r['overlapped'][k]})" for k, n in r["async_pairs"].items()) or "none"
        sync = ", ".join(f"{k} {n}" for k, n in r["sync_collectives"].items()) or "none"
        lines.append(f"| {name} | {pairs} | {sync} | {r['temp'] / 2**20:.1f} | {r['optimal_seconds']:.2e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if "--one" in sys.argv:
        print(json.dumps(one()))
    elif "--table" in sys.argv:
        print(table(json.loads((OUT / "flags.json").read_text())))
    else:
        print(table(run_all()))
