"""`train --mixed-precision`: Keras' mixed dtype policies, saved with the run."""

import csv
import json
import math

import keras
import numpy as np
import pytest

from keras_transformer.tools import cli, evaluation
from tests.conftest import only_on



@pytest.fixture(scope="module")
def trained(tmp_path_factory, small):
    """`trained(policy)`: (run directory, train arguments) of a short run under that policy,
    trained once per module (the run and the export tests share the bfloat16 one)."""
    runs = {}

    def get(policy):
        if policy not in runs:
            out = tmp_path_factory.mktemp(f"mixed_{policy}") / "run"
            args = ["train", "--output-dir", str(out), *small, "--steps", "24", "--steps-per-epoch", "8",
                    "--average-checkpoints", "1", "--mixed-precision", policy]
            assert cli.main(args) == 0
            runs[policy] = out, args
        return runs[policy]

    return get


def _jax_on_cpu():
    if keras.backend.backend() != "jax":
        return False
    import jax

    return jax.default_backend() == "cpu"


@pytest.mark.parametrize("policy", [
    "bfloat16",
    pytest.param("float16", marks=only_on(
        "torch", "float16 adds Keras' LossScaleOptimizer to the bfloat16 run's path, the same Keras code on every "
                 "backend (XLA on CPU has no float16 matrix product with float32 accumulation: "
                 "test_float16_on_jax_cpu_is_refused checks the message)")),
])
def test_a_mixed_precision_run_trains_resumes_and_translates(policy, trained):
    out, args = trained(policy)
    with open(out / "log.csv") as f:
        losses = [float(r["loss"]) for r in csv.DictReader(f)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.5, losses
    assert json.loads((out / "config.json").read_text())["mixed_precision"] == policy
    model, tokenizer = evaluation.load_run(out)
    assert model.dtype_policy.name == f"mixed_{policy}"
    assert model.encoder.blocks[0].feed_forward.inner_dense.compute_dtype == policy
    assert model.weights[0].dtype == "float32"
    if policy == "float16":
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    # The saved policy is the run's: the same command resumes without a config clash.
    assert cli.main(args) == 0
    # The compiled search in mixed precision gives the eager search's tokens (a few steps:
    # eager JAX compiles each op on first use).
    ids = tokenizer.tokenize_dense(["alpha beta", "gamma delta epsilon"]).numpy()
    compiled = keras.ops.convert_to_numpy(model.translate(ids, 2, max_length=3))
    np.testing.assert_array_equal(compiled, keras.ops.convert_to_numpy(model.translate(ids, 2, max_length=3,
                                                                                       compile=False)))
    assert compiled.shape == (2, 3)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                    reason="export always runs on TensorFlow (a child process under JAX and PyTorch, the same "
                           "code this TensorFlow test runs in-process); one backend keeps CI short")
def test_a_mixed_precision_model_exports(trained, tmp_path):
    import keras_transformer as kt
    from keras_transformer.tools import saved_model_client

    model, tokenizer = evaluation.load_run(trained("bfloat16")[0])
    kt.export.export_translator(model, tokenizer, tmp_path / "saved", beam_size=2)
    texts = ["alpha beta", "zeta eta theta iota"]
    out = saved_model_client.translate(tmp_path / "saved", texts)
    assert out == evaluation.translate_texts(model, tokenizer, texts, beam_size=2)


@pytest.mark.skipif(not _jax_on_cpu(), reason="only JAX on a CPU lacks float16 matrix products")
def test_float16_on_jax_cpu_is_refused(tmp_path, small, capsys):
    out = tmp_path / "run"
    assert cli.main(["train", "--output-dir", str(out), *small, "--mixed-precision", "float16"]) == 2
    assert "--mixed-precision float16 cannot run on JAX on a CPU" in capsys.readouterr().err
    assert not out.exists()
