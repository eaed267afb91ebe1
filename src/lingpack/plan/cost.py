"""The step time of a compiled TPU program: every instruction XLA:TPU scheduled, costed, loop trip counts in.

Per top-level instruction of the compiled HLO (`compiled.as_text()`, after fusion and scheduling), run
`times` times per step (`lingpack.plan.hlo.executed`: while bodies by their trip counts):
  fusion, copy, ...   XLA:TPU's own `estimated_cycles` (its backend_config) over the chip's cycle rate
                      (`chips.Chip.cycle_hz`), never below its FLOPs at peak; where XLA wrote none (or
                      INT64_MAX), the roofline max(FLOPs / peak, bytes at its boundary / HBM bandwidth)
  Mosaic kernel       a `tpu_custom_call`: the `pl.CostEstimate` its pallas_call declared (the custom call's
                      backend_config carries it), as the roofline of those FLOPs and bytes; JAX's splash
                      kernels declare none: lingpack's analytic estimate of them (`splash_cost`); times
                      `kernel_share(name)` where a kernel's grid runs only part of what it declares
                      (Megablox on an expert-parallel receive buffer: plan/measure.py `megablox_share`)
  collective          bytes one device sends (ring algorithms) over the ICI links of the torus dimensions its
                      replica group spans (2 directions per dimension); an all-to-all no faster than its
                      group's bisection allows (`bisection_seconds`); an async `-start`/`-done` pair is
                      hidden behind the compute the schedule places between them, only the rest is exposed
  copy-start/done     HBM <-> on-chip memory prefetches: bytes / HBM bandwidth, hidden like a collective;
  slice-start/done    likewise, a prefetch of one slice of a buffer (v6e's sliced prefetches): the slice's bytes
  AllocateBuffer      nothing: an uninitialised buffer (`jax.lax.empty`), no memory traffic
  ConcatBitcast       nothing: a sliced prefetch's slices seen as one buffer (they already lie contiguously)
The step is the sum; the roofline of the same instructions is kept beside it (`roofline_s`) as the
cross-check. Parts come from JAX's name stacks (`op_name`): the model's named scopes (moe, kda, mla,
head, mtp, embed); outside the forward and backward, the optimizer.
"""

from __future__ import annotations

import collections
import json
import math
import re

import numpy as np

from lingpack.plan import hlo

INT64_MAX = 2 ** 63 - 1
PARTS = ("moe", "kda", "mla", "head", "mtp", "embed")   # named scopes, most specific first
SCOPE_PARTS = {"head_xent": "head"}   # models/head.py's cross-entropy: the head's matmuls run in the loss
# custom calls that move no data: `jax.lax.empty` on TPU; the view of a sliced prefetch's slices, which XLA placed
# contiguously (xla/service/memory_space_assignment/slice.h, kConcatBitcastCustomCall)
NO_DATA_CALLS = ('custom_call_target="AllocateBuffer"', 'custom_call_target="ConcatBitcast"')
CONTAINERS = hlo.NO_TRAFFIC | {"async-start", "async-done", "call-start", "call-done"}
PREFETCHES = ("copy-start", "slice-start")   # async HBM <-> on-chip memory transfers (memory-space assignment)


