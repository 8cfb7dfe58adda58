"""Shared fixtures and helpers: the same suite runs once per Keras backend."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest


# The C++ log level of TensorFlow and XLA, as CI sets it (`.ci/run`), before anything
# imports them; a user's own setting stays. Unset, the first `import jax` sets it to 1
# (jax/__init__.py), and the commands the tests run in this process (`cli.main`) would
# take that for the user's level and let TensorFlow's "failed call to cuInit" through
# on a machine with CUDA's libraries and no GPU.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _backend():
    """The backend Keras will use, read without importing Keras where the environment names it.

    The xdist controller imports this file but runs no test: it does not import Keras
    (and TensorFlow, ~4 s) before it starts the workers.
    """
    if os.environ.get("KERAS_BACKEND"):  # Keras' own rule: the variable wins over keras.json
        return os.environ["KERAS_BACKEND"]
    import keras

    return keras.backend.backend()


BACKEND = _backend()


_SUITES = {"tensorflow": "TensorFlow", "jax": "JAX", "torch": "PyTorch"}


def only_on(backend: str, why: str):
    """Run a test in one backend's suite: the tool logic it checks (files, flags, stopping
    rules, formatting) is the same code on every backend, and the backend's own part of
    it is checked on every backend elsewhere, which `why` names. Each such test trains or
    starts processes, so running it three times would cost CI minutes for no check."""
    return pytest.mark.skipif(BACKEND != backend, reason=f"{why}; runs in the {_SUITES[backend]} suite")


@pytest.fixture(autouse=True)
def _seed_and_policy():
    """Every test starts from the same seed and the float32 policy, on the suite's backend
    (a file under tests/ that set KERAS_BACKEND when pytest imported it once moved part of
    the TensorFlow suite onto JAX)."""
    import keras

    assert keras.backend.backend() == BACKEND == os.environ.get("KERAS_BACKEND", BACKEND), (
        f"this suite is {BACKEND}'s, but Keras runs {keras.backend.backend()} and KERAS_BACKEND is "
        f"{os.environ.get('KERAS_BACKEND')!r}: something changed the environment")
    keras.utils.set_random_seed(1234)
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")


def to_numpy(x, dtype="float64"):
    import keras

    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(x, "float32")), dtype=dtype)


def mha_weights(layer):
    """Projection weights of a MultiHeadAttention layer, as the NumPy reference takes them."""
    w = {}
    for role, dense in (("q", layer.query_dense), ("k", layer.key_dense), ("v", layer.value_dense), ("o", layer.output_dense)):
        w["w" + role] = to_numpy(dense.kernel)
        w["b" + role] = to_numpy(dense.bias)
    return w


def norm_weights(norm):
    return to_numpy(norm.gamma), to_numpy(norm.beta)


def ffn_weights(ffn):
    return (to_numpy(ffn.inner_dense.kernel), to_numpy(ffn.inner_dense.bias),
            to_numpy(ffn.outer_dense.kernel), to_numpy(ffn.outer_dense.bias))


def block_weights(block):
    w = {
        "self_attention": mha_weights(block.self_attention),
        "self_attention_norm": norm_weights(block.self_attention_norm),
        "ffn": ffn_weights(block.feed_forward),
        "feed_forward_norm": norm_weights(block.feed_forward_norm),
    }
    if getattr(block, "cross_attention", None) is not None:
        w["cross_attention"] = mha_weights(block.cross_attention)
        w["cross_attention_norm"] = norm_weights(block.cross_attention_norm)
    return w


def model_weights(model):
    w = {
        "embeddings": to_numpy(model.embedding.embeddings),
        "encoder": [block_weights(b) for b in model.encoder.blocks],
        "decoder": [block_weights(b) for b in model.decoder.blocks],
    }
    if model.norm_first:
        w["encoder_final_norm"] = norm_weights(model.encoder.final_norm)
        w["decoder_final_norm"] = norm_weights(model.decoder.final_norm)
    return w


def randomize_weights(layer, seed=0, scale=0.5):
    """Give every weight (biases and norms included) non-trivial random values."""
    rng = np.random.default_rng(seed)
    for v in layer.weights:
        v.assign(rng.normal(scale=scale, size=v.shape).astype("float32") + (1.0 if v.path.endswith("gamma") else 0.0))


def random_ids(rng, batch, length, vocab_size, pad_from=None):
    """Random ids in [4, vocab_size); rows padded with 0 from `pad_from[b]` on."""
    ids = rng.integers(4, vocab_size, size=(batch, length))
    if pad_from is not None:
        for b, start in enumerate(pad_from):
            ids[b, start:] = 0
    return ids.astype("int32")


def run_in_threads(work, count: int = 4) -> list:
    """`work(i)` for i in range(count), each in its own thread, all released at once by a
    barrier. Returns what the threads raised (as `repr`s), so that the test asserts none."""
    start, errors = threading.Barrier(count), []

    def run(i):
        start.wait()
        try:
            work(i)
        except Exception as error:  # noqa: BLE001 - returned to the test, which reports every one
            errors.append(repr(error))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def copy_task(path, size=600):
    """A small TSV corpus: words reversed and upper-cased. Returns the path as a string."""
    rng = np.random.default_rng(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    lines = []
    for _ in range(size):
        sentence = list(rng.choice(words, size=rng.integers(2, 7)))
        lines.append(" ".join(sentence) + "\t" + " ".join(w.upper() for w in reversed(sentence)))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


# A run small enough for CI: the tiny preset's width with one block, on a 1,500-pair copy
# task with 20 pairs held out for validation and 20 for test. (The numbers corpus holds out
# 1,000 of each: on JAX, their evaluation shapes took ~8 s of every short run.)
SMALL_SETTINGS = dict(holdout=20, vocab_size=100, batch_tokens=1024, max_length=32, num_layers=1)


@pytest.fixture(scope="session")
def small_tsv(tmp_path_factory):
    """The copy task of `SMALL_SETTINGS` runs, written once per test process."""
    return copy_task(tmp_path_factory.mktemp("small") / "copy.tsv", size=1500)


@pytest.fixture(scope="session")
def small(small_tsv):
    """`train` arguments of a `SMALL_SETTINGS` run on `small_tsv`."""
    flags = [part for key, value in SMALL_SETTINGS.items() for part in (f"--{key.replace('_', '-')}", str(value))]
    return ["--tsv", small_tsv, *flags, "--quiet"]


def pytest_report_header(config):
    from importlib.metadata import version

    return f"keras backend: {BACKEND}, keras {version('keras')}, KERAS_BACKEND={os.environ.get('KERAS_BACKEND')}"


_JAX_CACHE = "JAX_COMPILATION_CACHE_DIR"


def pytest_configure(config):
    """Per-backend settings for the session: see `_share_the_cores`, `_jax_compilation_cache`
    and `_jax_quick_compiles`."""
    _share_the_cores()
    _jax_compilation_cache(config)
    _jax_quick_compiles()


def _share_the_cores():
    """Each xdist worker uses its share of the cores.

    PyTorch and TensorFlow (which the tools use on every backend, for `tf.data`) size
    their thread pools to all the cores, in every process: two workers on two cores ran
    four busy threads or more, which slows PyTorch far more than the other backends
    (test_export + test_examples: 83 s -> 58 s) and TensorFlow's suite by a tenth (its
    tests' durations summed: 438 s -> 395 s, on 2 cores). JAX's suite did not change.
    The commands the tests start inherit the variables.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    threads = str(max(1, (os.cpu_count() or 1) // workers))
    for variable in ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        os.environ.setdefault(variable, threads)  # a setting of the user's stays
    if BACKEND == "torch" and os.environ["OMP_NUM_THREADS"] == threads:
        import torch

        torch.set_num_threads(int(threads))


def _jax_compilation_cache(config):
    """On JAX, one on-disk XLA compilation cache for the whole session.

    Many tests compile the same programs (the same small model and batch shapes, in
    this process, in the other xdist workers and in the commands the tests start);
    with the cache each program is compiled once. The tests still trace every
    function, so what they check about tracing is unchanged. The directory is made
    by the first process (the xdist controller, before it starts the workers, which
    inherit the variable) and removed at its end.
    """
    if BACKEND != "jax":
        return
    if _JAX_CACHE not in os.environ:
        import tempfile

        os.environ[_JAX_CACHE] = config._kt_jax_cache = tempfile.mkdtemp(prefix="kt-jax-cache-")
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
    if "jax" not in sys.modules:
        return  # JAX reads the variables when it is imported
    import jax

    # This process imported JAX before the variables were set.
    jax.config.update("jax_compilation_cache_dir", os.environ[_JAX_CACHE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")))


# Each flag with the setting it is tested for (a user's own setting of it is kept).
_QUICK_COMPILES = {
    "xla_backend_optimization_level": "0",
    "xla_cpu_use_fusion_emitters": "false",
}


def _jax_quick_compiles():
    """On JAX, XLA compiles the CPU code the quick way: no LLVM optimizations, and the
    fusions emitted as LLVM IR directly rather than through XLA's MLIR fusion emitters.

    The tests run many small programs once each: eager operations compiled per shape,
    searches and training steps of small models. Their compilation, not their run, is
    most of the JAX suite's time. `--xla_backend_optimization_level=0` sets LLVM's
    optimization level for the machine code, after XLA's own passes (fusion, layout),
    which are unchanged: in one run on 2 cores the suite took 225 s with it and 270 s
    without; the tests that train longest ran slower (a 300-step run 17 s against 11 s).
    `--xla_cpu_use_fusion_emitters=false` emits each fusion with XLA's elemental LLVM IR
    emitter: test_attention, test_decoding and test_transformer took 49 s with it and 64 s
    without, in one process, and every test, exact comparisons included, passed with both.
    Set before JAX starts, in the xdist controller, whose workers and the commands the
    tests start inherit them; a user's own `XLA_FLAGS` are kept. XLA stops a process
    whose `XLA_FLAGS` name a flag it does not know, so the flags are added only when a JAX
    started with them in a child process (about 1 s) works.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if BACKEND != "jax" or "jax" in sys.modules:
        return
    wanted = [f"--{name}={value}" for name, value in _QUICK_COMPILES.items() if name not in flags]
    if wanted and not _jax_accepts(" ".join([flags, *wanted])):
        wanted = [flag for flag in wanted if _jax_accepts(f"{flags} {flag}")]  # one this XLA lacks
    os.environ["XLA_FLAGS"] = " ".join([flags, *wanted]).strip()


def _jax_accepts(flags: str) -> bool:
    """Whether JAX's CPU backend starts with these `XLA_FLAGS` (in a child process)."""
    import subprocess

    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], capture_output=True,
                           env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}, timeout=120)
    return probe.returncode == 0


def pytest_unconfigure(config):
    if getattr(config, "_kt_jax_cache", None):
        import shutil

        shutil.rmtree(config._kt_jax_cache, ignore_errors=True)
