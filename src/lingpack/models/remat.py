"""Remat policies by name: what a rematerialised layer keeps for the backward pass, per layer part.

The names and their meaning follow MaxText's `remat_policy` (AI-Hypercomputer/maxtext:src/MaxText/layers/decoders.py,
`get_remat_policy`): each keeps some named projection outputs and recomputes the rest in the backward pass.
The model tags those outputs with `tag(x, name)` (a `jax.ad_checkpoint.checkpoint_name` of `<part>/<name>`,
part = the layer half that made it: `kda`, `mla`, `moe` or `mlp`, set by `models/block.py`), so a policy can
differ per part: `model.remat_policy` for every part, `model.remat_policy_{kda,mla,moe}` to override one.

Tags (per token, the matmul outputs of each part):
  query_proj, key_proj, value_proj   KDA q/k/v projections (before the short convolution); MLA's query (q_b)
  qkv_proj                           MLA's latents (q_a, kv_a): the compressed query and key/value inputs
  kv_proj                            MLA's key/value up-projection (kv_b)
  gate_proj                          KDA's decay, beta and output-gate projections (low rank)
  out_proj                           the mixer's output projection (KDA / MLA o_proj)
  context                            the KDA kernel's / attention's output, before the output projection; flash
                                     and splash give their VJP's kept output and logsumexp the same name (`name`):
                                     keeping it skips the attention's forward in the backward pass
  mlpwi_0, mlpwi_1, mlpwo            the SwiGLU gate / up / down matmuls (routed experts, shared expert, dense MLP)
  expert_inputs, expert_outputs      the routed experts' rows as their grouped matmuls read them (under expert
                                     parallelism: as the exchange delivered them) and their outputs back at their
                                     tokens (after the return exchange): saved, the backward re-runs neither exchange

Policies (`POLICIES`; from most memory and least recompute to least memory):
  everything_saveable      keeps every intermediate: remat in name only
  minimal_with_context     every tag above but the exchange's (expert_inputs, expert_outputs)
  minimal                  every tag except `context`
  save_dot_except_mlp      the mixer's projections (q/k/v, latents, gates, out), no SwiGLU matmul
  save_moe_proj            the SwiGLU matmuls only (the MoE's grouped matmuls, the biggest of a MoE layer)
  save_moe_exchange        the routed experts' inputs and outputs: the expert-parallel exchanges run once
  save_context             the mixer kernel's output (`context`): for MLA, the attention runs its forward once
  save_qkv_proj            the mixer's input projections (query/key/value, latents)
  save_out_proj            the mixer's output projection
  full                     nothing: everything recomputed from the layer's input (= nothing_saveable)
  minimal_offloaded        `minimal`'s tensors moved to host memory instead of kept in HBM (TPU / GPU)
  qkv_proj_offloaded       `save_qkv_proj`'s, to host memory
and JAX's own primitive-based ones: nothing_saveable, dots_saveable, dots_with_no_batch_dims_saveable
(these apply to a whole layer: no per-part override beside them).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.ad_checkpoint import checkpoint_name

from lingpack import backend
from lingpack.errors import ConfigError

PARTS = ("kda", "mla", "moe", "mlp")
OVERRIDABLE = ("kda", "mla", "moe")              # `model.remat_policy_<part>`; the dense MLP follows the base policy
_MIXER_IN = ("query_proj", "key_proj", "value_proj", "qkv_proj", "kv_proj")
_MIXER = _MIXER_IN + ("gate_proj", "out_proj")
_MLP = ("mlpwi_0", "mlpwi_1", "mlpwo")
_EXCHANGE = ("expert_inputs", "expert_outputs")
TAGS = _MIXER + ("context",) + _MLP + _EXCHANGE

# name: (tags kept in device memory, tags offloaded to host memory)
NAMED = {
    "minimal_with_context": (_MIXER + ("context",) + _MLP, ()),
    "minimal": (_MIXER + _MLP, ()),
    "save_dot_except_mlp": (_MIXER, ()),
    "save_moe_proj": (_MLP, ()),
    "save_moe_exchange": (_EXCHANGE, ()),
    "save_context": (("context",), ()),
    "save_qkv_proj": (_MIXER_IN, ()),
    "save_out_proj": (("out_proj",), ()),
    "full": ((), ()),
    "minimal_offloaded": ((), _MIXER + _MLP),
    "qkv_proj_offloaded": ((), _MIXER_IN),
}
PRIMITIVE = {   # JAX's policies by primitive, whole layer
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}
POLICIES = tuple(NAMED) + tuple(PRIMITIVE)
OFFLOADING = tuple(name for name, (_, off) in NAMED.items() if off)

_PART: contextvars.ContextVar = contextvars.ContextVar("lingpack_remat_part", default="mlp")


@contextlib.contextmanager
def part(part_name: str):
    """Tags made inside belong to layer part `part_name` (one of PARTS)."""
    token = _PART.set(part_name)
    try:
        yield
    finally:
        _PART.reset(token)


def name(tag_name: str) -> str:
    """`<current part>/<tag_name>`: the name `tag` gives, for a kernel that names its own residuals."""
    return f"{_PART.get()}/{tag_name}"


def tag(x: jax.Array, tag_name: str) -> jax.Array:
    """`x`, named `<current part>/<tag_name>` for the remat policies (an identity outside `jax.checkpoint`)."""
    return checkpoint_name(x, name(tag_name))


def check(policy: str, overrides: dict | None = None) -> None:
    """One-line ConfigError for an unknown policy name, or a per-part override beside a primitive policy."""
    for where, name in [("model.remat_policy", policy)] + [(f"model.remat_policy_{p}", n)
                                                           for p, n in (overrides or {}).items() if n is not None]:
        if name not in POLICIES:
            raise ConfigError(f"{where}={name!r} is not a remat policy; valid choices: {list(POLICIES)}")
        if where != "model.remat_policy" and name not in NAMED:
            raise ConfigError(f"{where}={name!r}: a per-part override takes a named policy, one of {list(NAMED)}")
    if policy in PRIMITIVE and policy != "nothing_saveable" and any(n is not None for n in (overrides or {}).values()):
        raise ConfigError(f"model.remat_policy={policy!r} applies by primitive to a whole layer; per-part overrides "
                          f"need a named base policy, one of {list(NAMED)}")


def resolve(policy: str, overrides: dict | None = None) -> dict:
    """{part: named policy} for every part (`nothing_saveable` reads as `full`); None for a primitive policy."""
    check(policy, overrides)
    if policy in PRIMITIVE and policy != "nothing_saveable":
        return None
    base = "full" if policy == "nothing_saveable" else policy
    return {p: (overrides or {}).get(p) or base for p in PARTS}


def saved_tags(policy: str, overrides: dict | None = None) -> tuple[set, set]:
    """(names kept on device, names offloaded to host), `<part>/<tag>`, of a named policy with its overrides."""
    per_part = resolve(policy, overrides)
    keep = {f"{p}/{t}" for p, name in per_part.items() for t in NAMED[name][0]}
    offload = {f"{p}/{t}" for p, name in per_part.items() for t in NAMED[name][1]}
    return keep, offload


def jax_policy(policy: str, overrides: dict | None = None):
    """The `jax.checkpoint` policy of a policy name (and per-part overrides)."""
    if resolve(policy, overrides) is None:
        return PRIMITIVE[policy]
    keep, offload = saved_tags(policy, overrides)
    if offload and backend.current() == "cpu":
        raise ConfigError(f"remat policy {policy!r} (or a per-part override) offloads to host memory, which a CPU "
                          "backend does not have apart from its own; offloading policies run on TPU / GPU: pick "
                          f"one of {[n for n in NAMED if n not in OFFLOADING]} here")
    if not offload:
        return jax.checkpoint_policies.save_only_these_names(*sorted(keep))
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=sorted(keep), names_which_can_be_offloaded=sorted(offload),
        offload_src="device", offload_dst="pinned_host")
