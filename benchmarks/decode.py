"""Decoding speed: greedy and beam search, with and without the KV cache, per backend.

Each backend runs in its own process (a Keras backend is fixed per process); each
process after the first starts `--pause` seconds after the one before it ended. The model
is a preset (`--preset`, `tiny` by default) with random weights; `[END]` is forbidden before the last step
(`min_length`), so every run produces exactly `--output-tokens` tokens per sentence.
Times are medians of `--repeats` runs after the warm-up runs that compile (one; two
for PyTorch's compiled searches, whose first search of a shape runs eagerly). Every
backend also runs the same search eagerly (`translate(..., compile=False)`, one run),
a copy after Keras' `model.quantize("int8")` (column `int8`, compiled, cached),
and PyTorch also with `compile="torch.compile"` (the exported programs through
`torch.compile`; its second run includes seconds of compilation). Nothing is asserted:
the script prints a table and writes JSON.

On a small shared machine a backend's figure can move by half between two processes a
few minutes apart, enough to turn a ratio between backends around. `--rounds R` runs the
backends' processes R times in turn (jax, torch, jax, torch, ...): each figure is then
the median of the rounds' medians, and the JSON keeps each round's. `--variants cached`
measures only the compiled, cached search (a round in a fraction of the time), and each
backend's row is also given as a ratio to JAX's when JAX runs.

`--backends ctranslate2` (with the `ctranslate2` extra) converts the same model (built
with the seed on PyTorch) with `keras_transformer.tools.ctranslate2_export.convert_model`
and times CTranslate2's `translate_batch` on the same inputs, float32 and int8, with
`min_decoding_length` and `max_decoding_length` both the output length, with one
thread and with every core (`intra_threads`); the faster of the two is its row.

    python benchmarks/decode.py [--backends jax tensorflow torch ctranslate2] [--preset small]
                                [--rounds 3 --variants cached torch_compile]
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

from timing import first_then_repeats, search_warmups

HERE = pathlib.Path(__file__).parent
VARIANTS = ("cached", "uncached", "eager", "int8", "torch_compile")
# PAUSE_WHY: on the 2-core virtual machine this is developed on, a process started right
# after another freed gigabytes of memory ran slower for a while: PyTorch's
# `compile="torch.compile"` greedy search made 11,800 and 13,971 tokens/s just after a
# process had filled and freed 3 GB, 16,280 and 16,844 when started 45 s later; in runs of
# this script the backend measured after JAX's process lost 20-30% that way. Each backend
# after the first waits `--pause` seconds, so that the rows compare the backends and not
# their order.


def measure(args) -> dict:
    """Run inside one backend's process."""
    import keras
    import numpy as np

    import keras_transformer as kt
    from keras_transformer.tools.evaluation import quantize_model

    keras.utils.set_random_seed(0)
    model = kt.models.Transformer.from_preset(args.preset, vocab_size=args.vocab_size, dropout=0.0)
    model.build()
    rng = np.random.default_rng(0)
    source = rng.integers(4, args.vocab_size, size=(args.batch, args.source_length)).astype("int32")
    n = args.output_tokens
    if args.engine == "ctranslate2":
        return measure_ctranslate2(args, model, source)
    # The same weights after Keras' `model.quantize("int8")` (Dense kernels int8, per output channel).
    quantized = None
    if "int8" in args.variants:
        quantized = kt.models.Transformer.from_preset(args.preset, vocab_size=args.vocab_size, dropout=0.0)
        quantized.build()
        quantized.set_weights(model.get_weights())
        quantize_model(quantized, "int8")
    results = {}
    variants = [("cached", model, True, True), ("uncached", model, False, True), ("eager", model, True, False),
                ("int8", quantized, True, True)]
    if keras.backend.backend() == "torch":
        variants.append(("torch_compile", model, True, "torch.compile"))
    variants = [v for v in variants if v[0] in args.variants]
    for search in ("greedy", "beam"):
        for variant, searcher, use_cache, compile in variants:
            beam_size = 1 if search == "greedy" else args.beam_size

            def run():
                return keras.ops.convert_to_numpy(searcher.translate(
                    source, beam_size, max_length=n, min_length=n, use_cache=use_cache, compile=compile))
            repeats = 1 if variant == "eager" else args.repeats
            out, compile_seconds, times = first_then_repeats(run, repeats, search_warmups(compile))
            assert out.shape == (args.batch, n)
            median = statistics.median(times)
            results[f"{search}_{variant}"] = {
                "median_seconds": round(median, 4),
                "tokens_per_second": round(args.batch * n / median, 1),
                "first_run_seconds": round(compile_seconds, 2),
                "times": [round(x, 4) for x in times],
            }
    return results


