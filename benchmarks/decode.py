"""Decoding speed: greedy and beam search, with and without the KV cache, per backend.

Each backend runs in its own process (a Keras backend is fixed per process). The model
is the `tiny` preset with random weights; `[END]` is forbidden before the last step
(`min_length`), so every run produces exactly `--output-tokens` tokens per sentence.
Times are medians of `--repeats` runs after one warm-up run (which compiles). Nothing
is asserted: the script prints a table and writes JSON.

    python benchmarks/decode.py [--backends jax tensorflow torch] [--output-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).parent


def measure(args) -> dict:
    """Run inside one backend's process."""
    import keras
    import numpy as np

    import keras_transformer as kt

    keras.utils.set_random_seed(0)
    model = kt.models.Transformer.from_preset("tiny", vocab_size=args.vocab_size, dropout=0.0)
    model.build()
    rng = np.random.default_rng(0)
    source = rng.integers(4, args.vocab_size, size=(args.batch, args.source_length)).astype("int32")
    n = args.output_tokens
    results = {}
    for search in ("greedy", "beam"):
        for use_cache in (True, False):
            beam_size = 1 if search == "greedy" else args.beam_size

            def run():
                return model.translate(source, beam_size, max_length=n, min_length=n, use_cache=use_cache)
            t = time.perf_counter()
            out = keras.ops.convert_to_numpy(run())  # warm-up: compiles
            compile_seconds = time.perf_counter() - t
            assert out.shape == (args.batch, n)
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                keras.ops.convert_to_numpy(run())
                times.append(time.perf_counter() - t)
            median = statistics.median(times)
            results[f"{search}_{'cached' if use_cache else 'uncached'}"] = {
                "median_seconds": round(median, 4),
                "tokens_per_second": round(args.batch * n / median, 1),
                "first_run_seconds": round(compile_seconds, 2),
                "times": [round(x, 4) for x in times],
            }
    for search in ("greedy", "beam"):
        results[f"{search}_cache_speedup"] = round(
            results[f"{search}_cached"]["tokens_per_second"] / results[f"{search}_uncached"]["tokens_per_second"], 2
        )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["jax", "tensorflow", "torch"])
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--source-length", type=int, default=16)
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=str(HERE / "results" / "decode.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    report = {"settings": {k: v for k, v in vars(args).items() if k not in ("child", "output", "backends")},
              "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
              "backends": {}}
    argv = [a for a in sys.argv[1:]]
    for backend in args.backends:
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        result = subprocess.run([sys.executable, __file__, "--child", *argv], env=env, capture_output=True, text=True)
        if result.returncode != 0:
            print(f"{backend}: failed\n{result.stderr[-2000:]}", file=sys.stderr)
            report["backends"][backend] = {"error": result.stderr[-2000:]}
            continue
        report["backends"][backend] = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"tokens/s, {args.batch} sentences x {args.output_tokens} output tokens, beam {args.beam_size} "
          f"(median of {args.repeats})")
    print(f"{'backend':<11}{'greedy cached':>15}{'uncached':>10}{'speedup':>9}{'beam cached':>13}{'uncached':>10}{'speedup':>9}")
    for backend, r in report["backends"].items():
        if "error" in r:
            print(f"{backend:<11} failed")
            continue
        print(f"{backend:<11}{r['greedy_cached']['tokens_per_second']:>15.0f}{r['greedy_uncached']['tokens_per_second']:>10.0f}"
              f"{r['greedy_cache_speedup']:>8.1f}x{r['beam_cached']['tokens_per_second']:>13.0f}"
              f"{r['beam_uncached']['tokens_per_second']:>10.0f}{r['beam_cache_speedup']:>8.1f}x")
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
