"""Compile a program for one TPU chip with libtpu from any host, Mosaic kernels included, and read what
each Mosaic kernel reports in the compiled HLO.

libtpu compiles for a TPU topology with no TPU attached (`jax.experimental.topologies.get_topology_desc`,
as MaxText's `train_compile.py` does). In the compiled HLO every Pallas TPU kernel is a `tpu_custom_call`
whose backend config holds the scoped-VMEM limit it was compiled under (`scoped_memory_configs`, the
kernel's `vmem_limit_bytes`, else the generation's default), the VMEM Mosaic allocated for it
(`used_scoped_memory_configs`) and the `pl.CostEstimate` it declared (`cost_estimate`, absent when none).
A kernel whose blocks do not fit its limit fails the compile itself.

VMEM per TensorCore (jax-ml/jax:jax/_src/pallas/mosaic/tpu_info.py): v5e 128 MiB, v5p 64 MiB (a megacore
chip runs a kernel's parallel grid axis on both cores, each with its own VMEM), v6e 128 MiB. A kernel that
sets no `vmem_limit_bytes` (JAX's splash) compiles under the generation's default scoped limit, which the
compiled HLO does not name.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time

from lingpack.errors import ConfigError

MIB = 2**20
VMEM_BYTES = {"v5e": 128 * MIB, "v5p": 64 * MIB, "v6e": 128 * MIB}


GENERATIONS = ("v5e", "v5p", "v6e")


def one_chip(generation: str):
    """The one device of a single chip of `generation` (v5e, v5p megacore, v6e): `lingpack.plan.chips.tpu_devices`."""
    from lingpack.plan import chips
    if generation not in GENERATIONS:
        raise ConfigError(f"TPU generation {generation!r} unknown; choose one of {list(GENERATIONS)}")
    return chips.tpu_devices(chips.chip(generation), 1)[0]


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One Mosaic kernel of a compiled program, as its `tpu_custom_call` reports it."""
    name: str                   # the pallas_call's name (the HLO instruction's, without XLA's ".N" suffix)
    vmem_used: int              # bytes of VMEM Mosaic allocated (used_scoped_memory_configs)
    vmem_limit: int | None      # the scoped limit it was compiled under (None: the generation's default)
    cost: dict | None           # its declared pl.CostEstimate ({flops, transcendentals, bytes_accessed})


INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = ", re.M)


def _scoped(config: dict, key: str) -> int | None:
    sizes = [int(c["size"]) for c in config.get(key, []) if str(c.get("memory_space")) == "1"]  # 1 = VMEM
    return sum(sizes) if sizes else None


def _backend_config(text: str) -> dict:
    """The JSON object after `backend_config=` in one instruction's text."""
    start = text.find("backend_config=")
    if start < 0:
        return {}
    config, _ = json.JSONDecoder().raw_decode(text, start + len("backend_config="))
    return config


def kernels(hlo_text: str) -> list[Kernel]:
    """Every `tpu_custom_call` of a compiled module's text (`compiled.as_text()`), in program order."""
    starts = [m.start() for m in INSTRUCTION.finditer(hlo_text)] + [len(hlo_text)]
    found = []
    for begin, end in zip(starts, starts[1:]):
        text = hlo_text[begin:end]
        if 'custom_call_target="tpu_custom_call"' not in text:
            continue
        name = INSTRUCTION.match(text).group(1)
        config = _backend_config(text)
        cost = config.get("custom_call_config", {}).get("cost_estimate") or config.get("cost_estimate")
        found.append(Kernel(name=re.sub(r"\.\d+$", "", name), vmem_used=_scoped(config, "used_scoped_memory_configs") or 0,
                            vmem_limit=_scoped(config, "scoped_memory_configs"),
                            cost=None if cost is None else {k: int(v) for k, v in cost.items()}))
    return found


