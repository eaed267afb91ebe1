"""Every shipped Pallas TPU kernel compiled by Mosaic for one chip of v5e, v5p and v6e at the flagship's
dimensions, and the KDA kernel against the roofline of its block shapes.

    python -m experiments.mosaic_compile.compile_kernels              # compile everything, write results/
    python -m experiments.mosaic_compile.compile_kernels --table-only # re-render from results/mosaic_compile.json

Programs (lingpack.kernels.mosaic): the gradient of `chunk_kda` (forward, states and backward kernels) with
`pallas_segment` and `pallas_varlen`, softplus and lower-bound (safe) gates, B=1, T=8192, the flagship's KDA
heads and head dim, bf16; splash attention with segment ids (forward, dq, dkv) at MLA's head dims and the
flagship's attention block. Per kernel the compiled HLO's `tpu_custom_call` gives the VMEM Mosaic allocated
(`used_scoped_memory_configs`), the limit it compiled under and the declared cost estimate; per program the
compile's CPU seconds (this process, all threads) and XLA:TPU's `cost_analysis()`.

Roofline (the flagship's kernel and gate, `pallas_segment` + safe gate): per kernel, from its CostEstimate
and the per-step counts of `pallas_common.step_cost`, the time at the chip's peak bf16 FLOP/s of the matmul
FLOPs as issued (fp32 products at 6 bf16 passes), of the same padded to the MXU's tile (every dot_general's
contraction and output width rounded up to the MXU width: 128 on v5e/v5p, 256 on v6e, the better
orientation taken), and of its bytes at HBM bandwidth (lingpack/plan/chips.py). A model from block shapes, not a
measurement: no TPU ran these kernels.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from experiments.provenance import commit

ROOT = Path(__file__).resolve().parents[2]
ARTIFACT = ROOT / "experiments/mosaic_compile/results/mosaic_compile.json"
MXU_WIDTH = {"v5e": 128, "v5p": 128, "v6e": 256}   # jax-ml/jax:jax/_src/pallas/mosaic/tpu_info.py mxu_column_size
MIB = 2**20


def flagship_dims() -> tuple[dict, dict]:
    import yaml
    model = yaml.safe_load((ROOT / "conf/model/ling3_flagship.yaml").read_text())
    kda, mla = model["kda"], model["mla"]
    chunk = yaml.safe_load((ROOT / "conf/kernel/pallas_segment.yaml").read_text())["chunk_size"]   # the kernel group's
    return (dict(B=1, T=8192, H=kda["num_heads"], K=kda["head_dim"], V=kda["head_dim"],
                 chunk_size=chunk),
            dict(B=1, T=8192, H=mla["num_heads"], K=mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"],
                 V=mla["v_head_dim"], block=model["attention_block_size"]))


def dot_shapes(jaxpr) -> list[dict]:
    """(M, contraction, N, batch, bf16 passes) of every dot_general in a kernel body, nested jaxprs included."""
    from jax.extend import core as jex_core

    from lingpack.kernels.kda import pallas_common
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            free = lambda shape, used: math.prod(d for i, d in enumerate(shape) if i not in used)
            found.append(dict(M=free(lhs, set(lc) | set(lb)), K=math.prod(lhs[i] for i in lc),
                              N=free(rhs, set(rc) | set(rb)), batch=math.prod(lhs[i] for i in lb),
                              passes=pallas_common.mxu_passes(eqn)))
        for sub in jex_core.jaxprs_in_params(eqn.params):
            found += dot_shapes(sub)
    return found


def mxu_padding(dots: list[dict], width: int) -> dict:
    """Matmul FLOPs as issued (bf16 passes in) and as the MXU spends them: the stationary operand's contraction
    and output widths each rounded up to `width` (whichever operand pads less), rows to 8 sublanes."""
    up = lambda n, m: -(-n // m) * m
    issued = padded = 0
    for d in dots:
        flops = 2 * d["batch"] * d["M"] * d["K"] * d["N"] * d["passes"]
        rhs = up(d["K"], width) * up(d["N"], width) * up(d["M"], 8)
        lhs = up(d["K"], width) * up(d["M"], width) * up(d["N"], 8)
        issued += flops
        padded += 2 * d["batch"] * min(rhs, lhs) * d["passes"]
    return dict(issued=issued, padded=padded)


def compile_all() -> dict:
    import jax

    from lingpack.plan import chips
    from lingpack.kernels import mosaic
    from lingpack.kernels.attention import splash
    from lingpack.kernels.kda import pallas_common
    kda_dims, splash_dims = flagship_dims()
    programs = [("kda", impl, gate) for impl in ("pallas_segment", "pallas_varlen") for gate in mosaic.GATES]
    programs.append(("splash", "splash", "segment_ids"))
    rows, roofline = [], {}
    for generation in mosaic.GENERATIONS:
        for family, impl, gate in programs:
            fn, args = (mosaic.kda_program(impl, gate, **kda_dims) if family == "kda"
                        else mosaic.splash_program(**splash_dims))
            start = time.perf_counter()
            try:
                compiled, cpu_s = mosaic.compile_for(fn, args, generation)
            except Exception as err:   # a kernel that does not compile is the finding, recorded
                rows.append(dict(generation=generation, impl=impl, gate=gate, compiled=False,
                                 error=str(err).splitlines()[0][:300]))
                continue
            wall_s = time.perf_counter() - start
            analysis = compiled.cost_analysis()
            kernels = mosaic.kernels(compiled.as_text())
            if family == "splash":   # JAX's splash declares none: lingpack's analytic estimate
                estimates = splash.cost_estimates(splash_dims["B"], splash_dims["H"], splash_dims["T"],
                                                  splash_dims["K"], splash_dims["V"], block=splash_dims["block"])
            rows.append(dict(
                generation=generation, impl=impl, gate=gate, compiled=True, compile_cpu_s=round(cpu_s, 2),
                compile_wall_s=round(wall_s, 2), vmem_capacity=mosaic.VMEM_BYTES[generation],
                xla_flops=analysis.get("flops"), xla_bytes=analysis.get("bytes accessed"),
                xla_optimal_seconds=analysis.get("optimal_seconds"),
                kernels=[dict(name=k.name, vmem_used=k.vmem_used, vmem_limit=k.vmem_limit, cost=k.cost,
                              lingpack_cost=None if family == "kda" else next(
                                  vars(e) for n, e in estimates.items() if n in k.name)) for k in kernels]))
            print(generation, impl, gate, f"{cpu_s:.1f} CPU s", [(k.name, k.vmem_used) for k in kernels], flush=True)
            if (impl, gate) == ("pallas_segment", "safe"):
                eqns = pallas_common.pallas_calls(jax.make_jaxpr(fn)(*args).jaxpr)
                chip = chips.chip(generation)
                per_kernel = {}
                for eqn in eqns:
                    kernel = next(k for k in kernels if eqn.params["name"] in k.name)
                    mxu = mxu_padding(dot_shapes(eqn.params["jaxpr"]), MXU_WIDTH[generation])
                    steps = math.prod(eqn.params["grid_mapping"].grid)
                    per_kernel[eqn.params["name"]] = dict(
                        grid=list(eqn.params["grid_mapping"].grid), cost=kernel.cost,
                        mxu_issued_flops=steps * mxu["issued"], mxu_padded_flops=steps * mxu["padded"],
                        t_flops_s=kernel.cost["flops"] / chip.peak_flops,
                        t_mxu_issued_s=steps * mxu["issued"] / chip.peak_flops,
                        t_mxu_padded_s=steps * mxu["padded"] / chip.peak_flops,
                        t_hbm_s=kernel.cost["bytes_accessed"] / chip.hbm_bw)
                roofline[generation] = dict(peak_flops=chip.peak_flops, hbm_bw=chip.hbm_bw,
                                            mxu_width=MXU_WIDTH[generation], kernels=per_kernel,
                                            xla_optimal_seconds=analysis.get("optimal_seconds"))
    return dict(commit=commit(), kda_dims=kda_dims, splash_dims=splash_dims, rows=rows, roofline=roofline)


def table(result: dict) -> str:
    """Kernel x generation: compiled, VMEM Mosaic allocated of the limit and of the core's VMEM, compile CPU s."""
    kda, att = result["kda_dims"], result["splash_dims"]
    lines = [f"Compiled by libtpu (Mosaic) on a CPU host for one chip, forward + gradient, at commit {result['commit']}: "
             f"KDA at B={kda['B']}, T={kda['T']}, H={kda['H']}, K=V={kda['K']}, chunk {kda['chunk_size']}, bf16 "
             f"(`pallas_varlen` with max_segs=64); splash with segment ids at H={att['H']}, q/k {att['K']}, "
             f"v {att['V']}, block {att['block']}. VMEM = what Mosaic allocated for the kernel (the compiled HLO's "
             "`used_scoped_memory_configs`) / its scoped limit (`vmem_limit_bytes`; splash sets none and gets the "
             "generation's default) / the TensorCore's VMEM. Compile = CPU seconds of the whole program's compile.",
             "", "| kernel | gate | chip | compiled | VMEM MiB (used / limit / VMEM) per kernel | compile CPU s |",
             "|---|---|---|---|---|---:|"]
    for r in result["rows"]:
        if not r["compiled"]:
            lines.append(f"| `{r['impl']}` | {r['gate']} | {r['generation']} | **no**: {r['error']} | | |")
            continue
        cap = r["vmem_capacity"] / MIB
        vmem = "; ".join(f"{_short(k['name'])} {k['vmem_used'] / MIB:.1f} / "
                         f"{'default' if k['vmem_limit'] is None else format(k['vmem_limit'] / MIB, '.0f')} / {cap:.0f}"
                         for k in r["kernels"])
        lines.append(f"| `{r['impl']}` | {r['gate']} | {r['generation']} | yes | {vmem} | {r['compile_cpu_s']:.1f} |")
    return "\n".join(lines) + "\n"


