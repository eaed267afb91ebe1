"""What the ring MLA layer and its one-device peer hold at their memory peaks, by kind of buffer.

    python -m experiments.context_parallel.ring_memory [--T 16384 65536]
    python -m experiments.context_parallel.ring_memory --table-only

The MLA layer of bench.py part 1 (B=1, 8 heads, emb 256, block 512, fp32, forward + backward) is compiled
for `ring` at context=8 (zigzag) and for `blockwise` (the same tile kernel on one device), with XLA's
buffer dump, under XLA:CPU's default scheduler and under its memory-optimized one (each scheduler in its
own subprocess: XLA reads the flag once per process). Every value live at the buffer-assignment peak
(`lingpack.plan.hlo.peak_buffers`) is put in one kind by the instruction that produced it. Nothing runs.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from lingpack.plan import hlo  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "experiments/context_parallel/results"
MIB = 2 ** 20
MODES = ("blockwise", "ring")
KINDS = ("K/V or dK/dV blocks received (collective-permute results)", "copies of loop carries (XLA's copy insertion)",
         "fills and constant cotangents (operand-free, and their copies)", "tile temporaries [.., block, block]",
         "inputs and parameters", "activations and residuals (q, k, v, o, softmax state, projections, grads)")


def _producers(hlo_text: str) -> dict[str, tuple[str, list[str]]]:
    """instruction name -> (opcode, operand names); fusions by their name's kind (`wrapped_broadcast` ...)."""
    found = {}
    for line in hlo_text.splitlines():
        m = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = (?:\([^=]*?\)|\S+) ([\w\-]+)\((.*?)\)", re.sub(r"/\*.*?\*/", "", line))
        if m:
            found[m.group(1)] = (m.group(2), re.findall(r"%([\w.\-]+)", m.group(3)))
    return found


def kind_of(buffer, producers: dict, block: int) -> str:
    name = re.sub(r"\{.*\}$", "", buffer.name)
    opcode, operands = producers.get(name, ("", []))

    def operand_free(n: str, depth: int = 0) -> bool:   # a broadcast of constants, through copies / bitcasts
        op, args = producers.get(n, ("", []))
        if op == "constant" or n.startswith("constant"):
            return True
        return depth < 4 and bool(args) and all(operand_free(a, depth + 1) for a in args) \
            if op in ("broadcast", "copy", "bitcast", "fusion") else False

    if opcode == "collective-permute":
        return KINDS[0]
    if (opcode in ("broadcast", "fusion", "copy") and operands and all(operand_free(a) for a in operands)) \
            or name.startswith("wrapped_broadcast"):
        return KINDS[2]
    if opcode == "copy" and operands and producers.get(operands[0], ("",))[0] in ("get-tuple-element", "parameter"):
        return KINDS[1]
    if f",{block},{block}]" in buffer.shape:
        return KINDS[3]
    if buffer.op_name in ("x", "seg", "pos") or buffer.op_name.startswith("params"):
        return KINDS[4]
    return KINDS[5]


def measure(T: int, mode: str) -> dict:
    from experiments.context_parallel.bench import BLOCK, mla_lowered, peak_bytes
    with tempfile.TemporaryDirectory() as directory:
        compiled, live = hlo.compile_with_buffer_dump(mla_lowered(T, mode), directory)
    text = compiled.as_text()
    buffers, producers = hlo.peak_buffers(live, text), _producers(text)
    kinds = hlo.group_bytes(buffers, lambda b: kind_of(b, producers, BLOCK))
    return dict(peak_bytes=peak_bytes(compiled), live_bytes=sum(b.bytes for b in buffers), kinds=kinds,
                largest=[dict(bytes=b.bytes, name=b.name, shape=b.shape, kind=kind_of(b, producers, BLOCK),
                              op=b.op_name[-120:]) for b in buffers[:20]])


def table(results: dict) -> str:
    lines = []
    for T, runs in sorted(results["runs"].items(), key=lambda kv: int(kv[0])):
        cols = [(s, m) for s in hlo.CPU_SCHEDULERS for m in MODES if f"{m}/{s}" in runs]
        lines += [f"MLA layer fwd+bwd at T={int(T) // 1024}K (B=1, 8 heads, emb 256, block 512, fp32): MiB per device "
                  "live at the buffer-assignment peak, by kind; `blockwise` on one device, `ring` at context=8 "
                  "(zigzag); per XLA:CPU scheduler (default: concurrency-optimized; memory: memory-optimized).", "",
                  "| kind | " + " | ".join(f"{m} ({s})" for s, m in cols) + " |", "|---|" + "---|" * len(cols)]
        for kind in KINDS:
            lines.append(f"| {kind} | " + " | ".join(f"{runs[f'{m}/{s}']['kinds'].get(kind, 0) / MIB:.1f}"
                                                    for s, m in cols) + " |")
        lines.append("| live at the peak | " + " | ".join(f"{runs[f'{m}/{s}']['live_bytes'] / MIB:.1f}"
                                                         for s, m in cols) + " |")
        lines.append("| peak (memory_analysis) | " + " | ".join(f"{runs[f'{m}/{s}']['peak_bytes'] / MIB:.1f}"
                                                              for s, m in cols) + " |")
        lines.append("")
    lines.append(f"Compiled for 8 fake CPU devices (shared 2-core host), lingpack at commit {results['commit']}.")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)   # worker: T mode -> JSON on stdout
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(int(args.one[0]), args.one[1])))
        return
    path = OUT / "ring_memory.json"
    if not args.table_only:
        from experiments.provenance import commit
        results = {"commit": commit(), "runs": {}}
        for T in args.T:
            for scheduler in hlo.CPU_SCHEDULERS:
                env = hlo.scheduler_env(scheduler, os.environ)
                for mode in MODES:
                    run = subprocess.run([sys.executable, "-m", "experiments.context_parallel.ring_memory", "--one",
                                          str(T), mode], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
                    r = json.loads(run.stdout.strip().splitlines()[-1])
                    results["runs"].setdefault(str(T), {})[f"{mode}/{scheduler}"] = r
                    print(T, mode, scheduler, f"{r['peak_bytes'] / MIB:.1f} MiB", flush=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
    print(table(json.loads(path.read_text())))


if __name__ == "__main__":
    main()
