"""Benchmarks, run from the repository root: `python -m benchmarks.bench_rl ...`.

Each prints a side-by-side table with the command that made it
(docs/performance.md); `gpu.sh` runs them all on a GPU machine, and
`tunix_rl_worker.py` is Tunix's side of `bench_rl`, run by file path in a Tunix
venv (it never imports this package).
"""
