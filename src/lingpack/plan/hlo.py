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
    times: float           # executions per call of the program (loop trip counts multiplied in)
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
    named = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)   # mesh['a'=2,'b'=4] {'b'}
    if named:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", named.group(1))}
        return math.prod(sizes[a] for a in re.findall(r"'([^']+)'", named.group(2)))
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    return int(iota.group(2)) if iota else None


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: str             # the result shape as HLO prints it
    opcode: str
    line: str              # the instruction's text (comments removed)
    root: bool = False

    @property
    def operands(self) -> list[str]:
        """Names of the operands (compiled HLO prints them without shapes: look them up in the computation)."""
        args = re.search(rf"\s{re.escape(self.opcode)}\(([^)]*)\)", self.line)
        return re.findall(r"%([\w.\-]+)", args.group(1)) if args else []


def _computations(hlo: str) -> tuple[dict[str, list[Instruction]], str | None]:
    comps, name, entry = {}, None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head:
            name = head.group(2)
            comps[name] = []
            entry = name if head.group(1) else entry
        elif name is not None and line.strip() and line.strip() != "}":
            line = re.sub(r"/\*.*?\*/", "", line)   # tuple shapes carry /*index=5*/ comments
            op = re.match(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^=]*?\)|\S+)\s+([a-z][\w\-]*)\(", line)
            if op:
                comps[name].append(Instruction(op.group(2), op.group(3), op.group(4), line, bool(op.group(1))))
    return comps, entry


@dataclasses.dataclass(frozen=True)
class Executed:
    op: Instruction
    times: float           # executions per call of the program (a weighted conditional branch: its share)
    fused: bool            # inside a fusion (or a reducer): reads and writes no memory of its own
    shapes: dict           # name -> shape of the instructions of its computation (operand lookup)
    comp: str = ""         # the computation it belongs to


def op_name(line: str) -> str:
    """JAX's name stack of an instruction (its `op_name` metadata: "jit(step)/while/body/.../dot_general"), or ""."""
    found = re.search(r'op_name="([^"]*)"', line)
    return found.group(1) if found else ""


def cond_scope(op: Instruction, comps: dict, branches: list[str]) -> str:
    """A conditional's name stack: its own `op_name`, else (XLA:TPU drops it from conditionals it clones or
    sinks into a loop) the one its branches' instructions share before their `/branch_<i>_fun/` (most of them)."""
    own = op_name(op.line)
    if own.endswith("cond"):
        return own
    votes = collections.Counter()
    for branch in branches:
        for inner in comps.get(branch, []):
            found = re.match(r"(.*)/branch_\d+_fun/", op_name(inner.line))
            if found:
                votes[found.group(1)] += 1
    return votes.most_common(1)[0][0] if votes else own


def _branches(op: Instruction, branch_weights, comps: dict) -> tuple[list[str], list[float]]:
    """A conditional's branch computations in index order (a predicate's: false, true) and their weights
    (`branch_weights(op, scope)`, scope: `cond_scope`)."""
    listed = re.search(r"branch_computations=\{([^}]*)\}", op.line)
    if listed:
        branches = re.findall(r"%?([\w.\-]+)", listed.group(1))
    else:
        named = dict(re.findall(r"(true|false)_computation=%?([\w.\-]+)", op.line))
        branches = [named[k] for k in ("false", "true") if k in named]
    weights = branch_weights(op, cond_scope(op, comps, branches)) if branch_weights else None
    return branches, list(weights) if weights else [1.0] * len(branches)


def trip_count(op: Instruction, comps: dict) -> int | None:
    """A `while`'s trip count: XLA's `known_trip_count` (XLA:CPU prints it), else its condition's `i < N` against
    a constant (XLA:TPU's loops from lax.scan / fori_loop, whose counter starts at 0 and steps by 1), else None."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', op.line)
    if known:
        return int(known.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", op.line)
    body = comps.get(cond.group(1), []) if cond else []
    root = next((i for i in body if i.root), None)
    if root is None or root.opcode != "compare" or "direction=LT" not in root.line:
        return None
    constants = {i.name: i for i in body if i.opcode == "constant"}
    bound = constants.get(root.operands[1]) if len(root.operands) > 1 else None
    value = re.search(r"constant\((-?\d+)\)", bound.line) if bound is not None else None
    return int(value.group(1)) if value else None


def executed(hlo: str, branch_weights=None) -> tuple[list[Executed], int]:
    """(every instruction the program runs, with its execution count, loops whose trip count is unknown).

    A conditional's branches each count as if they ran (an upper bound), unless `branch_weights(op, scope)`
    returns one weight per branch, e.g. the share of a layer scan's trips that take each branch (found by the
    named scope in the cond's name stack, `cond_scope`). For a `while`, `branch_weights(op, its op_name)` may
    return `[n]`: the loop runs n times, whatever its condition (e.g. 0 for the expert-parallel overflow
    rounds, taken only when a receive buffer overflows).
    """
    comps, entry = _computations(hlo)
    shapes = {name: {op.name: op.shape for op in ops} for name, ops in comps.items()}
    found, unknown = [], [0]

    def visit(comp: str, times: float, fused: bool) -> None:
        for op in comps.get(comp, []):
            found.append(Executed(op, times, fused, shapes[comp], comp))
            if op.opcode == "while":
                # [n]: the loop is taken n times
                expected = branch_weights(op, op_name(op.line)) if branch_weights else None
                trip = expected[0] if expected and len(expected) == 1 else trip_count(op, comps)
                unknown[0] += trip is None
                body = re.search(r"body=%?([\w.\-]+)", op.line).group(1)
                visit(body, times * (1 if trip is None else trip), fused)
                continue
            for key, callee in re.findall(r"(to_apply|calls)=%?([\w.\-]+)", op.line):
                visit(callee, times, fused or key == "to_apply" or op.opcode == "fusion")
            if op.opcode == "conditional":
                for callee, weight in zip(*_branches(op, branch_weights, comps)):
                    visit(callee, times * weight, fused)

    if entry is not None:
        visit(entry, 1, False)
    return found, unknown[0]


def collective_ops(hlo: str, branch_weights=None) -> tuple[list[Collective], int]:
    """(every collective op of the module with its execution count, loops whose trip count is unknown)."""
    ops, unknown = executed(hlo, branch_weights)
    found = []
    for e in ops:
        opcode = e.op.opcode
        kind = opcode[:-5] if opcode.endswith("-done") else opcode
        if kind in KINDS and not opcode.endswith("-start"):   # async pairs: count the -done
            found.append(Collective(kind, e.op.shape, e.times, _group_size(e.op.line)))
    return found, unknown


def _dims(shape: str) -> tuple[int, ...]:
    found = re.search(r"\w+\[([\d,]*)\]", shape)
    return tuple(int(d) for d in found.group(1).split(",") if d) if found else ()


def dot_flops(hlo: str, branch_weights=None) -> float:
    """FLOPs of every matrix product the program executes (2 x result elements x contracted size per `dot`),
    loop trip counts included. XLA's own `cost_analysis()` counts a loop body once, whatever its trip count."""
    total = 0
    for e in executed(hlo, branch_weights)[0]:
        if e.op.opcode != "dot":
            continue
        lhs = _dims(e.shapes.get(e.op.operands[0], "")) if e.op.operands else ()
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", e.op.line)
        k = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d) if contracting and lhs else 1
        total += e.times * 2 * math.prod(_dims(e.op.shape)) * k
    return total


NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call", "conditional",
              "after-all", "partition-id", "replica-id", "opt-barrier"}
SLICES = {"dynamic-slice", "slice", "gather"}
UNARY = {"convert", "bitcast", "copy", "bitcast-convert"}


def _moved(op: Instruction, shapes: dict, comps: dict) -> int:
    """Bytes one run of an unfused instruction reads and writes. A slice reads what it returns; an in-place
    update (dynamic-update-slice, also as a fusion's root) writes its update, not the whole buffer."""
    size = lambda name, table=shapes: shape_bytes(table.get(name, ""))
    if op.opcode in SLICES:
        return 2 * shape_bytes(op.shape)
    if op.opcode == "dynamic-update-slice":
        return 2 * size(op.operands[1])
    called = re.search(r"calls=%?([\w.\-]+)", op.line) if op.opcode == "fusion" else None
    if called is None or called.group(1) not in comps:
        return shape_bytes(op.shape) + sum(size(name) for name in op.operands)
    body = comps[called.group(1)]
    inner = {i.name: i.shape for i in body}
    by_name = {i.name: i for i in body}
    params = {int(re.search(r"parameter\((\d+)\)", i.line).group(1)): i.name for i in body if i.opcode == "parameter"}
    users = collections.defaultdict(list)
    for i in body:
        for name in i.operands:
            users[name].append(i)
    root = next((i for i in body if i.root), None)
    outputs = [by_name[n] for n in root.operands] if root is not None and root.opcode == "tuple" else [root]
    def peel(inst):   # through dtype and layout changes that keep the buffer's elements where they are
        while inst is not None and inst.opcode in UNARY and inst.operands and inst.operands[0] in by_name:
            inst = by_name[inst.operands[0]]
        return inst

    written, in_place = 0, set()
    for out in outputs:
        core = peel(out)
        buffer = peel(by_name.get(core.operands[0])) if core is not None and core.opcode == "dynamic-update-slice" else None
        if buffer is not None and buffer.opcode == "parameter" and _dims(buffer.shape) == _dims(out.shape):
            in_place.add(buffer.name)   # updated in place (XLA shares the buffer), also under converts
            update = _dims(inner.get(core.operands[1], ""))
            written += math.prod(update) * DTYPE_BYTES.get(re.match(r"\w+", out.shape).group(0), 4)
        elif out is not None:
            written += shape_bytes(out.shape)
    read = 0
    for index, outer in enumerate(op.operands):
        param = params.get(index)
        if param in in_place:
            continue
        if users[param] and all(u.opcode in SLICES and u.operands[0] == param for u in users[param]):
            read += sum(shape_bytes(u.shape) for u in users[param])
        else:
            read += size(outer)
    return read + written


