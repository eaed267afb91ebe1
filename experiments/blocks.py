"""The results blocks of the docs: what each renders, from which artifact, and which code its figures measured.

A block sits in README.md, docs/*.md or experiments/*/README.md between `<!-- results: NAME -->` and
`<!-- /results -->`. `BLOCKS[NAME]` names its JSON artifact, its renderer (`module:function`, imported only
when the block is rendered, so a benchmark script can rewrite its own block through this module without an
import circle), the code paths its figures depend on, the command that remeasures it, and whether it is
cheap enough for `python -m experiments.check_results --rerun-cheap` (`make test-all`).

A block is stale when a commit after the one its artifact records changed one of its code paths (files
under them other than docs and results: .md, .json, .csv, .png; a Python file whose comments or docstrings
alone changed counts as unchanged); the rendered block then opens with
"stale since <that commit>" until the benchmark is rerun. Without a git history (a source snapshot) or
when the recorded commit is not in it (a shallow clone), staleness is unknown and nothing is marked.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- results: (\w+) -->\n)(.*?)(<!-- /results -->)", re.S)
PAGES = ["README.md", "docs/*.md", "experiments/*/README.md"]
MARK = re.compile(r"\A\*\*Stale since [^*]+\*\*[^\n]*\n\n")   # the first line of a stale block, then a blank one
NOT_CODE = (".md", ".json", ".csv", ".png", ".svg", ".txt")  # docs and results: their changes stale nothing

# code that a whole run reads (run.py and the configs included)
RUN = ("src/lingpack", "conf", "run.py")
# what one compiled model step reads (no data pipeline, no tracking)
STEP = ("src/lingpack/models", "src/lingpack/kernels", "src/lingpack/parallel", "src/lingpack/backend.py",
        *(f"src/lingpack/train/{m}.py" for m in ("configs", "loss", "optim", "program", "sharding", "step")),
        "src/lingpack/plan/hlo.py", "src/lingpack/config.py", "src/lingpack/precision.py", "conf/model", "conf/kernel")
ATTENTION_CP = ("src/lingpack/parallel", "src/lingpack/kernels/attention", "src/lingpack/models/mla.py",
                "src/lingpack/plan/hlo.py")


@dataclasses.dataclass(frozen=True)
class Block:
    artifact: str                  # JSON, relative to the repository root
    renderer: str                  # "module:function" of the artifact (or of `unpack`'s fields, in order)
    code: tuple[str, ...]          # paths whose change outdates the figures
    rerun: str                     # the command that remeasures it
    cheap: bool = False            # rerun by `check_results --rerun-cheap` (about a minute on 2 cores)
    unpack: tuple[str, ...] = ()   # call the renderer with these fields of the artifact ("-" where absent)


BLOCKS = {
    "make_run": Block("experiments/make_run/results/summary.json", "experiments.make_run.run_default:table",
                      (*RUN, "experiments/make_run/run_default.py"), "python -m experiments.make_run.run_default",
                      cheap=True),
    "bench_kda": Block("experiments/bench_kda/results/bench_kda.json", "experiments.bench_kda.bench:table",
                       ("src/lingpack/kernels/kda", "src/lingpack/parity/fla.py", "experiments/bench_kda/bench.py"),
                       "python -m experiments.bench_kda.bench"),
    "bench_train": Block("experiments/bench_train/results/bench_train.json", "experiments.bench_train.bench:table",
                         (*STEP, "experiments/bench_train/bench.py"), "python -m experiments.bench_train.bench"),
    "pallas_cost": Block("experiments/pallas_cost/results/results.json", "experiments.pallas_cost.cost_model:summary",
                         ("src/lingpack/kernels/kda", "experiments/pallas_cost/cost_model.py"),
                         "python -m experiments.pallas_cost.cost_model"),
    "pallas_cost_detail": Block("experiments/pallas_cost/results/results.json",
                                "experiments.pallas_cost.cost_model:markdown",
                                ("src/lingpack/kernels/kda", "experiments/pallas_cost/cost_model.py"),
                                "python -m experiments.pallas_cost.cost_model"),
    "phantom_overhead": Block("experiments/phantom_overhead/results/results.json",
                              "experiments.phantom_overhead.sweep:table",
                              ("src/lingpack/kernels/kda", "experiments/phantom_overhead/sweep.py",
                               "experiments/bench_kda/bench.py"), "python -m experiments.phantom_overhead.sweep"),
    "loss_parity": Block("experiments/loss_parity/results/results.json", "experiments.loss_parity.run_parity:table",
                         (*RUN, "experiments/loss_parity/run_parity.py"),
                         "python -m experiments.loss_parity.run_parity"),
    "context_parallel": Block("experiments/context_parallel/results/results.json",
                              "experiments.context_parallel.bench:table",
                              (*ATTENTION_CP, "experiments/context_parallel/bench.py"),
                              "python -m experiments.context_parallel.bench", unpack=("memory", "balance", "commit")),
    "context_parallel_model": Block("experiments/context_parallel/results/model_memory.json",
                                    "experiments.context_parallel.model_memory:table",
                                    (*STEP, "experiments/context_parallel/model_memory.py"),
                                    "python -m experiments.context_parallel.model_memory"),
    "context_schedule": Block("experiments/context_parallel/results/context_schedule.json",
                              "experiments.context_parallel.context_schedule:table",
                              (*RUN, "experiments/context_parallel/context_schedule.py"),
                              "python -m experiments.context_parallel.context_schedule"),
    "context_parallel_model_tpu": Block("experiments/context_parallel/results/model_memory.json",
                                        "experiments.context_parallel.model_memory:tpu_table",
                                        (*STEP, "experiments/context_parallel/model_memory.py",
                                         "experiments/xla_tpu.py"),
                                        "python -m experiments.context_parallel.model_memory --compiler tpu "
                                        "--T 65536 --cp 1 8 --remeasure"),
    "plan_flagship": Block("experiments/plan/results/flagship.json", "experiments.plan.flagship:table",
                           (*STEP, "src/lingpack/plan", "src/lingpack/train/flops.py", "src/lingpack/tpu_flags.py",
                            "experiments/plan/flagship.py"),
                           "python -m experiments.plan.flagship --rerun"),
    "cp_attribution": Block("experiments/context_parallel/results/attribution.json",
                            "experiments.context_parallel.attribution:table",
                            (*STEP, "experiments/context_parallel/attribution.py",
                             "experiments/context_parallel/model_memory.py"),
                            "python -m experiments.context_parallel.attribution"),
    "ring_memory": Block("experiments/context_parallel/results/ring_memory.json",
                         "experiments.context_parallel.ring_memory:table",
                         (*ATTENTION_CP, "experiments/context_parallel/ring_memory.py",
                          "experiments/context_parallel/bench.py"),
                         "python -m experiments.context_parallel.ring_memory"),
    "expert_parallel": Block("experiments/expert_parallel/results/results.json", "experiments.expert_parallel.bench:table",
                             (*STEP, "experiments/expert_parallel/bench.py"), "python -m experiments.expert_parallel.bench"),
    "whole_document_packing": Block("experiments/whole_document_packing/results/fill.json",
                                    "experiments.whole_document_packing.fill:table",
                                    ("src/lingpack/data", "experiments/whole_document_packing/fill.py"),
                                    "python -m experiments.whole_document_packing.fill"),
    "expert_parallel_tpu": Block("experiments/expert_parallel/results/tpu.json", "experiments.expert_parallel.tpu:table",
                                 ("src/lingpack/parallel/expert.py", "src/lingpack/models/moe.py",
                                  "src/lingpack/backend.py", "experiments/expert_parallel/tpu.py"),
                                 "python -m experiments.expert_parallel.tpu"),
    "expert_dedup": Block("experiments/expert_parallel/results/dedup.json", "experiments.expert_parallel.dedup:table",
                          ("src/lingpack/models/moe.py", "src/lingpack/plan", "src/lingpack/backend.py",
                           "experiments/expert_parallel/dedup.py", "experiments/xla_tpu.py"),
                          "python -m experiments.expert_parallel.dedup"),
    "plan_ops": Block("experiments/plan/results/ops.json", "experiments.plan.ops:table",
                      ("src/lingpack/models/moe.py", "src/lingpack/plan", "src/lingpack/backend.py",
                       "experiments/plan/ops.py", "experiments/xla_tpu.py"),
                      "python -m experiments.plan.ops", cheap=True),
    "tpu_flags": Block("experiments/tpu_flags/results/flags.json", "experiments.tpu_flags.measure:table",
                       ("src/lingpack/tpu_flags.py", "experiments/tpu_flags/measure.py"),
                       "python -m experiments.tpu_flags.measure"),
    "flagship_memory_tpu": Block("experiments/flagship_memory/results/flagship.json",
                                 "experiments.flagship_memory.flagship:tpu_table",
                                 (*STEP, "experiments/flagship_memory/flagship.py", "experiments/xla_tpu.py"),
                                 "python -m experiments.flagship_memory.flagship --compiler tpu"),
    "flagship_depth_tpu": Block("experiments/flagship_memory/results/depth_tpu.json",
                                "experiments.flagship_memory.depth_tpu:table",
                                (*STEP, "experiments/flagship_memory/depth_tpu.py",
                                 "experiments/flagship_memory/flagship.py", "experiments/xla_tpu.py"),
                                "python -m experiments.flagship_memory.depth_tpu"),
    "mosaic_compile": Block("experiments/mosaic_compile/results/mosaic_compile.json",
                            "experiments.mosaic_compile.compile_kernels:table",
                            ("src/lingpack/kernels", "experiments/mosaic_compile/compile_kernels.py"),
                            "python -m experiments.mosaic_compile.compile_kernels"),
    "kda_roofline": Block("experiments/mosaic_compile/results/mosaic_compile.json",
                          "experiments.mosaic_compile.compile_kernels:roofline_table",
                          ("src/lingpack/kernels", "experiments/mosaic_compile/compile_kernels.py"),
                          "python -m experiments.mosaic_compile.compile_kernels"),
}


def load(path: str, root: Path = ROOT):
    return json.loads((root / path).read_text())


def table(name: str) -> str:
    """What the block's renderer makes of its artifact (no staleness line)."""
    block = BLOCKS[name]
    module, function = block.renderer.split(":")
    data = load(block.artifact)
    args = [data.get(k, "-") for k in block.unpack] if block.unpack else [data]
    return getattr(importlib.import_module(module), function)(*args)