def _short(name: str) -> str:
    for part in ("fwd", "states", "bwd", "dq", "dkv"):
        if f"_{part}" in name:
            return part
    return name


def roofline_table(result: dict) -> str:
    """The flagship's KDA kernel (pallas_segment, safe gate) per kernel and chip: times at peak and at HBM bandwidth."""
    lines = ["`pallas_segment`, lower-bound gate, the flagship's KDA layer (B=1, T=8192, H=16, K=V=128, chunk 64, "
             "bf16), forward + gradient, per kernel: its declared FLOPs (matmul + elementwise) and bytes; the time of "
             "its matmuls at the chip's peak as issued (fp32 products at 6 bf16 passes) and padded to the MXU tile "
             "(MXU use = issued / padded); its bytes at HBM bandwidth. Model from block shapes (lingpack/plan/chips.py "
             "figures), not a TPU measurement.", "",
             "| chip (MXU) | kernel | GFLOP | MB | matmul at peak, issued ms | padded to the MXU ms | MXU use | HBM ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for generation, r in result["roofline"].items():
        total = dict(flops=0, bytes=0, issued=0.0, padded=0.0, hbm=0.0)
        for name, k in r["kernels"].items():
            lines.append(f"| {generation} ({r['mxu_width']}x{r['mxu_width']}) | {_short(name)} | "
                         f"{k['cost']['flops'] / 1e9:.1f} | {k['cost']['bytes_accessed'] / 1e6:.0f} | "
                         f"{k['t_mxu_issued_s'] * 1e3:.2f} | {k['t_mxu_padded_s'] * 1e3:.2f} | "
                         f"{k['mxu_issued_flops'] / k['mxu_padded_flops']:.0%} | {k['t_hbm_s'] * 1e3:.2f} |")
            total["flops"] += k["cost"]["flops"]
            total["bytes"] += k["cost"]["bytes_accessed"]
            total["issued"] += k["t_mxu_issued_s"]
            total["padded"] += k["t_mxu_padded_s"]
            total["hbm"] += k["t_hbm_s"]
        lines.append(f"| {generation} | **all three** | {total['flops'] / 1e9:.1f} | {total['bytes'] / 1e6:.0f} | "
                     f"{total['issued'] * 1e3:.2f} | {total['padded'] * 1e3:.2f} | "
                     f"{total['issued'] / total['padded']:.0%} | {total['hbm'] * 1e3:.2f} |")
    seconds = lambda s: f"{s * 1e3:.2f} ms" if s is not None and s >= 0 else f"none (it returns {s:.3g})"
    lines += ["", "XLA:TPU's own `optimal_seconds` for the whole compiled program (kernels from their declared estimate, "
              "plus the wrapper's layout ops): " + ", ".join(
                  f"{g} {seconds(r['xla_optimal_seconds'])}" for g, r in result["roofline"].items()) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table-only", action="store_true")
    options = parser.parse_args()
    if not options.table_only:
        ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
        ARTIFACT.write_text(json.dumps(compile_all(), indent=1) + "\n")
    result = json.loads(ARTIFACT.read_text())
    print(table(result))
    print(roofline_table(result))


if __name__ == "__main__":
    main()