def memory_traffic(hlo: str, branch_weights=None) -> float:
    """Bytes the program's unfused instructions read and write each time they run (`_moved`), loop trip counts
    included: a roofline's memory term under this program's fusion decisions (XLA:TPU fuses differently)."""
    comps, _ = _computations(hlo)
    total = 0
    for e in executed(hlo, branch_weights)[0]:
        if not e.fused and e.op.opcode not in NO_TRAFFIC:
            total += e.times * _moved(e.op, e.shapes, comps)
    return total


def collectives(hlo: str, branch_weights=None) -> dict:
    """{"by_kind": {kind: {"count": executions, "bytes": result bytes}}, "unknown_trip_counts", "trivial"}."""
    ops, unknown = collective_ops(hlo, branch_weights)
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


# ------------------------------------------------------------------ buffers live at the peak of the memory plan

@dataclasses.dataclass(frozen=True)
class Buffer:
    """One HLO value live at the peak of a compiled program's buffer assignment, with what produced it."""
    name: str              # the value as XLA names it: the producing instruction and a tuple index, e.g. "fusion.3{}"
    bytes: int
    shape: str             # the producing instruction's result shape ("" if not found in the HLO text)
    op_name: str           # JAX's name stack of the producer ("jit(step)/while/body/.../dot_general"); "" if none
    frames: tuple          # Python frames that traced it, innermost first: ((file, function, line), ...)

    def frame_under(self, package: str) -> tuple | None:
        """The innermost frame in a file under a directory named `package` (e.g. "lingpack"), else None."""
        for frame in self.frames:
            if f"/{package}/" in frame[0]:
                return frame
        return None


def _stack_frames(hlo: str) -> dict[int, tuple]:
    """stack_frame_id -> frames innermost first, from the FileNames / FunctionNames / FileLocations / StackFrames
    tables that the compiled HLO text carries."""
    tables, table = collections.defaultdict(dict), None
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            table = line
        elif table and re.match(r"^\d+ ", line):
            key, value = line.split(" ", 1)
            tables[table][int(key)] = value
        elif table and line.strip():
            table = None
    unquote = lambda s: s.strip().strip('"')
    locations = {}
    for key, value in tables["FileLocations"].items():
        fields = dict(re.findall(r"(\w+)=(\d+)", value))
        locations[key] = (unquote(tables["FileNames"].get(int(fields["file_name_id"]), "")),
                          unquote(tables["FunctionNames"].get(int(fields["function_name_id"]), "")), int(fields["line"]))
    frames = {}
    for key, value in tables["StackFrames"].items():
        fields = dict(re.findall(r"(\w+)=(\d+)", value))
        frames[key] = (locations.get(int(fields["file_location_id"])), int(fields["parent_frame_id"]))

    def chain(key: int) -> tuple:
        out, seen = [], set()
        while key in frames and key not in seen:
            seen.add(key)
            location, parent = frames[key]
            if location:
                out.append(location)
            key = parent
        return tuple(out)
    return {key: chain(key) for key in frames}


def _instructions(hlo: str) -> dict[str, tuple[str, str, int | None]]:
    """instruction name -> (result shape, op_name, stack_frame_id)."""
    found = {}
    for line in hlo.splitlines():
        head = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\([^=]*?\)|\S+) ", re.sub(r"/\*.*?\*/", "", line))
        if head:
            op_name = re.search(r'op_name="([^"]*)"', line)
            frame = re.search(r"stack_frame_id=(\d+)", line)
            found[head.group(1)] = (head.group(2), op_name.group(1) if op_name else "",
                                    int(frame.group(1)) if frame else None)
    return found


