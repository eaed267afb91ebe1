"""Reading a program: every collective of its compiled HLO as it executes (loop trip counts included), and
its Pallas kernels (Mosaic and Triton calls of an exported module, interpret-mode ones of its jaxpr).

`jax.jit(f).lower(...).compile().as_text()` is the per-device program after SPMD partitioning. A
computation's ops run once per call; a `while` body runs its known trip count times (unknown: once, and
`unknown_trip_counts` says how many loops that was); a conditional's branches are each counted as if
they ran (an upper bound). Collectives whose replica groups are single devices move nothing: they are
only counted (`trivial`). Bytes are each op's result bytes on one device.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

KINDS = ("all-gather", "collective-permute", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all")
DTYPE_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2,
               "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str              # one of KINDS
    shape: str             # the result shape as HLO prints it, e.g. "f32[8,256,384]" or a tuple "(f32[4], s32[2])"
    times: int             # executions per call of the program (loop trip counts multiplied in)
    group_size: int | None  # devices per replica group (None: not stated, e.g. collective-permute)

    @property
    def bytes(self) -> int:
        return shape_bytes(self.shape)

    @property
    def dims(self) -> list[tuple[int, ...]]:
        """The dims of each array in the result (one entry, or one per tuple element)."""
        return [tuple(int(d) for d in dims.split(",") if d) for _, dims in re.findall(r"(\w+)\[([\d,]*)\]", self.shape)]


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (arrays and tuples of arrays)."""
    return sum(DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape))


def _group_size(line: str) -> int | None:
    listed = re.search(r"replica_groups=\{\{([^}]*)\}", line)
    if listed:
        return len(listed.group(1).split(","))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    return int(iota.group(2)) if iota else None


def _computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
    comps, name, entry = {}, None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head:
            name = head.group(2)
            comps[name] = []
            entry = name if head.group(1) else entry
        elif name is not None and line.strip() and line.strip() != "}":
            comps[name].append(line)
    return comps, entry


def collective_ops(hlo: str) -> tuple[list[Collective], int]:
    """(every collective op of the module with its execution count, loops whose trip count is unknown)."""
    comps, entry = _computations(hlo)
    found, unknown = [], [0]

    def visit(comp: str, times: int) -> None:
        for line in comps.get(comp, []):
            line = re.sub(r"/\*.*?\*/", "", line)   # tuple shapes carry /*index=5*/ comments
            op = re.search(r"=\s*(\([^=]*?\)|\S+)\s+([a-z][\w\-]*)\(", line)
            if op:
                shape, opcode = op.groups()
                kind = opcode[:-5] if opcode.endswith("-done") else opcode
                if kind in KINDS and not opcode.endswith("-start"):   # async pairs: count the -done
                    found.append(Collective(kind, shape, times, _group_size(line)))
                if opcode == "while":
                    trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                    unknown[0] += trip is None
                    visit(re.search(r"body=%?([\w.\-]+)", line).group(1), times * int(trip.group(1) if trip else 1))
                    continue
            for callee in re.findall(r"(?:to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)", line):
                visit(callee, times)
            for branches in re.findall(r"branch_computations=\{([^}]*)\}", line):
                for callee in re.findall(r"%?([\w.\-]+)", branches):
                    visit(callee, times)

    if entry is not None:
        visit(entry, 1)
    return found, unknown[0]


def collectives(hlo: str) -> dict:
    """{"by_kind": {kind: {"count": executions, "bytes": result bytes}}, "unknown_trip_counts", "trivial"}."""
    ops, unknown = collective_ops(hlo)
    totals = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
    trivial = 0
    for op in ops:
        if op.group_size == 1:
            trivial += op.times   # over size-1 mesh axes (e.g. a cotangent's psum over `data`=1): no traffic
            continue
        totals[op.kind]["count"] += op.times
        totals[op.kind]["bytes"] += op.times * op.bytes
    return {"by_kind": {k: dict(totals[k]) for k in KINDS if k in totals}, "unknown_trip_counts": unknown,
            "trivial": trivial}



def mosaic_calls(module: str) -> dict:
    """Mosaic (Pallas TPU) kernels of a StableHLO module (`jax.export(...).mlir_module()`): {kernel name: calls}.

    A Mosaic kernel lowers to one `tpu_custom_call` whose `kernel_name` is the pallas_call's `name`; a
    kernel called twice from one deduplicated function counts once (counts are of the text, not of runs).
    """
    return dict(collections.Counter(re.findall(r'tpu_custom_call\(.*?kernel_name = "([^"]+)"', module)))


TRITON_CALL = "__gpu$xla.gpu.triton"   # the custom-call target of a Pallas kernel lowered through Triton


def triton_calls(module: str) -> dict:
    """Triton (Pallas GPU) kernels of a StableHLO module exported for CUDA: {kernel name: calls}, counted like
    `mosaic_calls`. A Triton kernel lowers to one `TRITON_CALL` custom call whose backend config `name` is
    the pallas_call's `name`."""
    call = re.escape(f"custom_call @{TRITON_CALL}(")
    return dict(collections.Counter(re.findall(call + r'.*?name = "([^"]+)"', module)))


def pallas_call_eqns(jaxpr) -> list:
    """Every `pallas_call` equation of a (closed) jaxpr, nested jaxprs included (shard_map, scan, cond, remat,
    custom_vjp), in program order."""
    from jax.extend import core as jex_core
    found = []

    def visit(j) -> None:
        for eqn in j.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append(eqn)
                continue   # a kernel body holds no pallas_call
            for sub in jex_core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(getattr(jaxpr, "jaxpr", jaxpr))
    return found


def pallas_kernels(jaxpr) -> dict:
    """Every `pallas_call` of a traced program (`jax.jit(f).trace(...).jaxpr`), by how it will run.

    {"mosaic": {name: calls}, "triton": {name: calls}, "interpret": {name: calls}}: an interpret-mode kernel
    leaves no custom call in the lowered module (its body is inlined as XLA ops), so it is found here, in
    the jaxpr, by its `interpret` parameter; the others lower through Triton when their compiler params are
    Pallas GPU's (`jax.experimental.pallas.triton`), else through Mosaic.
    """
    found = {"mosaic": collections.Counter(), "triton": collections.Counter(), "interpret": collections.Counter()}
    for eqn in pallas_call_eqns(jaxpr):
        triton = "pallas.triton" in type(eqn.params.get("compiler_params")).__module__
        mode = "interpret" if eqn.params.get("interpret") else "triton" if triton else "mosaic"
        found[mode][eqn.params.get("name") or "?"] += 1
    return {k: dict(v) for k, v in found.items()}
