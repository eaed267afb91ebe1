"""The repository speaks for itself: it cites only what it ships or what is public, its docs links resolve,
its package has no import circles, its experiments run against the installed package, and no two paths
differ only by case."""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT = (".py", ".md", ".yaml", ".yml", ".sh", ".sbatch", ".toml", ".cfg", ".txt")
DOC_PAGES = ("configuration", "data", "kernels", "parity", "parallelism", "running", "testing", "benchmarks", "design")
# Words of how the work was done, and files that do not ship with the repository.
FORBIDDEN = re.compile(r"REFERENCE\.md|\bRFC\b|\bseed (RFC|design)|\.\./shared|shared/seeds|\bissue ?#?\d+|"
                       r"\b(first|second|third|fourth) (KDA )?pass\b|\bthis (branch|session)\b|\bprevious run\b|"
                       r"\b(before|after) (the )?issue\b", re.I)


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        pytest.skip("not a git checkout")
    return [p for p in out.stdout.splitlines() if (ROOT / p).is_file()]


def _text_files() -> list[str]:
    return [p for p in _tracked() if p.endswith(TEXT) or Path(p).name == "Makefile"]


def test_nothing_cites_files_outside_the_repository_or_the_work_behind_it():
    hits = []
    for path in _text_files():
        if "/results/" in path or path == "tests/test_repository.py":
            continue   # artifacts record what ran; this file names the patterns
        for number, line in enumerate((ROOT / path).read_text(errors="replace").splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{path}:{number}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits)


def test_the_check_can_fail():
    for line in ("see REFERENCE.md §3", "the seed RFC's design", "as in issue 17", "after the third pass",
                 "measured on this branch", "(previous run)"):
        assert FORBIDDEN.search(line), line
    for line in ("this process's rows", "an earlier pass over the same chunk", "Megatron's --seed"):
        assert not FORBIDDEN.search(line), line


def test_no_paths_differ_only_by_case():
    seen: dict[str, str] = {}
    clashes = []
    for path in _tracked():
        for i in range(1, path.count("/") + 2):
            prefix = "/".join(path.split("/")[:i])
            other = seen.setdefault(prefix.lower(), prefix)
            if other != prefix:
                clashes.append((other, prefix))
    assert not clashes, sorted(set(clashes))


def _anchor(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_docs_pages_exist_and_every_cited_section_resolves():
    assert all((ROOT / "docs" / f"{name}.md").is_file() for name in DOC_PAGES)
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    cite = re.compile(r"docs/(\w+)\.md#([\w-]+)")
    link = re.compile(r"\]\(((?:\.\./)*[\w./-]*?)(\w+\.md)?#([\w-]+)\)")
    broken = []
    for path in _text_files():
        text = (ROOT / path).read_text(errors="replace")
        targets = [(ROOT / "docs" / f"{page}.md", anchor) for page, anchor in cite.findall(text)]
        if path.endswith(".md"):
            here = (ROOT / path).parent
            targets += [((here / (prefix + (page or Path(path).name))).resolve(), anchor)
                        for prefix, page, anchor in link.findall(text)]
        broken += [f"{path}: {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}#{anchor}"
                   for target, anchor in targets if not target.is_file() or anchor not in _anchors(target)]
    assert not broken, "\n".join(broken)


def _imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """Modules of the package that `module` imports anywhere in its file (function-level imports too)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def test_no_import_circles_in_the_package():
    src = ROOT / "src"
    files = {".".join(p.relative_to(src).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (src / "lingpack").rglob("*.py")}
    edges = {m: _imports(p, m, set(files)) for m, p in files.items()}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(frozenset(component))

    for module in files:
        if module not in index:
            visit(module)
    assert not circles, [sorted(c) for c in circles]


def test_experiments_import_the_package_not_the_tests():
    offenders = []
    for path in sorted((ROOT / "experiments").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                offenders += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n.split(".")[0] == "tests"]
            if isinstance(node, ast.Attribute) and node.attr in ("insert", "append") and \
                    ast.unparse(node.value) == "sys.path":
                offenders.append(f"{path.relative_to(ROOT)} changes sys.path")
    assert not offenders, offenders


def test_every_config_key_is_documented():
    """docs/configuration.md names every key of every config group (a key added to a schema needs its line)."""
    import dataclasses

    from lingpack import config
    from lingpack.models import kda, ling3, mla, moe, mtp
    from lingpack.train.schedule import ContextSchedule
    groups = {"model": ling3.Ling3Config, "model.kda": kda.KDAConfig, "model.mla": mla.MLAConfig,
              "model.moe": moe.MoEConfig, "model.mtp": mtp.MTPConfig, "kernel": config.KernelConfig,
              "data": config.DataConfig, "loss": config.LossConfig, "optim": config.OptimConfig,
              "parallel": config.ParallelConfig, "train": config.TrainConfig, "checkpoint": config.CheckpointConfig,
              "logger": config.LoggerConfig, "parity": config.ParityConfig, "distributed": config.DistributedConfig,
              "schedule": ContextSchedule}
    page = (ROOT / "docs" / "configuration.md").read_text()
    missing = []
    for group, cls in groups.items():
        sub = group.partition(".")[2]
        for field in dataclasses.fields(cls):
            if dataclasses.is_dataclass(field.default):
                continue   # a nested group, documented key by key
            names = {f"`{field.name}`", f"`{group}.{field.name}`"} | ({f"`{sub}.{field.name}`"} if sub else set())
            if sub and f"`{field.name}`" in names:
                names.discard(f"`{field.name}`")   # a nested key is written with its group: `kda.num_heads`
            if not any(name in page for name in names):
                missing.append(f"{group}.{field.name}")
    assert not missing, f"docs/configuration.md does not describe {missing}"