def compile_for(fn, args, generation: str, *, matmul_precision: str = "default"):
    """(compiled, compile CPU seconds of this process) of `jax.jit(fn)` for one chip of `generation`, traced
    for TPU; `args` are ShapeDtypeStructs (placed on that chip here). Traced at JAX's default matmul
    precision unless told otherwise, as a run is: under "highest" (the test suite's CPU setting) splash's
    bf16 matmuls ask Mosaic for an fp32 contraction, which it refuses ("Bad lhs type")."""
    import jax

    from lingpack import backend
    device = one_chip(generation)
    sharding = jax.sharding.SingleDeviceSharding(device)
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    with backend.target("tpu"), jax.default_matmul_precision(matmul_precision):
        lowered = jax.jit(fn).lower(*placed)
        start = time.process_time()   # CPU seconds (all threads): wall time depends on the host's load
        compiled = lowered.compile()
    return compiled, time.process_time() - start


# --- the shipped kernels as programs to compile: forward and gradient, at given dimensions ----------------
GATES = ("softplus", "safe")   # the KDA gate forms: softplus (A_log, dt_bias) and the lower-bound (safe) gate


def kda_program(impl: str, gate: str, *, B: int, T: int, H: int, K: int, V: int, chunk_size: int = 64,
                max_segs: int = 64, lower_bound: float = -5.0):
    """(loss gradient function, its argument shapes) of `chunk_kda` as the KDA layer calls it (raw gate and
    q/k L2 norm fused in the kernel, bf16 q/k/v/g, fp32 beta), Mosaic forced (interpret=False)."""
    import jax
    import jax.numpy as jnp

    from lingpack.kernels.kda import api
    if gate not in GATES:
        raise ConfigError(f"KDA gate {gate!r} unknown; choose one of {GATES}")

    def loss(q, k, v, g, beta, A_log, dt_bias, segment_ids):
        o, _ = api.chunk_kda(q, k, v, g, beta, segment_ids=segment_ids, impl=impl, chunk_size=chunk_size,
                             max_segs=max_segs, use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                             A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound if gate == "safe" else None,
                             interpret=False)
        return jnp.sum(o.astype(jnp.float32))
    s = jax.ShapeDtypeStruct
    args = [s((B, T, H, K), jnp.bfloat16)] * 2 + [s((B, T, H, V), jnp.bfloat16), s((B, T, H, K), jnp.bfloat16),
                                                s((B, T, H), jnp.float32), s((H,), jnp.float32),
                                                s((H * K,), jnp.float32), s((B, T), jnp.int32)]
    return jax.grad(loss, argnums=tuple(range(7))), args


def splash_program(*, B: int, T: int, H: int, K: int, V: int, block: int):
    """(loss gradient function, its argument shapes) of splash attention with segment ids, causal, bf16."""
    import jax
    import jax.numpy as jnp

    from lingpack.kernels.attention import splash

    def loss(q, k, v, segment_ids):
        o = splash.splash_attention(q, k, v, segment_ids_BT=segment_ids, scale=K ** -0.5, block=block,
                                    interpret=False)
        return jnp.sum(o.astype(jnp.float32))
    s = jax.ShapeDtypeStruct
    args = [s((B, T, H, K), jnp.bfloat16)] * 2 + [s((B, T, H, V), jnp.bfloat16), s((B, T), jnp.int32)]
    return jax.grad(loss, argnums=(0, 1, 2)), args


def short_conv_program(*, B: int, T: int, C: int, K: int):
    """(gradient function, its argument shapes) of the segment-masked short conv + SiLU (models/layers.py
    `short_conv`) with the Pallas backward (kernels/short_conv.py) in Mosaic, bf16 as the KDA layer runs it."""
    import jax
    import jax.numpy as jnp

    from lingpack.models.layers import short_conv

    def loss(x, kernel, segment_ids):
        return jnp.sum(short_conv(x, kernel, segment_ids, "silu", None, None, "pallas").astype(jnp.float32))
    s = jax.ShapeDtypeStruct
    return jax.grad(loss, argnums=(0, 1)), [s((B, T, C), jnp.bfloat16), s((K, C), jnp.bfloat16), s((B, T), jnp.int32)]
