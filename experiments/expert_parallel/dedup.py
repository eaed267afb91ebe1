"""What sending each token once per expert device, instead of once per chosen expert, would save the flagship's
MoE layer: every op the change adds and removes, compiled by XLA:TPU and costed as the planner costs the step.

    python -m experiments.expert_parallel.dedup            # compiles every case -> results/dedup.json
    python -m experiments.expert_parallel.dedup --table    # the `expert_dedup` results block from the json

Today (parallel/expert.py) a device sorts its N x k (token, expert) rows by expert and sends each row to the
device of its expert: at k = 8 a token's row travels 8 times, though the flagship's group-limited routing (8
groups of 16 experts, the best 4 groups kept) puts its experts on at most 4 of the 8 devices at `expert=8`.
Sent once per (token, device) pair instead (DeepSeek-V3's dispatch), the exchanges move about half the rows,
and so do the sender's sort and combine. The receiver then has two jobs it does not have today: copy each pair's
row to each of its local experts' groups (the expansion), and sum a pair's weighted expert outputs into the
one row that travels back (the receiver's combine), each with its backward. This script costs all of them
before any of it is built, on the flagship's shapes at T=8192 (N = 8,192 tokens a device, D = 1,536):

- the ragged all-to-all of the sent rows (today's P = 67,456 sorted places; per pair Pp = 32,880), compiled for
  an 8-chip expert group (v5p 2x2x2, v6e 2x4), costed with its devices' torus coordinates;
- the sender's token sort and combine (`models/moe.py` `sort_rows`, `combine_rows`) at k = 8 and k = 4;
- the receiver's expansion and combine over a buffer of Wp = 40,960 pair rows (1.25 x the balanced 32,768)
  into the A = 84,480 rows the experts read today, each of up to 8 local experts a pair: as [8, Wp, D] slabs
  (the formulation `sort_rows` and `combine_rows` use) and as XLA's scatter-add (a gather's own transpose).

The layer's total under the flagship's remat (`nothing_saveable`: the forward runs twice, the backward once;
6 exchanges) today and per pair, with the cheaper receiver formulation. Compile-time estimates (the
planner's cost model, `lingpack.plan.cost`), nothing runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from experiments import xla_tpu

OUT = Path(__file__).resolve().parent / "results"
N, K, D, R, U = 8192, 8, 1536, 8, 16
PAIRS_PER_TOKEN = 4          # topk_groups at one expert group per device
P_ = 67456                   # expert.padded_rows(N * K, 128, U): today's sorted places
PP = 32880                   # expert.padded_rows(N * PAIRS_PER_TOKEN, R, U): pair places, padded per device
WP = 40960                   # pair receive rows: 1.25 x N * PAIRS_PER_TOKEN
A = 84480                    # the experts' rows (today's receive buffer)
SLOTS = 8                    # local experts a pair can hold (min(k, experts per device))
GROUPS = {"v5p": "v5p:2x2x2", "v6e": "v6e:2x4"}
LAYERS = 23                  # MoE layers of a step: 22 in the stack, the MTP layer's


def _single_cases():
    """name -> (argument shapes, forward fn, forward + backward fn (the output's cotangent one more argument),
    the cotangent's shape)."""
    import jax
    import jax.numpy as jnp

    from lingpack.models import moe
    f32, bf, i32 = jnp.float32, jnp.bfloat16, jnp.int32

    def with_vjp(fn, primals, cotangent):   # the output and the cotangents (the forward kept: not dead code); the
        # output's cotangent is an argument (a constant one would be materialised, or folded into the gathers)
        out, vjp = jax.vjp(fn, *primals)
        return out, vjp(cotangent)

    def sort(n, k, places):
        args = [((n, D), bf), ((places,), i32), ((n * k,), i32)]
        fwd = lambda x, from_P, to_M: moe.sort_rows(x, from_P, to_M)
        both = lambda x, from_P, to_M, d: with_vjp(lambda x: fwd(x, from_P, to_M), (x,), d)
        return args, fwd, both, ((places, D), bf)

    def combine(n, k, places, weighted):   # the cotangents of the rows (and of the weights where they are weighted)
        args = [((places, D), bf), ((n * k,), i32), ((places,), i32), ((n, k), f32)]
        fwd = moe.combine_rows

        def both(y, to_M, from_P, w, d):
            if weighted:
                return with_vjp(lambda y, w: fwd(y, to_M, from_P, w), (y, w), d)
            return with_vjp(lambda y: fwd(y, to_M, from_P, w), (y,), d)
        return args, fwd, both, ((n, D), f32)

    def expand_scatter():   # each received pair row to its experts' rows; the backward XLA's scatter-add
        args = [((WP, D), bf), ((A,), i32)]
        fwd = lambda pairs, src_A: pairs[src_A]
        both = lambda pairs, src_A, d: with_vjp(lambda p: fwd(p, src_A), (pairs,), d)
        return args, fwd, both, ((A, D), bf)

    def combine_scatter():  # a pair's weighted expert outputs summed by scatter-add, fp32, into bf16 rows
        args = [((A, D), bf), ((A,), i32), ((A,), f32)]

        def fwd(y, pair_A, w_A):
            acc = jnp.zeros((WP, D), f32).at[pair_A].add(y.astype(f32) * w_A[:, None])
            return acc.astype(bf)
        both = lambda y, pair_A, w_A, d: with_vjp(lambda y, w: fwd(y, pair_A, w), (y, w_A), d)
        return args, fwd, both, ((WP, D), bf)

    return {
        "sender sort, per expert (k=8)": sort(N, K, P_),
        "sender sort, per pair (4)": sort(N, PAIRS_PER_TOKEN, PP),
        "sender combine, per expert (k=8, weighted)": combine(N, K, P_, True),
        "sender combine, per pair (4 partial sums)": combine(N, PAIRS_PER_TOKEN, PP, False),
        "receiver expansion, slabs": sort(WP, SLOTS, A),
        "receiver expansion, scatter-add": expand_scatter(),
        "receiver combine, slabs": combine(WP, SLOTS, A, True),
        "receiver combine, scatter-add": combine_scatter(),
    }


def _exchange_cost(chip_name: str, rows: int) -> float:
    """Seconds of one ragged all-to-all sending `rows` rows a device over the expert group (the planner's model)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    from lingpack import backend
    from lingpack.plan import chips, cost
    devices = xla_tpu.devices(GROUPS[chip_name])
    mesh = Mesh(devices, ("ep",))

    def exchange(x, out, *slices):
        return jax.lax.ragged_all_to_all(x[0], out[0], *(s[0] for s in slices), axis_name="ep")[None]

    fn = jax.shard_map(exchange, mesh=mesh, in_specs=(P("ep"),) * 6, out_specs=P("ep"), check_vma=False)
    args = [jax.ShapeDtypeStruct((R, rows // U, U, D), jnp.bfloat16),
            jax.ShapeDtypeStruct((R, A // U, U, D), jnp.bfloat16)] + [jax.ShapeDtypeStruct((R, R), jnp.int32)] * 4
    with backend.target("tpu"):
        text = jax.jit(fn).lower(*args).compile().as_text()
    costed = cost.program_cost(text, chips.chip(chip_name), coords=[list(d.coords) for d in devices])
    return costed["by_part"]["collectives"]   # the exchange alone: not the copies of the jitted function's arguments


def measure() -> dict:
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from experiments.provenance import commit
    from lingpack import backend
    from lingpack.plan import chips, cost
    results = {"compiler": "xla_tpu", "commit": commit(), "layers": LAYERS,
               "shapes": dict(N=N, k=K, D=D, P=P_, Pp=PP, Wp=WP, A=A, slots=SLOTS), "chips": {}}
    for chip_name, group in GROUPS.items():
        device = xla_tpu.devices(group)[:1]
        sharding = NamedSharding(Mesh(device, ("x",)), P())
        chip, out = chips.chip(chip_name), {}
        for case, (shapes, fwd, both, cotangent) in _single_cases().items():
            args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
            d_out = jax.ShapeDtypeStruct(*cotangent, sharding=sharding)
            with backend.target("tpu"):
                us = [cost.program_cost(jax.jit(f).lower(*a).compile().as_text(), chip)["step_s"] * 1e6
                      for f, a in ((fwd, args), (both, [*args, d_out]))]
            out[case] = dict(forward_us=us[0], backward_us=max(0.0, us[1] - us[0]))
            print(chip_name, case, f"{us[0]:.0f} + {us[1] - us[0]:.0f} us", flush=True)
        for name, rows in (("exchange, per expert", P_), ("exchange, per pair", PP)):
            out[name] = dict(one_us=_exchange_cost(chip_name, rows) * 1e6)
            print(chip_name, name, f"{out[name]['one_us']:.0f} us", flush=True)
        results["chips"][chip_name] = out
    OUT.mkdir(exist_ok=True)
    (OUT / "dedup.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def layer_totals(ops: dict) -> dict:
    """Microseconds of one MoE layer's dispatch today and per pair (the cheaper receiver formulation of each op),
    under `nothing_saveable`: the forward ops twice (forward, recompute), the backward ops once, 6 exchanges."""
    passes = lambda case: 2 * ops[case]["forward_us"] + ops[case]["backward_us"]
    cheaper = lambda *cases: min(cases, key=passes)
    today = 6 * ops["exchange, per expert"]["one_us"] + passes("sender sort, per expert (k=8)") + passes(
        "sender combine, per expert (k=8, weighted)")
    chosen = [cheaper("receiver expansion, slabs", "receiver expansion, scatter-add"),
              cheaper("receiver combine, slabs", "receiver combine, scatter-add")]
    per_pair = 6 * ops["exchange, per pair"]["one_us"] + passes("sender sort, per pair (4)") + passes(
        "sender combine, per pair (4 partial sums)") + sum(passes(c) for c in chosen)
    return dict(today_us=today, per_pair_us=per_pair, receiver=chosen)


def table(res: dict) -> str:
    s = res["shapes"]
    lines = [f"XLA:TPU (libtpu) compiles at the flagship's shapes (N={s['N']} tokens a device, k={s['k']}, D={s['D']}; "
             f"P={s['P']} sorted places today, Pp={s['Pp']} pair places, Wp={s['Wp']} pair receive rows, A={s['A']} "
             f"expert rows, {s['slots']} slots a pair), costed per instruction as the planner costs the step "
             f"(commit {res['commit']}). Exchanges: one ragged all-to-all over an 8-chip expert group.", "",
             "| op | " + " | ".join(f"{c}: forward (us) | {c}: backward (us)" for c in res["chips"]) + " |",
             "|---|" + "---:|---:|" * len(res["chips"])]
    cases = list(next(iter(res["chips"].values())))
    for case in cases:
        cells = []
        for ops in res["chips"].values():
            v = ops[case]
            cells += [f"{v['one_us']:.0f} (one)", ""] if "one_us" in v else [f"{v['forward_us']:.0f}",
                                                                            f"{v['backward_us']:.0f}"]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    lines += ["", "| chip | dispatch a layer today (us) | per pair (us) | per pair / today | a step's saving "
              f"({res['layers']} layers, ms) | receiver formulations |", "|---|---:|---:|---:|---:|---|"]
    for chip, ops in res["chips"].items():
        t = layer_totals(ops)
        lines.append(f"| {chip} | {t['today_us']:.0f} | {t['per_pair_us']:.0f} | {t['per_pair_us'] / t['today_us']:.2f}"
                     f" | {(t['today_us'] - t['per_pair_us']) * res['layers'] / 1e3:.0f} | "
                     + "; ".join(c.replace("receiver ", "").replace(", ", ": ") for c in t["receiver"]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if "--table" in sys.argv:
        print(table(json.loads((OUT / "dedup.json").read_text())))
    else:
        print(table(measure()))
