"""A results block whose measured commit predates a change to its code says "stale since <commit>"."""
import json
import subprocess

from experiments import blocks, check_results


def _git(root, *args):
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def _commit(root, files: dict, message: str) -> str:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", message)
    return _git(root, "rev-parse", "--short", "HEAD")


def test_a_change_to_the_code_after_the_measured_commit_makes_a_block_stale(tmp_path):
    _git(tmp_path, "init", "-q")
    measured = _commit(tmp_path, {"src/pkg/kernel.py": "x = 1\n", "src/other.py": "y = 1\n"}, "code")
    artifact = {"commit": measured + "+changes", "rows": [{"commit": measured}]}
    code = ("src/pkg", "bench.py")
    assert blocks.recorded_commits(artifact) == {measured}
    assert blocks.recorded_commits({"commits": {"layer": "abc1234", "v5e": measured + "+changes"}}) == {"abc1234", measured}
    # the results commit itself, docs and code elsewhere: still fresh
    _commit(tmp_path, {"results/r.json": json.dumps(artifact), "src/pkg/README.md": "notes\n",
                       "src/other.py": "y = 2\n"}, "results")
    fresh = blocks.staleness(code, {measured}, tmp_path)
    assert fresh.since is None and fresh.unknown is None and blocks.mark("make_run", fresh) == ""
    changed = _commit(tmp_path, {"src/pkg/kernel.py": "x = 2\n"}, "kernel")
    _commit(tmp_path, {"bench.py": "z = 1\n"}, "bench")
    stale = blocks.staleness(code, {measured}, tmp_path)
    assert (stale.since, stale.recorded, stale.changed) == (changed, (measured,), ("bench.py", "src/pkg"))
    assert blocks.mark("make_run", stale) == (f"**Stale since {changed}**: its code changed after the measured commit "
                                              f"{measured}; `python -m experiments.make_run.run_default` remeasures it."
                                              "\n\n")
    # remeasured at HEAD: fresh again
    assert blocks.staleness(code, {_git(tmp_path, "rev-parse", "--short", "HEAD")}, tmp_path).since is None
    # an older measurement among several decides
    assert blocks.staleness(code, {measured, changed}, tmp_path).since == changed


def test_comments_and_docstrings_stale_nothing_a_code_change_does(tmp_path):
    _git(tmp_path, "init", "-q")
    measured = _commit(tmp_path, {"src/k.py": '"""Doc."""\nx = 1  # one\n\n\ndef f():\n    """Doc."""\n    return x\n'},
                       "code")
    _commit(tmp_path, {"src/k.py": '"""Other doc."""\n# a comment\nx = 1  # uno\n\n\ndef f():\n    """More."""\n'
                                   '    return x\n'}, "words")
    assert blocks.staleness(("src",), {measured}, tmp_path).since is None
    changed = _commit(tmp_path, {"src/k.py": '"""Other doc."""\nx = 2\n\n\ndef f():\n    return x\n'}, "code")
    assert blocks.staleness(("src",), {measured}, tmp_path).since == changed
    _commit(tmp_path, {"src/k.py": "x = 2\n\n\ndef f():\n    return x\n"}, "words again")
    assert blocks.staleness(("src",), {changed}, tmp_path).since is None
    # a string statement that is not a docstring is code
    _commit(tmp_path, {"src/k.py": 'x = 2\n"not a docstring"\n\n\ndef f():\n    return x\n'}, "code")
    assert blocks.staleness(("src",), {changed}, tmp_path).since is not None


def test_staleness_is_unknown_without_history_or_commit(tmp_path):
    assert blocks.staleness(("src",), {"abc1234"}, tmp_path).unknown == "no git history"
    _git(tmp_path, "init", "-q")
    _commit(tmp_path, {"a.py": "a\n"}, "a")
    assert "not in this history" in blocks.staleness(("src",), {"abc1234"}, tmp_path).unknown
    assert blocks.staleness(("src",), set(), tmp_path).unknown == "its artifact records no commit"


def test_the_check_wants_a_stale_block_marked_and_a_fresh_one_unmarked():
    pages = check_results.read_pages()
    page = "docs/running.md"
    fresh = blocks.Staleness(None, ("5e8e44c",))
    stale = blocks.Staleness("1234567", ("5e8e44c",), ("src/lingpack",))
    unmarked = blocks.BLOCK.sub(lambda m: m.group(1) + blocks.MARK.sub("", m.group(3)) + m.group(4), pages[page])
    marked = blocks.BLOCK.sub(lambda m: m.group(1) + blocks.mark("make_run", stale) + blocks.MARK.sub("", m.group(3))
                              + m.group(4) if m.group(2) == "make_run" else m.group(0), unmarked)
    ours = lambda found: [p for p in found if p.startswith(f"{page}'s 'make_run'")]
    assert ours(check_results.problems({**pages, page: unmarked}, {"make_run": fresh})) == []
    assert ours(check_results.problems({**pages, page: marked}, {"make_run": stale})) == []
    assert ours(check_results.problems({**pages, page: unmarked}, {"make_run": stale})) == [
        f"{page}'s 'make_run' block is stale since 1234567 and does not say so; "
        "python -m experiments.check_results --write marks it"]
    assert "says it is stale but is not" in ours(check_results.problems({**pages, page: marked}, {"make_run": fresh}))[0]
    unknown = blocks.Staleness(None, ("5e8e44c",), unknown="no git history")   # a source snapshot: not checked
    assert ours(check_results.problems({**pages, page: marked}, {"make_run": unknown})) == []


def test_registration_goes_one_way():
    """The benchmark scripts rewrite their blocks through the registry; nothing imports the check back."""
    import pathlib
    root = pathlib.Path(blocks.__file__).parent
    importers = [p for p in root.rglob("*.py") if "import check_results" in p.read_text()
                 or "experiments.check_results import" in p.read_text()]
    assert importers == []
    assert "experiments." not in "".join(line for line in (root / "blocks.py").read_text().splitlines()
                                         if line.startswith(("import", "from")))