def traffic(kind: str, result_bytes: float, n: int | None, operand_bytes: float = 0.0) -> float:
    """Bytes one device sends for one run of a collective (ring algorithms): all-gather, all-to-all: result x
    (n-1)/n; reduce-scatter: result x (n-1); all-reduce: 2 x result x (n-1)/n; permute: result; ragged
    all-to-all: its input x (n-1)/n (the rows it sends, not the worst-case receive buffer)."""
    n = n or 2
    factor = {"all-gather": (n - 1) / n, "all-to-all": (n - 1) / n, "ragged-all-to-all": (n - 1) / n,
              "reduce-scatter": n - 1, "all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}[kind]
    return exchanged_bytes(kind, result_bytes, operand_bytes) * factor


def exchanged_bytes(kind: str, result_bytes: float, operand_bytes: float = 0.0) -> float:
    """The per-device array a collective's traffic scales with: a ragged all-to-all's input (the rows it
    sends, not the worst-case receive buffer), else its result."""
    return operand_bytes if kind == "ragged-all-to-all" and operand_bytes else result_bytes


def part(line: str) -> str | None:
    """The model part an instruction belongs to, from its name stack (None: it has none)."""
    name = hlo.op_name(line)
    if not name:
        return None
    scopes = [SCOPE_PARTS.get(s, s) for s in re.split(r"[/()]", name)]
    for p in PARTS:
        if any(s == p or s.startswith(p) and s[len(p):].isdigit() for s in scopes):
            return p
    if "jvp(" in name or "transpose(" in name:
        return "layers (other)"
    return "optimizer, other"


def _parts(ops) -> dict:
    """name -> part of a computation's instructions; an instruction XLA made (no name stack, e.g. a ragged
    dot's transposes, or a kernel in a checkpoint's backward) takes its operands' part, a model part
    (`PARTS`) before a generic one (a prefetched copy of a weight reads "layers (other)"), else the part most
    of its computation's instructions have."""
    found = {op.name: part(op.line) for op in ops}
    unnamed = [op for op in ops if found[op.name] is None]
    for _ in range(3):
        for op in unnamed:
            known = [found[o] for o in op.operands if found.get(o)]
            found[op.name] = next((p for p in known if p in PARTS), known[0] if known else None)
    named = collections.Counter(v for v in found.values() if v)
    common = named.most_common(1)[0][0] if named else "optimizer, other"
    return {k: v or common for k, v in found.items()}


def estimated_cycles(line: str) -> int | None:
    found = re.search(r'"estimated_cycles":"(\d+)"', line)
    return int(found.group(1)) if found and int(found.group(1)) < INT64_MAX else None


def kernel_cost(line: str) -> tuple[float, float] | None:
    """(FLOPs, bytes accessed) of a Mosaic kernel's declared CostEstimate, or None."""
    found = re.search(r'"cost_estimate":(\{[^}]*\})', line)
    if not found:
        return None
    est = json.loads(found.group(1))
    return float(est.get("flops", 0)), float(est.get("bytes_accessed", 0))


def splash_cost(op, name: str) -> tuple[float, float] | None:
    """(FLOPs, bytes) of one of JAX's splash kernels, which declare no CostEstimate: lingpack's analytic one
    (kernels/attention/splash.py) at the shapes its operands carry: block masks [1, T / block, S / block], then
    q [H, T, K], k [H, S, K] (seq-minor: [H, K, S]) and v [H, S, V]. Square (S == T) is causal, as the MLA and a
    ring's local step run it; otherwise a ring step's full tile (parallel/ring_splash.py; a contiguous layout's square full steps
    are costed as causal, half their work)."""
    if not name.startswith("splash_mha"):
        return None
    listed = op.line.split("operand_layout_constraints={", 1)[-1]
    dims = [[int(d) for d in found.split(",")] for found in re.findall(r"\w+\[([\d,]+)\]", listed)[:5]]
    if len(dims) < 5 or any(len(d) != 3 for d in dims):
        return None
    (_, blocks, _), _, (H, T, K), _, (_, S, V) = dims   # k: [H, S, K] or, seq-minor, [H, K, S]; S from v
    from lingpack.kernels.attention import splash
    estimates = splash.cost_estimates(1, H, T, K, V, block=T // blocks, causal=S == T, S=S)
    est = next((e for prefix, e in estimates.items() if name.startswith(prefix)), None)
    return (float(est.flops), float(est.bytes_accessed)) if est else None


def kernel_name(op) -> str:
    scopes = [s for s in re.split(r"[/]", hlo.op_name(op.line)) if s and s != "pallas_call"]
    return scopes[-1] if scopes else op.name.rstrip(".0123456789")


def _window(line: str, key: str, n: int, default: int) -> list[int]:
    found = re.search(rf"\b{key}=([\dx_]+)", line)
    if not found:
        return [default] * n
    return [int(v.split("_")[0]) for v in found.group(1).split("x")]


def _valid_taps(in_size: int, out_size: int, size: int, stride: int, pad_lo: int, lhs_dil: int, rhs_dil: int) -> int:
    """(output position, window tap) pairs of one spatial dimension whose tap lands on a real input element,
    not on padding or a dilation hole."""
    o = np.arange(out_size)
    total = 0
    for t in range(size):
        p = o * stride + t * rhs_dil - pad_lo   # position in the padded, dilated input
        total += int(np.count_nonzero((p >= 0) & (p <= (in_size - 1) * lhs_dil) & (p % lhs_dil == 0)))
    return total


def _conv_flops(op, shapes) -> float:
    """2 x multiply-adds of a `convolution` (XLA:TPU's form of a matmul) or `dot`: per output element the
    contracted features times the window taps that land on the input (XLA:TPU writes some matmuls as a
    convolution whose window is mostly padding: counting every tap overstated them 16x)."""
    out = math.prod(hlo._dims(op.shape))
    operands = op.operands
    if op.opcode == "dot":
        lhs = hlo._dims(shapes.get(operands[0], "")) if operands else ()
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", op.line)
        k = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d) if contracting and lhs else 1
        return 2.0 * out * k
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", op.line)
    lhs = hlo._dims(shapes.get(operands[0], "")) if operands else ()
    kernel = hlo._dims(shapes.get(operands[1], "")) if len(operands) > 1 else ()
    result = hlo._dims(op.shape)
    if not labels or len(labels.group(2)) != len(kernel) or len(labels.group(1)) != len(lhs) \
            or len(labels.group(3)) != len(result):
        return 0.0
    lhs_l, kernel_l, out_l = labels.groups()
    k = math.prod(d for d, label in zip(kernel, kernel_l) if label == "i")   # input features per group
    spatial = sorted(c for c in kernel_l if c.isdigit())
    window = re.search(r"window=\{([^}]*)\}", op.line)
    text = window.group(1) if window else ""
    n = len(spatial)
    sizes = _window(text, "size", n, 1)
    strides, lhs_dil, rhs_dil = (_window(text, key, n, 1) for key in ("stride", "lhs_dilate", "rhs_dilate"))
    pads = re.search(r"\bpad=([\d_x-]+)", text)
    pad_lo = [int(v.split("_")[0]) for v in pads.group(1).split("x")] if pads else [0] * n
    pairs = per_output = 1
    for i, d in enumerate(spatial):
        in_size, out_size = lhs[lhs_l.index(d)], result[out_l.index(d)]
        pairs *= _valid_taps(in_size, out_size, sizes[i], strides[i], pad_lo[i], lhs_dil[i], rhs_dil[i])
        per_output *= out_size
    return 2.0 * out / max(per_output, 1) * pairs * k


def fused_flops(comp: str, comps: dict, seen=None) -> float:
    """Matmul FLOPs of a fused computation (nested fusions included)."""
    ops = comps.get(comp, [])
    shapes = {op.name: op.shape for op in ops}
    total = 0.0
    for op in ops:
        if op.opcode in ("convolution", "dot"):
            total += _conv_flops(op, shapes)
        for callee in re.findall(r"calls=%?([\w.\-]+)", op.line):
            total += fused_flops(callee, comps)
    return total


def _expand_iota(spec: str) -> list[list[int]] | None:
    """Replica groups in iota form "[G,S]<=[d0,d1,...]T(p0,p1,...)" as explicit device lists."""
    found = re.match(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
    if not found:
        return None
    g, s = int(found.group(1)), int(found.group(2))
    ids = np.arange(math.prod(int(d) for d in found.group(3).split(","))).reshape([int(d) for d in found.group(3).split(",")])
    if found.group(4):
        ids = ids.transpose([int(p) for p in found.group(4).split(",")])
    return ids.reshape(g, s).tolist()


def replica_group(line: str) -> list[int] | None:
    """The first replica group of a collective (device ids), or None."""
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if listed:
        return [int(d) for d in listed.group(1).split(",") if d]
    named = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)   # mesh['a'=2,'b'=4] {'b'}
    if named:
        sizes = [(k, int(v)) for k, v in re.findall(r"'([^']+)'=(\d+)", named.group(1))]
        listed = re.findall(r"'([^']+)'", named.group(2))
        ids = np.arange(math.prod(v for _, v in sizes)).reshape([v for _, v in sizes] or [1])
        first = ids[tuple(slice(None) if k in listed else 0 for k, _ in sizes)]
        order = [k for k, _ in sizes if k in listed]
        return first.transpose([order.index(k) for k in listed]).reshape(-1).tolist() if listed else [0]
    iota = re.search(r"replica_groups=(\[[^ ,]*,[^ ]*)", line)
    groups = _expand_iota(iota.group(1)) if iota else None
    if groups:
        return groups[0]
    pairs = re.search(r"source_target_pairs=\{([^}]*\})\}", line)
    if pairs:
        return sorted({int(d) for d in re.findall(r"\d+", pairs.group(1))})
    return None


def _one_direction(chip) -> float:
    return chip.link_bw / max(chip.links, 1) / 2   # bytes/s of one direction of one link


def _points(group: list[int] | None, coords: list | None):
    """The group's torus coordinates [n, dims], or None where either is unknown."""
    if not group or not coords or max(group) >= len(coords):
        return None
    return np.asarray([coords[d] for d in group])


def link_bandwidth(group: list[int] | None, coords: list | None, chip) -> float:
    """Bytes/s one device sends into its replica group: both directions of each ICI link of every torus
    dimension the group spans (one dimension when the coordinates are not known). Members `s` apart along a
    dimension (a strided group: FSDP over expert blocks) reach each other over s links that the s interleaved
    groups running the same collective share: that dimension gives 1/s of a link."""
    points, links = _points(group, coords), 1.0
    if points is not None:
        strides = [int(np.diff(np.unique(points[:, d])).min()) for d in range(points.shape[1])
                   if points[:, d].max() > points[:, d].min()]
        links = sum(1.0 / s for s in strides) if strides else 1.0
    return 2 * links * _one_direction(chip)


def bisection_seconds(kind: str, sent_bytes: float, group: list[int] | None, coords: list | None, chip) -> float:
    """A lower bound on an all-to-all's time from its group's bisection (0 where none is derived).

    A group that fills a box of the torus, n devices with longest side L, each exchanging `sent_bytes` evenly
    with all n: half the group sends n x bytes / 4 across the cut through the longest side, which n / L links
    cross (no wraparound: the slices are compiled without it), each at one direction's bandwidth. So the exchange
    takes at least L x bytes / 4 / (one link, one direction), above what the devices' own links allow on a small
    box (a 2x2x2 box: 3.4 x; a line of 8: 4.6 x). Ring collectives (all-gather, all-reduce) are not bounded here.
    """
    points = _points(group, coords)
    if kind not in ("all-to-all", "ragged-all-to-all") or points is None:
        return 0.0
    extent = points.max(axis=0) - points.min(axis=0) + 1
    if math.prod(int(e) for e in extent) != len(group) or extent.max() < 2:   # not a box, or one device
        return 0.0
    return int(extent.max()) * sent_bytes / 4 / _one_direction(chip)


def program_cost(text: str, chip, *, coords: list | None = None, branch_weights=None, kernel_share=None) -> dict:
    """Step time of compiled TPU HLO `text` on `chip` (see the module docstring).

    coords: each device id's torus coordinates (`device.coords` of the mesh's devices in id order).
    kernel_share: Mosaic kernel name -> the share of its declared CostEstimate one run does (default 1).
    """
    comps, entry = hlo._computations(text)
    own, exposed = {}, {}   # (computation, op name) -> seconds
    rows = {}
    for comp, ops in comps.items():
        shapes = {op.name: op.shape for op in ops}
        parts = _parts(ops)
        starts = {}
        for index, op in enumerate(ops):
            key = (comp, op.name)
            opcode = op.opcode
            flops = bytes_ = 0.0
            basis, seconds, xla_s = "roofline", 0.0, None
            kind = opcode[:-6] if opcode.endswith("-start") else opcode[:-5] if opcode.endswith("-done") else opcode
            if kind in hlo.KINDS:
                if opcode.endswith("-done"):
                    continue
                group = replica_group(op.line)
                n = len(group) if group else None
                operand = hlo.shape_bytes(shapes.get(op.operands[0], "")) if op.operands else 0
                result = hlo.shape_bytes(op.shape)
                if opcode.endswith("-start") and op.shape.startswith("("):   # (operands, result, ...) tuples
                    result = hlo.shape_bytes(op.shape) - operand
                sent = 0.0 if n == 1 else traffic(kind, result, n, operand)
                seconds = max(sent / link_bandwidth(group, coords, chip), bisection_seconds(
                    kind, exchanged_bytes(kind, result, operand), group, coords, chip) if sent else 0.0)
                rows[key] = dict(op=op, kind="collective " + kind, part="collectives", flops=0.0, bytes=sent,
                                 seconds=seconds, roofline_s=seconds, xla_s=None, basis="ICI links")
                if opcode.endswith("-start"):
                    starts[op.name] = (index, seconds)
                else:
                    own[key] = 0.0
                    exposed[key] = seconds
                continue
            if opcode in PREFETCHES:
                arrays = re.findall(r"\w+\[[\d,]*\]", op.shape)
                # a copy moves its operand; a slice-start returns ((operands), slice, context): only the slice moves
                moved = hlo.shape_bytes(arrays[0] if opcode == "copy-start" else arrays[len(op.operands)])
                seconds = moved / chip.hbm_bw
                starts[op.name] = (index, seconds)
                rows[key] = dict(op=op, kind=opcode, part=parts[op.name], flops=0.0, bytes=moved,
                                 seconds=seconds, roofline_s=seconds, xla_s=None, basis="HBM")
                continue
            if opcode in CONTAINERS or opcode.endswith("-done") or any(c in op.line for c in NO_DATA_CALLS):
                continue
            if opcode == "custom-call" and "tpu_custom_call" in op.line:
                declared, basis = kernel_cost(op.line), "CostEstimate"
                if declared is None:
                    declared, basis = splash_cost(op, kernel_name(op)), "lingpack's splash estimate"
                flops, bytes_ = declared if declared else (0.0, 0.0)
                basis = basis if declared else "none declared"
                share = kernel_share(kernel_name(op)) if kernel_share else 1.0
                if share != 1.0:
                    flops, bytes_, basis = flops * share, bytes_ * share, f"{basis} x {share:.3g} (rows run)"
                name = "kernel " + kernel_name(op)
            else:
                callee = re.search(r"calls=%?([\w.\-]+)", op.line)
                flops = fused_flops(callee.group(1), comps) if callee else (
                    _conv_flops(op, shapes) if opcode in ("convolution", "dot") else 0.0)
                bytes_ = hlo._moved(op, shapes, comps)
                name = opcode
            roof = max(flops / chip.peak_flops, bytes_ / chip.hbm_bw)
            cycles = estimated_cycles(op.line) if chip.cycle_hz else None
            if cycles is not None and basis == "roofline":
                xla_s = cycles / chip.cycle_hz
                seconds, basis = max(xla_s, flops / chip.peak_flops), "XLA:TPU cycles"
            else:
                seconds = roof
            own[key] = seconds
            rows[key] = dict(op=op, kind=name, part=parts[op.name], flops=flops, bytes=bytes_, seconds=seconds,
                             roofline_s=roof, xla_s=xla_s, basis=basis)
        # async pairs: the compute scheduled between start and done hides the transfer
        for index, op in enumerate(ops):
            if op.opcode.endswith("-done") and op.operands and op.operands[0] in starts:
                first, seconds = starts[op.operands[0]]
                between = sum(own.get((comp, o.name), 0.0) for o in ops[first + 1:index])
                exposed[(comp, op.operands[0])] = max(0.0, seconds - between)
                own.setdefault((comp, op.operands[0]), 0.0)
    executed, unknown = hlo.executed(text, branch_weights)
    by_part, by_kind = collections.defaultdict(float), collections.defaultdict(float)
    flops_part, flops_kind = collections.defaultdict(float), collections.defaultdict(float)
    total = roof_total = hidden = flops_total = xla_cycles_s = 0.0
    top = collections.defaultdict(lambda: [0.0, 0.0, ""])
    for e in executed:
        if e.fused:
            continue
        key = (e.comp, e.op.name)
        row = rows.get(key)
        if row is None:
            continue
        spent = e.times * (own.get(key, 0.0) + exposed.get(key, 0.0))
        total += spent
        roof_total += e.times * row["roofline_s"]
        if (row["kind"].startswith("collective") or row["kind"] in PREFETCHES) and key in exposed:
            hidden += e.times * (row["seconds"] - exposed[key])
        flops_total += e.times * row["flops"]
        xla_cycles_s += e.times * (row["xla_s"] or 0.0)
        by_part[row["part"]] += spent
        by_kind[row["kind"]] += spent
        flops_part[row["part"]] += e.times * row["flops"]
        flops_kind[row["kind"]] += e.times * row["flops"]
        label = f"{row['kind']} [{row['part']}] {e.op.name}"
        top[label][0] += spent
        top[label][1] += e.times
        top[label][2] = row["basis"]
    ranked = sorted(top.items(), key=lambda kv: -kv[1][0])[:15]
    return {"step_s": total, "roofline_s": roof_total, "xla_cycles_s": xla_cycles_s, "hidden_s": hidden,
            "flops": flops_total, "unknown_trip_counts": unknown,
            "by_part": dict(sorted(by_part.items(), key=lambda kv: -kv[1])),
            "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "flops_by_part": {k: v for k, v in sorted(flops_part.items(), key=lambda kv: -kv[1]) if v},
            "flops_by_kind": {k: v for k, v in sorted(flops_kind.items(), key=lambda kv: -kv[1]) if v},
            "top": [{"op": k, "seconds": v[0], "runs": v[1], "basis": v[2]} for k, v in ranked]}
