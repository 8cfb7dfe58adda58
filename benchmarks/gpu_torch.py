"""PyTorch on a GPU: the library's Adam and the compiled search, against eager.

Checks, on the first CUDA device (or `--device cpu` to try the script anywhere):

* `keras_transformer.optimizers.Adam` (PyTorch's fused Adam, step counts on the
  parameters' device) against `keras.optimizers.Adam` over 10 steps: largest difference;
* `translate` compiled (exported programs), with `compile="torch.compile"` (Inductor) and eagerly (`compile=False`): same tokens, and tokens/s (medians of 3).

Prints and writes JSON; asserts nothing.

    KERAS_BACKEND=torch python benchmarks/gpu_torch.py [--device cuda] [--preset small]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics

from timing import first_then_repeats, search_warmups

HERE = pathlib.Path(__file__).parent


def adam_difference(device: str) -> float:
    import keras
    import numpy as np

    import keras_transformer as kt

    def run(optimizer):
        rng = np.random.default_rng(0)
        with keras.device(device):
            variables = [keras.Variable(rng.normal(size=s).astype("float32")) for s in ((64, 32), (32,), (8, 4, 2))]
            optimizer.build(variables)
            for step in range(10):
                grads = [keras.ops.convert_to_tensor(rng.normal(size=v.shape).astype("float32") * 10.0 ** -(step % 4))
                         for v in variables]
                optimizer.apply(grads, variables)
        return [keras.ops.convert_to_numpy(v) for v in variables]

    schedule = kt.schedules.TransformerSchedule(64, warmup_steps=4)
    ours = run(kt.schedules.transformer_optimizer(64, warmup_steps=4))
    reference = run(keras.optimizers.Adam(schedule, beta_1=0.9, beta_2=0.98, epsilon=1e-9))
    return float(max(abs(a - b).max() for a, b in zip(ours, reference)))


def decoding(device: str, preset: str) -> dict:
    import keras
    import numpy as np

    import keras_transformer as kt

    keras.utils.set_random_seed(0)
    with keras.device(device):
        model = kt.models.Transformer.from_preset(preset, vocab_size=8000, dropout=0.0)
        model.build()
        source = keras.ops.convert_to_tensor(np.random.default_rng(0).integers(4, 8000, (16, 20)).astype("int32"))
        n, results = 40, {}
        for beam in (1, 4):
            outputs = {}
            for mode in (True, "torch.compile", False):
                def run():
                    return keras.ops.convert_to_numpy(model.translate(source, beam, max_length=n, min_length=n,
                                                                      compile=mode))
                outputs[str(mode)], first, times = first_then_repeats(run, 3, search_warmups(mode))
                results[f"beam{beam}_{mode}"] = {"tokens_per_second": round(16 * n / statistics.median(times), 1),
                                                 "first_run_seconds": round(first, 2)}
            results[f"beam{beam}_same_tokens"] = all(np.array_equal(o, outputs["False"]) for o in outputs.values())
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--output", default=str(HERE / "results" / "gpu_torch.json"))
    args = parser.parse_args()
    if os.environ.get("KERAS_BACKEND") != "torch":
        parser.error("run with KERAS_BACKEND=torch")
    device = f"{args.device}:0" if args.device == "cuda" else args.device
    report = {"device": device, "adam_max_abs_difference": adam_difference(device),
              "decoding": decoding(device, args.preset)}
    print(json.dumps(report, indent=2))
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
