"""What Keras' int8 quantization does to a trained run's SavedModel: size and speed.

Exports the run twice with `keras_transformer.tools.export.export_translator`, from the
saved float32 model and from the same model after `model.quantize("int8")`
(`evaluation.quantize_model`), loads each SavedModel with plain TensorFlow and times its
`translate` signature on the first `--sentences` sources of the run's test split (beam
4, batches of `--batch-size`; median of `--repeats` passes after one warm-up pass). It
also counts how many of those translations the two SavedModels agree on. BLEU is
`benchmarks/real_text.py --engines keras-int8`'s job. Nothing is asserted; writes JSON.

    KERAS_BACKEND=tensorflow python benchmarks/quantize.py --run-dir runs/tatoeba-de-en
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile
import time

from timing import first_then_repeats

HERE = pathlib.Path(__file__).parent


def directory_bytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--sentences", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", default=str(HERE / "results" / "quantize.json"))
    args = p.parse_args(argv)

    import keras
    import tensorflow as tf
    import tensorflow_text  # noqa: F401 - the SavedModel's tokenizer ops

    from keras_transformer.tools import evaluation
    from keras_transformer.tools.config import TrainConfig
    from keras_transformer.tools.export import export_translator
    from keras_transformer.tools.run_setup import load_corpus

    if keras.backend.backend() != "tensorflow":
        raise SystemExit("Run with KERAS_BACKEND=tensorflow: the SavedModel is exported in this process.")
    run = pathlib.Path(args.run_dir)
    config = TrainConfig(**json.loads((run / "config.json").read_text(encoding="utf-8")))
    sources = [s for s, _ in load_corpus(config).test[: args.sentences]]
    report = {"run_dir": str(run), "sentences": len(sources), "batch_size": args.batch_size, "beam_size": 4,
              "cpu_count": os.cpu_count(), "savedmodel": {}}
    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, quantize in (("float32", None), ("int8", "int8")):
            model, tokenizer = evaluation.load_run(run, quantize=quantize)
            path = pathlib.Path(tmp) / name
            t = time.perf_counter()
            export_translator(model, tokenizer, path, beam_size=4)
            export_seconds = time.perf_counter() - t
            translate = tf.saved_model.load(str(path)).signatures["translate"]

            def run_all():
                lines = []
                for start in range(0, len(sources), args.batch_size):
                    batch = tf.constant(sources[start : start + args.batch_size])
                    lines += [x.decode("utf-8") for x in translate(texts=batch)["translation"].numpy()]
                return lines

            outputs[name], first, times = first_then_repeats(run_all, args.repeats)
            median = statistics.median(times)
            report["savedmodel"][name] = {
                "bytes": directory_bytes(path), "variables_bytes": directory_bytes(path / "variables"),
                "export_seconds": round(export_seconds, 1), "first_pass_seconds": round(first, 2),
                "median_seconds": round(median, 2), "sentences_per_second": round(len(sources) / median, 1),
                "times": [round(x, 2) for x in times],
            }
            print(name, report["savedmodel"][name], flush=True)
    f32, i8 = report["savedmodel"]["float32"], report["savedmodel"]["int8"]
    report["int8_size_ratio"] = round(i8["bytes"] / f32["bytes"], 3)
    report["int8_speedup"] = round(f32["median_seconds"] / i8["median_seconds"], 2)
    report["same_translations"] = sum(a == b for a, b in zip(outputs["float32"], outputs["int8"]))
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "savedmodel"}), f"wrote {out}", flush=True)
    return report


if __name__ == "__main__":
    main()
