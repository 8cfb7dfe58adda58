"""One process against several: the same `keras-transformer train` on the numbers corpus,
then greedy held-out exact match, BLEU and wall time, per backend.

For each backend, one run in one process and one run with `keras-transformer launch
--processes N` (the same flags, so the same global batches), one after the other, then
`keras-transformer evaluate --beam-size 1` on each run's test split. On a machine with
fewer cores than processes expect no speed-up: the point is that the several-process
path reaches what one process reaches. Nothing is asserted; the script prints a table and
writes benchmarks/results/multi_process.json.

    python benchmarks/multi_process.py [--backends jax torch tensorflow] [--steps 400] [--processes 2]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHILD = "import sys, keras_transformer_cli; sys.exit(keras_transformer_cli.main(sys.argv[1:]))"
# The demo's recipe for the numbers corpus (see `keras-transformer demo`), without its early stop.
RECIPE = ["--preset", "tiny", "--tokenizer", "wordpiece", "--learning-rate-scale", "0.25", "--warmup-steps", "100",
          "--dropout", "0", "--average-checkpoints", "1", "--quiet"]


def command(backend: str, argv: list[str]) -> tuple[float, str]:
    """Run `keras-transformer ARGV` with KERAS_BACKEND=backend: (seconds, stdout)."""
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    start = time.time()
    result = subprocess.run([sys.executable, "-c", CHILD, *argv], env=env, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{backend} {' '.join(argv)}: status {result.returncode}\n{result.stderr[-3000:]}")
    return time.time() - start, result.stdout


def scores(text: str) -> dict:
    """BLEU, chrF and exact match from `evaluate`'s output."""
    found = {}
    for name, pattern in (("bleu", r"^BLEU ([\d.]+) "), ("chrf", r" chrF ([\d.]+) "),
                          ("exact_match", r" exact match ([\d.]+)% ")):
        match = re.search(pattern, text, re.MULTILINE)
        found[name] = float(match.group(1)) if match else None
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["jax", "torch", "tensorflow"])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    flags = [*RECIPE, "--steps", str(args.steps), "--steps-per-epoch", str(min(100, args.steps))]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kt-multi-process-") as scratch:
        for backend in args.backends:
            for processes in (1, args.processes):
                run = pathlib.Path(scratch) / f"{backend}-{processes}"
                train = ["train", "--output-dir", str(run), *flags]
                argv = train if processes == 1 else ["launch", "--processes", str(processes), "--", *train]
                train_seconds, _ = command(backend, argv)
                _, report = command(backend, ["evaluate", "--run-dir", str(run), "--beam-size", "1"])
                metrics = json.loads((run / "metrics.json").read_text())
                row = {"backend": backend, "processes": processes, "steps": metrics["steps"],
                       "wall_seconds": round(train_seconds, 1), "test_loss": round(metrics["test_loss"], 4),
                       **scores(report)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| backend | processes | steps | wall s | test loss | greedy exact match % | chrF |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['processes']} | {r['steps']} | {r['wall_seconds']} | {r['test_loss']} | "
              f"{r['exact_match']} | {r['chrf']} |")
    out = ROOT / "benchmarks" / "results" / "multi_process.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": args.steps, "processes": args.processes, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