def add_ratios(results: dict) -> dict:
    """`results` with the cache's speed-up and the compiled search's over eager, where
    the variants they compare were measured."""
    for search in ("greedy", "beam"):
        speed = {variant: results.get(f"{search}_{variant}", {}).get("tokens_per_second")
                 for variant in ("cached", "uncached", "eager")}
        for name, other in (("cache_speedup", "uncached"), ("compiled_vs_eager", "eager")):
            if speed["cached"] and speed[other]:
                results[f"{search}_{name}"] = round(speed["cached"] / speed[other], 2)
    return results


def over_rounds(rounds: list[dict]) -> dict:
    """One backend's results of several rounds: each figure the median of the rounds'
    (each round's tokens/s kept in `rounds`)."""
    if len(rounds) == 1:
        return rounds[0]
    merged = {}
    for key, first in rounds[0].items():
        if not isinstance(first, dict):
            continue
        merged[key] = {name: round(statistics.median(r[key][name] for r in rounds), 4)
                       for name, value in first.items() if isinstance(value, (int, float))}
        merged[key]["rounds"] = [r[key]["tokens_per_second"] for r in rounds]
    return merged


def measure_ctranslate2(args, model, source) -> dict:
    """CTranslate2 on the same model and inputs, float32 and int8 (`compute_type`)."""
    import tempfile

    import ctranslate2

    from keras_transformer.tools.ctranslate2_export import convert_model

    vocabulary = ["[PAD]", "[UNK]", "[START]", "[END]"] + [f"t{i}" for i in range(4, args.vocab_size)]
    directory = tempfile.mkdtemp(prefix="kt-decode-ct2-")
    convert_model(model, vocabulary, directory)
    pieces = [[vocabulary[i] for i in row] for row in source.tolist()]
    n, results = args.output_tokens, {}
    # One thread and every core, each timed: on a small machine one thread can be the
    # faster (its threads then do not wait on each other); the faster is the row.
    threads = sorted({1, os.cpu_count() or 1})
    for compute_type in ("float32", "int8"):
        translators = {t: ctranslate2.Translator(directory, device="cpu", compute_type=compute_type, intra_threads=t)
                       for t in threads}
        for search, beam_size in (("greedy", 1), ("beam", args.beam_size)):
            rows = []
            for t, translator in translators.items():
                def run():
                    return translator.translate_batch(pieces, beam_size=beam_size, min_decoding_length=n,
                                                      max_decoding_length=n, length_penalty=1.0)
                out, first, times = first_then_repeats(run, args.repeats)
                assert all(len(r.hypotheses[0]) == n for r in out), [len(r.hypotheses[0]) for r in out]
                median = statistics.median(times)
                rows.append({
                    "median_seconds": round(median, 4), "tokens_per_second": round(args.batch * n / median, 1),
                    "first_run_seconds": round(first, 2), "times": [round(x, 4) for x in times],
                    "intra_threads": t,
                })
            best = max(rows, key=lambda row: row["tokens_per_second"])
            results[f"{search}_{compute_type}"] = {**best, "by_threads": {
                str(row["intra_threads"]): row["tokens_per_second"] for row in rows}}
    return results


