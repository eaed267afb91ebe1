"""Benchmarks and recorded experiments, one folder each; run from the repository root as
`python -m experiments.<folder>.<script>` (they import the installed `lingpack`)."""
