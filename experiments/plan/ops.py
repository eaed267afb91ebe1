"""The flagship's data-movement ops alone, each formulation beside its peer, as XLA:TPU costs them for one v5p
(the MLA's context-parallel ring: 8).

    python -m experiments.plan.ops            # compiles every case -> results/ops.json
    python -m experiments.plan.ops --table    # the `plan_ops` results block from the json

Each case is a jitted function of the flagship's shapes (N = 8,192 tokens a device, top-k = 8, D = 1,536,
the sorted places of one dispatch P = 67,456; the receive buffer's 84,480 rows, F = 512; a KDA short convolution
over T = 8,192 tokens of C = 2,048 channels, kernel 4; one MLA layer's splash ring over T = 131,072 tokens,
16 heads, q/k head dim 192, v 128) compiled by libtpu for one v5p chip (`v5p:2x2x1`, megacore; the ring for
8, `v5p:2x2x2`) and costed by `lingpack.plan.cost` as the planner costs the whole step: per instruction,
XLA:TPU's own cycle estimate, or the roofline of its FLOPs and bytes where it has none.
"Peer" is the formulation the model had (or the one it keeps); "lingpack" is what `models/moe.py`,
`models/layers.py` and `parallel/ring_splash.py` run.
Nothing runs: these are compile-time estimates, on the same footing as the planner's step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from experiments import xla_tpu

OUT = Path(__file__).resolve().parent / "results"
N, K, D, P_, R, F = 8192, 8, 1536, 67456, 84480, 512
T, C, CONV = 8192, 2048, 4
RING_H, RING_K, RING_V, RING_T = 16, 192, 128, 131072
RING_CASE = "MLA splash ring at T=128K on 8 chips, forward + backward"


def _cases():
    import jax
    import jax.numpy as jnp

    from lingpack.models import layers, moe
    f32, bf = jnp.float32, jnp.bfloat16

    def _take_einsum(y_PD, to_M, from_P, w_NK):   # the top-k copies as [N, k, D], the einsum reduces the middle axis
        @jax.custom_vjp
        def take(y):
            return y[to_M]
        take.defvjp(lambda y: (y[to_M], None), lambda _, g: (g.at[from_P].get(mode="fill", fill_value=0),))
        return jnp.einsum("nkd,nk->nd", take(y_PD).reshape(N, K, D), w_NK, preferred_element_type=f32)

    def with_vjp(fn):   # values and the cotangents of y and w, the output's cotangent all ones
        def run(y_PD, to_M, from_P, w_NK):
            out, vjp = jax.vjp(lambda y, w: fn(y, to_M, from_P, w), y_PD, w_NK)
            return out, vjp(jnp.ones((N, D), f32))
        return run

    combine_args = [((P_, D), bf), ((N * K,), jnp.int32), ((P_,), jnp.int32), ((N, K), f32)]
    sort_args = [((P_, D), bf), ((N * K,), jnp.int32)]
    swiglu_args = [((R, 2 * F), bf), ((R, F), bf)]

    def sort_bwd_peer(g_PD, to_M):
        return g_PD[to_M].reshape(N, K, D).astype(f32).sum(1).astype(bf)

    def sort_bwd(g_PD, to_M):
        x_ND = jnp.zeros((N, D), bf)   # only its shape and dtype reach the backward
        from_P = jnp.zeros((P_,), jnp.int32)
        return jax.vjp(lambda x: moe.sort_rows(x, from_P, to_M), x_ND)[1](g_PD)[0]

    def swiglu_autodiff(gate_up, d):
        def f(gate_up):
            gate, up = gate_up[:, :F].astype(f32), gate_up[:, F:].astype(f32)
            return (jax.nn.silu(gate) * up).astype(bf)
        out, vjp = jax.vjp(f, gate_up)
        return out, vjp(d)

    def swiglu_one_cotangent(gate_up, d):   # hand-written VJP: both halves' cotangents as one [R, 2F] buffer
        gate, up = gate_up[:, :F].astype(f32), gate_up[:, F:].astype(f32)
        s, d = jax.nn.sigmoid(gate), d.astype(f32)
        d_gate_up = jnp.concatenate([d * up * s * (1 + gate * (1 - s)), d * gate * s], axis=-1).astype(bf)
        return (gate * s * up).astype(bf), d_gate_up

    conv_args = [((1, T, C), bf), ((CONV, C), bf), ((1, T), jnp.int32), ((1, T, C), bf)]

    def conv_bwd(backward):   # the conv + SiLU's input and kernel cotangents, bf16 as the KDA layer runs it
        def run(x, w, seg, d):
            return jax.vjp(lambda x, w: layers.short_conv(x, w, seg, "silu", None, None, backward), x, w)[1](d)
        return run

    return {
        "KDA short conv + SiLU, backward": (conv_args, {
            "peer": ("XLA's (the default): two fusions, XLA:TPU's cycle estimates", conv_bwd("xla")),
            "lingpack": ("`kernel.short_conv=pallas`: one Mosaic pass, its declared bytes (vector work uncosted)",
                         conv_bwd("pallas"))}),
        "MoE combine, forward": (combine_args, {
            "peer": ("[N, k, D] gather, einsum over k", _take_einsum),
            "lingpack": ("`combine_rows`: [k, N, D] slabs added one by one", moe.combine_rows)}),
        "MoE combine, forward + backward": (combine_args, {
            "peer": ("[N, k, D] gather, einsum over k", with_vjp(_take_einsum)),
            "lingpack": ("`combine_rows`, its one-gather backward", with_vjp(moe.combine_rows))}),
        "token sort, backward (sum of a token's k copies)": (sort_args, {
            "peer": ("[N, k, D] gather, sum over k", sort_bwd_peer),
            "lingpack": ("`sort_rows`' backward: [k, N, D] slabs", sort_bwd)}),
        "SwiGLU over the receive buffer, forward + backward": (swiglu_args, {
            "lingpack": ("autodiff (pad + add of the halves' cotangents)", swiglu_autodiff),
            "peer": ("hand-written VJP, one concatenated cotangent", swiglu_one_cotangent)}),
    }


def _ring_case():
    """One MLA layer's splash ring (forward + backward) at T = 128K on 8 v5p chips (context = 8, zigzag): the
    flagship's 16 heads, q/k head dim 192, v 128, tile 512; q, k, v [1, H, T, *] split over T."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from lingpack.parallel import ring_splash
    devices = xla_tpu.devices("v5p:2x2x2")
    mesh = Mesh(devices, ("context",))
    x, seg_spec = P(None, None, "context", None), P(None, "context")

    def grads(unroll, k_seq_minor):
        ring = ring_splash.SplashRing("context", len(devices), True, RING_K ** -0.5, 512, False,
                                      unroll=unroll, k_seq_minor=k_seq_minor)

        def loss(q, k, v, seg, w):
            o = jax.shard_map(lambda *a: ring_splash.splash_ring_attention(*a, ring), mesh=mesh,
                              in_specs=(x, x, x, seg_spec), out_specs=x, check_vma=False)(q, k, v, seg)
            return jnp.sum(o * w)
        return jax.grad(loss, argnums=(0, 1, 2))

    arr = lambda d, dt=jnp.bfloat16: jax.ShapeDtypeStruct((1, RING_H, RING_T, d), dt,
                                                          sharding=NamedSharding(mesh, x))
    args = [arr(RING_K), arr(RING_K), arr(RING_V), jax.ShapeDtypeStruct((1, RING_T), jnp.int32,
                                                                          sharding=NamedSharding(mesh, seg_spec)),
            arr(RING_V, jnp.float32)]
    return args, devices, {
        "peer": ("a `lax.scan` over the steps, splash reading K head-dim minor", grads(False, False)),
        "lingpack": ("steps unrolled, splash reading K seq-minor", grads(True, True))}


