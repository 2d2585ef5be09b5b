"""Benchmark the milestones against each other and against Hugging Face transformers.

Run from the repository root:

    python examples/benchmark.py                         # every milestone + transformers, decode and mixed
    python examples/benchmark.py --engines m1,hf --workloads decode --runs 5
    python examples/benchmark.py --engines m2,m2@torch+linear-torch,hf-static --workloads mixed --mixed-runs 3
    python examples/benchmark.py --engines m7,m8,m8@tp3 --workloads small   # m8 in one rank, then in three
    python examples/benchmark.py --docs                  # write the JSON and plot into docs/assets/benchmarks/

--help lists every flag. The code is the package next to this script, examples/bench/
(its __init__.py says what each module does); examples/bench_quickstart.py is the same
idea in forty lines.
"""

import sys

import _common  # noqa: F401  (first: makes `milestones` importable from a plain checkout)
from bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
