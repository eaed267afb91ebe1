"""What a CUDA export of pallas_triton holds: its kernels by name, and the shapes each Triton call sees."""

TRITON_FWD = {"mha_forward": 1}
TRITON_GRAD_NAMES = {"mha_forward", "mha_preprocess_backward", "mha_backward"}


def triton_operand_types(module: str) -> set:
    """The tensor types of every Triton custom call's operands (local shapes inside a shard_map)."""
    types = set()
    for line in module.splitlines():
        if "custom_call @__gpu$xla.gpu.triton(" in line:
            signature = line.rsplit(" : (", 1)[1].split(") -> ", 1)[0]
            types.update(t.strip() for t in signature.split(", "))
    return types