def measure() -> dict:
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from experiments.provenance import commit
    from lingpack import backend
    from lingpack.plan import chips, cost
    from lingpack.plan import measure as measure_lib
    devices = xla_tpu.devices("v5p:2x2x1")[:1]
    sharding = NamedSharding(Mesh(devices, ("x",)), P())
    chip = chips.chip("v5p")
    results = {"compiler": "xla_tpu", "chip": "v5p", "commit": commit(),
               "shapes": dict(N=N, k=K, D=D, P=P_, rows=R, F=F, T=T, C=C, ring_T=RING_T), "cases": {}}
    cases = {case: ([jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes], devices, variants)
             for case, (shapes, variants) in _cases().items()}
    cases[RING_CASE] = _ring_case()
    for case, (args, on, variants) in cases.items():
        results["cases"][case] = {}
        coords = [d.coords for d in sorted(on, key=lambda d: d.id)]
        for role, (what, fn) in variants.items():
            with backend.target("tpu"):
                text = jax.jit(fn).lower(*args).compile().as_text()
            costed = cost.program_cost(text, chip, coords=coords, branch_weights=measure_lib.branch_weights(None))
            results["cases"][case][role] = dict(what=what, est_us=costed["step_s"] * 1e6,
                                                roofline_us=costed["roofline_s"] * 1e6)
            print(case, role, f"{costed['step_s'] * 1e6:.0f} us", flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "ops.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def table(res: dict) -> str:
    s = res["shapes"]
    lines = [f"XLA:TPU (libtpu) compiles for one v5p chip at the flagship's shapes (N={s['N']}, k={s['k']}, "
             f"D={s['D']}, P={s['P']} sorted places, {s['rows']} receive rows, F={s['F']}; the short conv over "
             f"T={s['T']} tokens of C={s['C']} channels; the ring: one MLA layer over T={s['ring_T']} tokens on 8 "
             f"chips, per device), costed per instruction as the planner costs the step, a "
             f"Mosaic kernel by the CostEstimate it declares (splash, which declares none: lingpack's analytic "
             f"one) (commit {res['commit']}).", "",
             "| op | formulation | est. (us) | roofline (us) | / peer |", "|---|---|---:|---:|---:|"]
    for case, variants in res["cases"].items():
        peer = variants["peer"]["est_us"]
        for role in ("peer", "lingpack"):
            v = variants[role]
            who = "lingpack" if role == "lingpack" else "peer"
            lines.append(f"| {case} | {who}: {v['what']} | {v['est_us']:.0f} | {v['roofline_us']:.0f} | "
                         f"{v['est_us'] / peer:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if "--table" in sys.argv:
        print(table(json.loads((OUT / "ops.json").read_text())))
    else:
        print(table(measure()))
