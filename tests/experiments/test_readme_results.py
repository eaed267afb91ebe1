"""Results tables in README.md and docs/ are the artifacts their committed scripts wrote (`make check-results`)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _check_results():
    spec = importlib.util.spec_from_file_location("check_results", ROOT / "experiments" / "check_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_tables_match_their_artifacts():
    check = _check_results()
    pages = check.read_pages()
    assert check.problems(pages) == []
    assert {m[1] for text in pages.values() for m in check.BLOCK.findall(text)} == set(check.ARTIFACTS)


def test_the_check_can_fail():
    check = _check_results()
    pages = check.read_pages()
    page = "docs/benchmarks.md"
    tampered = check.BLOCK.sub(lambda m: m.group(1) + m.group(3).replace("|", "| ", 1) + m.group(4)
                               if m.group(2) == "make_run" else m.group(0), pages[page])   # one changed cell
    assert tampered != pages[page]
    assert any(f"{page}'s 'make_run' block differs" in p for p in check.problems({**pages, page: tampered}))
    dropped = {name: check.BLOCK.sub(lambda m: "" if m.group(2) == "loss_parity" else m.group(0), text)
               for name, text in pages.items()}
    assert any("no page has the block <!-- results: loss_parity -->" in p for p in check.problems(dropped))
