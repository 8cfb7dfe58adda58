"""Measurements of the paper's claims: Table 1 and the design notes.

Research code beside the library, not part of the installed package: run it from a
checkout of the repository, on JAX unless `KERAS_BACKEND` says otherwise (peak memory
and sequential operations are read from XLA's compiled program and the traced jaxpr,
which only JAX exposes):

    python -m claims [--quick] [--output-dir DIR]   # Table 1, then the design notes
    python -m claims.table1 --help
    python -m claims.notes --help

Each writes `<name>.md`, `<name>.json` and PNG plots (default: benchmarks/results/claims/).
"""
