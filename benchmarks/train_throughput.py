"""Training-step throughput: this library against what users would pick instead.

Implementations, each measured in its own process (a Keras backend is fixed per process),
alternated, over two rounds:

* `ours-<backend>`: `kt.models.Transformer` with `model.train_on_batch` (XLA on JAX and
  TensorFlow, eager on PyTorch: `jit_compile=True` trains eagerly there, see
  `Transformer.compile`), with `keras_transformer.optimizers.Adam`, the optimizer
  `keras-transformer train` uses;
* `kerashub-<backend>`: KerasHub's `TransformerEncoder` / `TransformerDecoder` with
  `TokenAndPositionEmbedding`, same sizes (needs the `bench` extra: `keras-hub`);
* `keras-mha-<backend>`: a plain Keras encoder-decoder built from
  `keras.layers.MultiHeadAttention`, `LayerNormalization` and `Dense`;
* `torch-eager`, `torch-compile`: `torch.nn.Transformer`, eager and under `torch.compile`
  (on the GPU when there is one; bf16 autocast under `--dtype-policy mixed_bfloat16`).

Work (`--work small`, the default): 3 + 3 layers, d_model 256, 4 heads, d_ff 1024, shared
vocabulary 8000, batch 32 x 32 source and target tokens, dropout 0.1, Adam.
`--work base`: the paper's base model (6 + 6, 512, 8 heads, 2048) at batch 8 x 32.
`--batch` sets the sentence pairs per step of either (a GPU wants hundreds).

Throughput = target tokens per step / median step time over `--steps` steps after
`--warmup` steps. Model FLOP utilisation (MFU) = 6 x N x target tokens per second /
measured fp32 matmul peak, where N counts the parameters outside the token and position
tables plus the output projection (vocab x d_model, tied or not); the peak is the best of
numpy, torch and JAX square float32 matmuls measured in the same run. Nothing is
asserted; the script prints a table and writes benchmarks/results/train_throughput.json.

    python benchmarks/train_throughput.py [--only ours-jax torch-eager ...] [--work base]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).parent
WORKS = {
    "small": dict(layers=3, d_model=256, heads=4, d_ff=1024, vocab=8000, batch=32, length=32, dropout=0.1),
    "base": dict(layers=6, d_model=512, heads=8, d_ff=2048, vocab=8000, batch=8, length=32, dropout=0.1),
}
IMPLEMENTATIONS = {  # name -> (backend, builder)
    **{f"ours-{b}": (b, "ours") for b in ("jax", "tensorflow", "torch")},
    **{f"kerashub-{b}": (b, "kerashub") for b in ("jax", "tensorflow", "torch")},
    **{f"keras-mha-{b}": (b, "keras_mha") for b in ("jax", "tensorflow", "torch")},
    "torch-eager": ("torch", "torch_eager"),
    "torch-compile": ("torch", "torch_compile"),
}


def batch(w, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    shape = (w["batch"], w["length"])
    return (rng.integers(4, w["vocab"], size=shape).astype("int32"),
            rng.integers(4, w["vocab"], size=shape).astype("int32"),
            rng.integers(4, w["vocab"], size=shape).astype("int32"))


# ---------------------------------------------------------------- Keras implementations
def keras_model(kind, w):
    import keras

    if kind == "ours":
        import keras_transformer as kt

        return kt.models.Transformer(vocab_size=w["vocab"], num_layers=w["layers"], d_model=w["d_model"],
                                     num_heads=w["heads"], d_ff=w["d_ff"], dropout=w["dropout"])
    source = keras.Input((w["length"],), dtype="int32", name="source_ids")
    target = keras.Input((w["length"],), dtype="int32", name="target_ids")
    if kind == "kerashub":
        import keras_hub

        embed = keras_hub.layers.TokenAndPositionEmbedding(w["vocab"], w["length"], w["d_model"])
        x, y = embed(source), embed(target)
        for _ in range(w["layers"]):
            x = keras_hub.layers.TransformerEncoder(w["d_ff"], w["heads"], dropout=w["dropout"])(x)
        for _ in range(w["layers"]):
            y = keras_hub.layers.TransformerDecoder(w["d_ff"], w["heads"], dropout=w["dropout"])(y, x)
    else:  # plain keras.layers.MultiHeadAttention, post-norm as in the paper
        class AddPositions(keras.layers.Layer):  # a learned position table, as KerasHub's
            def build(self, shape):
                self.embeddings = self.add_weight((shape[1], shape[2]), name="embeddings")

            def call(self, x):
                return x + self.embeddings

        embed = keras.layers.Embedding(w["vocab"], w["d_model"])
        x, y = AddPositions()(embed(source)), AddPositions()(embed(target))

        def sublayer(x, out):
            return keras.layers.LayerNormalization()(x + keras.layers.Dropout(w["dropout"])(out))

        def ffn(x):
            return keras.layers.Dense(w["d_model"])(keras.layers.Dense(w["d_ff"], activation="relu")(x))

        def mha():
            return keras.layers.MultiHeadAttention(w["heads"], w["d_model"] // w["heads"])

        for _ in range(w["layers"]):
            x = sublayer(x, mha()(x, x))
            x = sublayer(x, ffn(x))
        for _ in range(w["layers"]):
            y = sublayer(y, mha()(y, y, use_causal_mask=True))
            y = sublayer(y, mha()(y, x))
            y = sublayer(y, ffn(y))
    logits = keras.layers.Dense(w["vocab"])(y)
    return keras.Model({"source_ids": source, "target_ids": target}, logits)


def measure_keras(kind, w, args):
    import keras

    keras.config.set_dtype_policy(args.dtype_policy)
    keras.utils.set_random_seed(0)
    model = keras_model(kind, w)
    # Ours trains with the library's Adam (one fused update kernel on PyTorch); the others with Keras'.
    if kind == "ours":
        import keras_transformer as kt

        optimizer = kt.optimizers.Adam(1e-4)
    else:
        optimizer = keras.optimizers.Adam(1e-4)
    model.compile(optimizer=optimizer, jit_compile=args.child.endswith("-compile") or "auto",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    source, target, labels = batch(w)
    x = {"source_ids": source, "target_ids": target}
    for _ in range(args.warmup):
        model.train_on_batch(x, labels)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        float(model.train_on_batch(x, labels))  # a Python float: waits for the step
        times.append(time.perf_counter() - t)
    return times, non_embedding_parameters(model, tied_output=kind == "ours")


def non_embedding_parameters(model, tied_output: bool):
    """Parameters outside the token and position tables, plus the output projection
    (vocab x d_model) when it is the tied embedding: every implementation does that matmul."""
    n = sum(math.prod(v.shape) for v in model.trainable_variables if "embedding" not in v.path)
    if tied_output:
        n += model.get_layer("embedding").embeddings.shape[0] * model.d_model
    return int(n)


# ---------------------------------------------------------------- torch.nn.Transformer
def measure_torch(kind, w, args):
    import torch

    torch.manual_seed(0)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(w["vocab"], w["d_model"])
            position = torch.arange(w["length"])[:, None] / 10000 ** (torch.arange(0, w["d_model"], 2) / w["d_model"])
            pe = torch.stack([position.sin(), position.cos()], -1).reshape(w["length"], w["d_model"])
            self.register_buffer("pe", pe)
            self.transformer = torch.nn.Transformer(w["d_model"], w["heads"], w["layers"], w["layers"], w["d_ff"],
                                                    w["dropout"], batch_first=True)
            self.mask = torch.nn.Transformer.generate_square_subsequent_mask(w["length"])

        def forward(self, source, target):
            scale = math.sqrt(w["d_model"])
            out = self.transformer(self.embed(source) * scale + self.pe, self.embed(target) * scale + self.pe,
                                   tgt_mask=self.mask, tgt_is_causal=True)
            return out @ self.embed.weight.T  # tied output projection

    # The GPU when there is one, like Keras' default device; bf16 autocast when the Keras
    # rows run under mixed_bfloat16.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Model().to(device)
    model.mask = model.mask.to(device)
    optimizer = torch.optim.Adam(model.parameters(), 1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    source, target, labels = (torch.as_tensor(a, dtype=torch.long, device=device) for a in batch(w))
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=args.dtype_policy == "mixed_bfloat16")

    def step():
        optimizer.zero_grad()
        with autocast:
            logits = model(source, target)
        loss = loss_fn(logits.float().reshape(-1, w["vocab"]), labels.reshape(-1))
        loss.backward()
        optimizer.step()
        return loss

    if kind == "torch_compile":
        step = torch.compile(step)
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        float(step())
        times.append(time.perf_counter() - t)
    # Non-embedding parameters plus the tied output projection (vocab x d_model).
    params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embed"))
    params += w["vocab"] * w["d_model"]
    return times, int(params)


def matmul_peak(size=2048, repeats=5, dtype="float32"):
    """Best GFLOP/s of a square matmul from numpy (float32 only), torch and JAX, on the
    default device of each (a GPU when there is one)."""
    import numpy as np

    results = {}
    a = np.random.default_rng(0).normal(size=(size, size)).astype("float32")
    candidates = {"numpy": lambda: a @ a} if dtype == "float32" else {}
    try:
        import torch

        ta = torch.from_numpy(a).to("cuda" if torch.cuda.is_available() else "cpu", getattr(torch, dtype))

        def torch_mm():
            out = ta @ ta
            if out.is_cuda:
                torch.cuda.synchronize()

        candidates["torch"] = torch_mm
    except ImportError:
        pass
    try:
        import jax

        j = jax.numpy.asarray(a, dtype=dtype)
        mm = jax.jit(lambda x: x @ x)
        candidates["jax"] = lambda: mm(j).block_until_ready()
    except ImportError:
        pass
    for name, fn in candidates.items():
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        results[name] = 2 * size**3 / statistics.median(times) / 1e9
    return results


def child(args):
    name = args.child
    backend, kind = IMPLEMENTATIONS[name]
    w = sizes(args)
    if kind.startswith("torch"):
        times, params = measure_torch(kind, w, args)
    else:
        times, params = measure_keras(kind, w, args)
    median = statistics.median(times)
    tokens = w["batch"] * w["length"]
    print(json.dumps({"name": name, "median_step_seconds": median, "tokens_per_second": tokens / median,
                      "non_embedding_parameters": params, "steps": len(times)}))


def sizes(args) -> dict:
    """The work's sizes, with `--batch` in place of its batch size when given."""
    return dict(WORKS[args.work], **({"batch": args.batch} if args.batch else {}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=sorted(IMPLEMENTATIONS), help="Measure only these.")
    parser.add_argument("--work", choices=sorted(WORKS), default="small")
    parser.add_argument("--batch", type=int, help="Sentence pairs per step, in place of the work's (a GPU wants more).")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", default=str(HERE / "results" / "train_throughput.json"))
    parser.add_argument("--dtype-policy", default="float32",
                        help="Keras dtype policy of the Keras implementations, e.g. mixed_bfloat16 on a GPU.")
    parser.add_argument("--matmul-dtype", default="float32", help="dtype of the peak matmul (torch and JAX).")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    names = args.only or list(IMPLEMENTATIONS)
    rounds = {name: [] for name in names}
    errors = {}
    peaks = []
    for r in range(args.rounds):
        peaks.append(matmul_peak(size=8192 if args.matmul_dtype != "float32" else 2048, dtype=args.matmul_dtype))
        print(f"round {r + 1}: {args.matmul_dtype} matmul GFLOP/s " + ", ".join(f"{k} {v:.0f}" for k, v in peaks[-1].items()),
              flush=True)
        for name in (names if r % 2 == 0 else names[::-1]):  # alternate the order
            backend = IMPLEMENTATIONS[name][0]
            env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
            cmd = [sys.executable, __file__, "--child", name, "--work", args.work, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--dtype-policy", args.dtype_policy]
            if args.batch:
                cmd += ["--batch", str(args.batch)]
            result = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=HERE.parent)
            if result.returncode != 0:
                errors[name] = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"
                print(f"  {name}: FAILED ({errors[name]})", flush=True)
                continue
            rounds[name].append(json.loads(result.stdout.strip().splitlines()[-1]))
            print(f"  {name}: {rounds[name][-1]['tokens_per_second']:.0f} tokens/s", flush=True)
    peak = max(max(p.values()) for p in peaks)
    w = sizes(args)
    rows = []
    for name, runs in rounds.items():
        if not runs:
            continue
        best = max(r["tokens_per_second"] for r in runs)
        flops = 6 * runs[0]["non_embedding_parameters"] * best
        rows.append({"name": name, "tokens_per_second": best, "rounds": [r["tokens_per_second"] for r in runs],
                     "non_embedding_parameters": runs[0]["non_embedding_parameters"],
                     "gflops": flops / 1e9, "mfu": flops / (peak * 1e9)})
    rows.sort(key=lambda r: -r["tokens_per_second"])
    fastest_other = max((r["tokens_per_second"] for r in rows if not r["name"].startswith("ours")), default=None)
    print(f"\nwork {args.work}: {w}; {args.matmul_dtype} matmul peak {peak:.0f} GFLOP/s; MFU = 6 x N x tokens/s / peak")
    print("| implementation | target tokens/s (best round) | rounds | N (non-embedding) | GFLOP/s | MFU |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['tokens_per_second']:.0f} | {', '.join(f'{t:.0f}' for t in r['rounds'])} "
              f"| {r['non_embedding_parameters']:,} | {r['gflops']:.1f} | {100 * r['mfu']:.1f}% |")
    ours = [r for r in rows if r["name"].startswith("ours")]
    if ours and fastest_other:
        print(f"\nours (best backend) / fastest other: {ours[0]['tokens_per_second'] / fastest_other:.2f}x")
    for b in ("jax", "tensorflow", "torch"):
        o = next((r for r in rows if r["name"] == f"ours-{b}"), None)
        h = next((r for r in rows if r["name"] == f"kerashub-{b}"), None)
        if o and h:
            print(f"ours / KerasHub on {b}: {o['tokens_per_second'] / h['tokens_per_second']:.2f}x")
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"work": args.work, "sizes": w, "matmul_gflops": peaks, "peak_gflops": peak,
                               "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                               "results": rows, "errors": errors}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
