"""Results blocks in README.md, docs/ and experiments/ are what their scripts render of the committed artifacts."""
from experiments import check_results


def _check_results():
    return check_results


def test_results_tables_match_their_artifacts():
    check = _check_results()
    pages = check.read_pages()
    assert check.problems(pages) == []
    assert {m[1] for text in pages.values() for m in check.BLOCK.findall(text)} == set(check.renderers())


def test_the_check_can_fail():
    check = _check_results()
    pages = check.read_pages()
    problems = lambda changed: check.problems({**pages, **changed}, stale={})   # staleness: test_results_staleness
    page = "docs/benchmarks.md"
    tampered = check.BLOCK.sub(lambda m: m.group(1) + m.group(3).replace("|", "| ", 1) + m.group(4)
                               if m.group(2) == "make_run" else m.group(0), pages[page])   # one changed cell
    assert tampered != pages[page]
    assert any(f"{page}'s 'make_run' block differs" in p for p in problems({page: tampered}))
    dropped = check.BLOCK.sub(lambda m: "" if m.group(2) == "loss_parity" else m.group(0), pages[page])
    assert any(f"{page} lacks the block <!-- results: loss_parity -->" in p for p in problems({page: dropped}))
    unknown = pages[page] + "\n<!-- results: no_such_benchmark -->\n| x |\n<!-- /results -->\n"
    assert any("'no_such_benchmark' that no artifact renders" in p for p in problems({page: unknown}))
