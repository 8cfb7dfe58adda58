"""The paper's Table 1 and design notes, measured.

    python benchmarks/table1.py [--quick] [--output-dir DIR]

Runs `keras-transformer table1` and then `keras-transformer design-notes` with the same
flags, on JAX unless KERAS_BACKEND says otherwise: peak memory and sequential operations
are read from XLA's compiled program and the traced jaxpr, which only JAX exposes.
Writes table1.md/json, notes.md/json and PNG plots (default: benchmarks/results/claims/).
"""

import os
import pathlib
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from keras_transformer.claims import notes, table1  # noqa: E402

if __name__ == "__main__":
    arguments = ["--output-dir", str(pathlib.Path(__file__).parent / "results" / "claims")] + sys.argv[1:]
    sys.exit(table1.main(arguments) or notes.main(arguments))
