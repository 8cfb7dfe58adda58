"""`python -m claims`: Table 1, then the design notes, with the same flags."""

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from claims import notes, table1  # noqa: E402

if __name__ == "__main__":
    sys.exit(table1.main(sys.argv[1:]) or notes.main(sys.argv[1:]))
