"""Which Pallas kernels a program runs, and how: from its jaxpr (exact) and from a CUDA export's module.

The jaxpr keeps every `pallas_call` with its `name` and `interpret` flag, wherever it sits (jit, shard_map,
scan, cond, remat, custom VJPs after differentiation), so an emulated kernel cannot hide there. An
interpret-mode call leaves no custom call in the module, and its inlined ops carry no fixed name scope.
"""
import collections
import re

TRITON_FWD = {"mha_forward"}
TRITON_GRAD = {"mha_forward", "mha_preprocess_backward", "mha_backward"}


def _subjaxprs(value):
    for item in value if isinstance(value, (list, tuple)) else (value,):
        if hasattr(item, "eqns"):
            yield item
        elif hasattr(getattr(item, "jaxpr", None), "eqns"):   # ClosedJaxpr
            yield item.jaxpr


def jaxpr_pallas_calls(jaxpr, counts=None) -> collections.Counter:
    """Counter of (kernel name, interpret) over every pallas_call in `jaxpr` (a Jaxpr or ClosedJaxpr)."""
    counts = collections.Counter() if counts is None else counts
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            counts[(eqn.params["name"], bool(eqn.params["interpret"]))] += 1
        for value in eqn.params.values():
            for sub in _subjaxprs(value):
                jaxpr_pallas_calls(sub, counts)
    return counts


def triton_calls(module: str) -> collections.Counter:
    """Triton custom calls of an exported StableHLO module, by kernel name (the pallas_call's `name`)."""
    return collections.Counter(re.findall(r'custom_call @__gpu\$xla\.gpu\.triton\(.*?name = "([^"]+)"', module))


def triton_operand_types(module: str) -> set:
    """The tensor types of every Triton custom call's operands (local shapes inside a shard_map)."""
    types = set()
    for line in module.splitlines():
        if "custom_call @__gpu$xla.gpu.triton(" in line:
            signature = line.rsplit(" : (", 1)[1].split(") -> ", 1)[0]
            types.update(t.strip() for t in signature.split(", "))
    return types
