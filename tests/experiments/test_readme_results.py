"""README and docs results tables are the artifacts their committed scripts wrote (what `make check-results` runs)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _check_results():
    spec = importlib.util.spec_from_file_location("check_results", ROOT / "experiments" / "check_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_tables_match_their_artifacts():
    check = _check_results()
    readme = (ROOT / "README.md").read_text()
    assert check.problems(readme) == []
    readme_blocks = {m[1] for m in check.BLOCK.findall(readme)} - set(check.PAGE_ARTIFACTS)
    assert readme_blocks and readme_blocks == set(check.ARTIFACTS)


def test_the_check_can_fail():
    check = _check_results()
    readme = (ROOT / "README.md").read_text()
    tampered = check.BLOCK.sub(lambda m: m.group(1) + m.group(3).replace("|", "| ", 1) + m.group(4)
                               if m.group(2) == "make_run" else m.group(0), readme)   # one changed cell
    assert tampered != readme
    assert any("'make_run' block differs" in p for p in check.problems(tampered))
    dropped = check.BLOCK.sub(lambda m: "" if m.group(2) == "make_run" else m.group(0), readme)
    assert any("lacks the block <!-- results: make_run -->" in p for p in check.problems(dropped))
    pages = check.read_pages()
    page = pages["docs/parity.md"]
    assert check.page_problems(pages) == []
    tampered = check.BLOCK.sub(lambda m: m.group(1) + m.group(3).replace("|", "| ", 1) + m.group(4), page)
    assert any("docs/parity.md's 'loss_parity' block differs" in p
               for p in check.page_problems({**pages, "docs/parity.md": tampered}))
    assert any("docs/parity.md lacks the block <!-- results: loss_parity -->" in p
               for p in check.page_problems({**pages, "docs/parity.md": check.BLOCK.sub("", page)}))