def recorded_commits(data) -> set[str]:
    """Every `commit` the artifact records (any depth; also `commits`: {part: commit}), without a `+changes` suffix."""
    if isinstance(data, dict):
        parts = data.get("commits") if isinstance(data.get("commits"), dict) else {}
        found = {c.split("+")[0] for c in (data.get("commit"), *parts.values()) if isinstance(c, str)}
        return found.union(*(recorded_commits(v) for k, v in data.items() if k not in ("commit", "commits")))
    if isinstance(data, list):
        return set().union(*(recorded_commits(v) for v in data))
    return set()


def _git(root: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)


def has_history(root: Path = ROOT) -> bool:
    return _git(root, "rev-parse", "--verify", "-q", "HEAD").returncode == 0


@dataclasses.dataclass(frozen=True)
class Staleness:
    since: str | None               # the first commit after the recorded one to change the code; None: fresh
    recorded: tuple[str, ...]       # the artifact's commits
    changed: tuple[str, ...] = ()   # the code paths that changed
    unknown: str | None = None      # why staleness cannot be told


def staleness(code: tuple[str, ...], commits: set[str], root: Path = ROOT) -> Staleness:
    """Whether a commit after any of `commits` (HEAD's history, merges aside) changed a code file under
    `code`: the first such commit after the oldest measurement, and which of `code` changed."""
    recorded = tuple(sorted(commits))
    if not commits:
        return Staleness(None, recorded, unknown="its artifact records no commit")
    if not has_history(root):
        return Staleness(None, recorded, unknown="no git history")
    missing = [c for c in recorded if _git(root, "cat-file", "-e", f"{c}^{{commit}}").returncode]
    if missing:
        return Staleness(None, recorded, unknown=f"commit {', '.join(missing)} is not in this history")
    since, changed, first = None, set(), 0
    for c in recorded:  # each commit's own figures are stale from the first change after it
        log = _git(root, "log", "--no-merges", "--reverse", "--format=@%h", "--name-only", f"{c}..HEAD", "--",
                   *code).stdout
        shas = []
        for entry in log.split("@")[1:]:
            sha, *files = entry.split()
            code_files = [f for f in files if not f.endswith(NOT_CODE)]
            if code_files and (shas or _changes_code(root, sha, code_files)):   # the first must change code
                shas.append(sha)
                changed |= {next(p for p in code if f == p or f.startswith(p.rstrip("/") + "/")) for f in code_files}
        if len(shas) > first:  # the oldest measurement has the longest list of later changes
            since, first = shas[0], len(shas)
    return Staleness(since, recorded, tuple(sorted(changed)))