def peak_buffers(live_range: str, hlo: str) -> list[Buffer]:
    """Every value live at the peak of the buffer assignment, largest first.

    `live_range`: XLA's `*-live-range.txt` dump of the program (its "Live ranges at N (peak)" section; see
    `compile_with_buffer_dump`); `hlo`: the compiled program's text (`compiled.as_text()`), for each value's
    producer: its name stack and the Python frames (the text's stack-frame tables) that traced it.
    """
    section = re.search(r"Live ranges at \d+ \(peak\):\n((?:\s+\S+: \d+ bytes.*\n?)*)", live_range)
    if section is None:
        raise ValueError("no 'Live ranges at N (peak)' section: pass the *-live-range.txt file of an XLA dump")
    instructions, frames = _instructions(hlo), _stack_frames(hlo)
    out = []
    for name, size in re.findall(r"^\s+(\S+): (\d+) bytes", section.group(1), re.M):
        shape, op_name, frame = instructions.get(re.sub(r"\{.*\}$", "", name), ("", "", None))
        out.append(Buffer(name, int(size), shape, op_name, frames.get(frame, ())))
    return sorted(out, key=lambda b: -b.bytes)


def group_bytes(buffers, key) -> dict[str, int]:
    """{key(buffer): total bytes}, largest first."""
    totals = collections.Counter()
    for buffer in buffers:
        totals[key(buffer)] += buffer.bytes
    return dict(totals.most_common())


# XLA:CPU's schedulers as XLA_FLAGS. The default (concurrency-optimized) one runs every operand-free instruction
# first, so zero fills are held from the program's start; the memory-optimized one places each where it is used.
# XLA reads its flags once per process: compile under another scheduler in a subprocess (`scheduler_env`).
CPU_SCHEDULERS = {"default": "", "memory": "--xla_cpu_enable_concurrency_optimized_scheduler=false"}


def scheduler_env(scheduler: str, env: dict) -> dict:
    """`env` with XLA_FLAGS extended by XLA:CPU scheduler `scheduler`'s flag (a key of CPU_SCHEDULERS)."""
    return dict(env, XLA_FLAGS=f"{env.get('XLA_FLAGS', '')} {CPU_SCHEDULERS[scheduler]}".strip())


def compile_with_buffer_dump(lowered, directory: str):
    """(compiled, its live-range dump text): `lowered.compile` with XLA's dump into `directory` (text HLO only)."""
    import glob
    import os
    compiled = lowered.compile(compiler_options={"xla_dump_to": directory, "xla_dump_hlo_as_text": True})
    paths = sorted(glob.glob(os.path.join(directory, "*-live-range.txt")), key=os.path.getmtime)
    if not paths:
        raise RuntimeError(f"XLA wrote no *-live-range.txt into {directory}")
    with open(paths[-1]) as f:
        return compiled, f.read()


def mosaic_calls(module: str) -> dict:
    """Mosaic (Pallas TPU) kernels of a StableHLO module (`jax.export(...).mlir_module()`): {kernel name: calls}.

    A Mosaic kernel lowers to one `tpu_custom_call` whose `kernel_name` is the pallas_call's `name`; a
    kernel called twice from one deduplicated function counts once (counts are of the text, not of runs).
    """
    return dict(collections.Counter(re.findall(r'tpu_custom_call\(.*?kernel_name = "([^"]+)"', module)))


def compiled_kernels(text: str) -> dict:
    """Mosaic kernels of a program compiled by XLA:TPU: {kernel name: custom calls}, the name from the call's
    name stack (the pallas_call's `name`); XLA's own Mosaic calls (ragged-dot) by their instruction name."""
    found = collections.Counter()
    for line in text.splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        scopes = [s for s in op_name(line).split("/") if s and s != "pallas_call"]
        head = re.match(r"^\s*(?:ROOT\s+)?%?([\w\-]+?)(?:\.\d+)?\s*=", line)
        found[scopes[-1] if "pallas_call" in op_name(line) and scopes else head.group(1) if head else "?"] += 1
    return dict(found)


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
        # an unnamed pallas_call (Megablox's gmm) is named by Mosaic after its body function, as here
        found[mode][eqn.params.get("name") or eqn.params["jaxpr"].debug_info.func_name] += 1
    return {k: dict(v) for k, v in found.items()}
