"""Reading a compiled program's HLO text: every collective as it executes, loop trip counts included.

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