def _python_code(text: str | None):
    """A Python file's code without its comments and docstrings (None: not Python, or absent)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, TypeError):
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def _changes_code(root: Path, sha: str, files: list[str]) -> bool:
    """Whether commit `sha` changed more than comments and docstrings in `files` (non-Python files: any change)."""
    if any(not f.endswith(".py") for f in files):
        return True
    specs = [f"{rev}:{f}" for f in files for rev in (f"{sha}^", sha)]
    out = subprocess.run(["git", "cat-file", "--batch"], cwd=root, input="\n".join(specs).encode() + b"\n",
                         capture_output=True).stdout
    texts = []
    while out:   # "<oid> blob <size>\n<content>\n", or "<spec> missing\n" (a file added or deleted)
        header, _, out = out.partition(b"\n")
        if header.endswith(b" missing"):
            texts.append(None)
            continue
        size = int(header.split()[2])
        texts.append(out[:size].decode("utf-8", "replace"))
        out = out[size + 1:]
    pairs = zip(texts[0::2], texts[1::2])
    return any(a is None or b is None or _python_code(a) != _python_code(b) for a, b in pairs)


def block_staleness(name: str, root: Path = ROOT) -> Staleness:
    block = BLOCKS[name]
    return staleness(block.code, recorded_commits(load(block.artifact, root)), root)


def mark(name: str, stale: Staleness) -> str:
    """The block's first line when it is stale, else ''. It names the first change only, so that later commits
    leave it alone (`check_results` lists the paths that changed)."""
    if stale.since is None:
        return ""
    return (f"**Stale since {stale.since}**: its code changed after the measured commit "
            f"{', '.join(stale.recorded)}; `{BLOCKS[name].rerun}` remeasures it.\n\n")


def render(name: str, root: Path = ROOT) -> str:
    """The whole block: the staleness line (when stale) and the table."""
    return mark(name, block_staleness(name, root)) + table(name)


def read_pages(root: Path = ROOT) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for pattern in PAGES for p in sorted(root.glob(pattern))}


def write(text: str, root: Path = ROOT) -> str:
    """`text` with every block whose artifact exists rendered again (unknown names are left alone)."""
    present = {name for name, b in BLOCKS.items() if (root / b.artifact).exists()}
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2), root) + m.group(4)
                     if m.group(2) in present else m.group(0), text)


def rewrite(names: set[str] | None = None, root: Path = ROOT) -> list[str]:
    """Render again, in place, every page holding one of `names` (every block: None); the pages written."""
    written = []
    for page, text in read_pages(root).items():
        if any(m.group(2) in (names or BLOCKS) for m in BLOCK.finditer(text)):
            new = write(text, root)
            if new != text:
                (root / page).write_text(new)
                written.append(page)
    return written