def print_table(args, backends: dict) -> None:
    """The report as a table: tokens/s per backend, search and variant, then each
    backend's cached search (and PyTorch's `torch.compile`) over JAX's."""
    print(f"tokens/s, {args.batch} sentences x {args.output_tokens} output tokens, beam {args.beam_size} "
          f"(median of {args.repeats}" + (f", then of {args.rounds} rounds)" if args.rounds > 1 else ")"))
    print(f"{'backend':<11}{'search':<8}{'cached':>9}{'uncached':>10}{'eager':>8}{'int8':>8}{'torch.compile':>15}"
          f"{'vs eager':>10}")

    def speed(r, key):
        return r.get(key, {}).get("tokens_per_second")

    for backend, r in backends.items():
        if "error" in r:
            print(f"{backend:<11} failed")
            continue
        if backend == "ctranslate2":
            for search in ("greedy", "beam"):
                f32, i8 = r[f"{search}_float32"], r[f"{search}_int8"]
                print(f"{backend:<11}{search:<8}{f32['tokens_per_second']:>9.0f}   ({f32['intra_threads']:.0f} "
                      f"thread(s); int8: {i8['tokens_per_second']:.0f}, {i8['intra_threads']:.0f} thread(s))")
            continue
        for search in ("greedy", "beam"):
            cells = [speed(r, f"{search}_{variant}") for variant in VARIANTS]
            vs_eager = r.get(f"{search}_compiled_vs_eager")
            print(f"{backend:<11}{search:<8}" + "".join(
                f"{'-' if value is None else f'{value:.0f}':>{width}}" for value, width in zip(cells, (9, 10, 8, 8, 15)))
                + f"{'-' if vs_eager is None else f'{vs_eager:.1f}x':>10}")
    jax = backends.get("jax", {})
    for backend, r in backends.items():
        if backend in ("jax", "ctranslate2") or "error" in r or "error" in jax:
            continue
        for variant in ("cached", "torch_compile"):
            ratios = [(search, speed(r, f"{search}_{variant}"), speed(jax, f"{search}_cached"))
                      for search in ("greedy", "beam")]
            said = [f"{search} {mine / theirs:.2f}x" for search, mine, theirs in ratios if mine and theirs]
            if said:
                print(f"{backend} {variant} over jax cached: " + ", ".join(said))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["jax", "tensorflow", "torch"],
                        help="Keras backends, and `ctranslate2` for CTranslate2 on the same model.")
    parser.add_argument("--preset", default="tiny", help="The model's size: a Transformer preset.")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--source-length", type=int, default=16)
    parser.add_argument("--beam-size", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1,
                        help="Run the backends' processes this many times in turn; each figure is the median of the "
                        "rounds' medians.")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="The searches measured (torch_compile on PyTorch only).")
    parser.add_argument("--pause", type=float, default=30.0,
                        help="Seconds between one backend's process and the next: on a small virtual machine a "
                        "process started right after another freed gigabytes of memory ran 20-30%% slower.")
    parser.add_argument("--output", default=str(HERE / "results" / "decode.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", default="keras", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    report = {"settings": {k: v for k, v in vars(args).items() if k not in ("child", "output", "backends")},
              "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
              "backends": {}}
    argv = [a for a in sys.argv[1:]]
    rounds: dict[str, list] = {backend: [] for backend in args.backends}
    for i, backend in enumerate(args.backends * args.rounds):
        if i:
            time.sleep(args.pause)  # PAUSE_WHY
        engine = "ctranslate2" if backend == "ctranslate2" else "keras"
        env = dict(os.environ, KERAS_BACKEND="torch" if engine == "ctranslate2" else backend, TF_CPP_MIN_LOG_LEVEL="3")
        result = subprocess.run([sys.executable, __file__, "--child", "--engine", engine, *argv], env=env,
                                capture_output=True, text=True)
        if result.returncode != 0:
            print(f"{backend}: failed\n{result.stderr[-2000:]}", file=sys.stderr)
            report["backends"][backend] = {"error": result.stderr[-2000:]}
            continue
        rounds[backend].append(json.loads(result.stdout.strip().splitlines()[-1]))
    for backend, results in rounds.items():
        if results and backend not in report["backends"]:  # a round that failed leaves its error
            report["backends"][backend] = add_ratios(over_rounds(results))
    print_table(args, report["backends"])
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
