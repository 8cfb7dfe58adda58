"""Training on several devices with Keras' and TensorFlow's own engines.

Each check runs in a child process, because the number of devices is fixed when a
backend starts (see tests/distributed_checks.py). The JAX check runs in the JAX suite
and the TensorFlow check in the TensorFlow suite; the layout map itself is tested on
every backend. Each child then runs examples/multi_device.py (one start of the backend
with several devices for both).
"""

import json
import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_transformer as kt
from tests.conftest import BACKEND

ROOT = pathlib.Path(__file__).parent.parent


def run_check(backend):
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "distributed_checks.py"), backend],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution.ModelParallel runs on JAX; checked in the JAX suite")
def test_model_parallel_step_on_a_2x4_mesh_matches_one_device():
    r = run_check("jax")
    assert r["devices"] == 8
    np.testing.assert_allclose(r["sharded_loss"], r["single_loss"], rtol=1e-5, atol=1e-5)
    assert r["max_grad_difference"] <= 1e-5 * max(1.0, r["max_grad"])
    np.testing.assert_allclose(r["sharded_fit"], r["single_fit"], rtol=1e-5, atol=1e-5)
    layouts = {path.split("/", 1)[1]: value for path, value in r["layouts"].items()}
    query = layouts["encoder/encoder_block_0/self_attention/query_dense/kernel"]
    assert query == ["P(None, 'model')", [32, 8]]  # (d_model, h * d_k / 4): one head per device
    assert layouts["decoder/decoder_block_0/cross_attention/output_dense/kernel"] == ["P('model', None)", [8, 32]]
    assert layouts["encoder/encoder_block_0/feed_forward/inner_dense/kernel"] == ["P(None, 'model')", [32, 16]]
    assert layouts["decoder/decoder_block_0/feed_forward/outer_dense/kernel"] == ["P('model', None)", [16, 32]]
    assert layouts["embedding/embeddings"] == ["P('model', None)", [16, 32]]
    assert layouts["encoder/encoder_block_0/self_attention_norm/gamma"][1] == [32]  # replicated
    # examples/multi_device.py, run in the same child: data parallel over 8 devices, then the mesh.
    assert "data parallel over 8 devices" in r["example"] and "model parallel on a 2 x 4 mesh" in r["example"]
    assert "is stored as 8 shards of (64, 16)" in r["example"], r["example"]


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute is TensorFlow's; checked in the TensorFlow suite")
def test_mirrored_strategy_over_two_devices_trains_like_one():
    r = run_check("tensorflow")
    assert r["replicas"] == 2 and r["variable_type"] == "MirroredVariable"
    np.testing.assert_allclose(r["mirrored_fit"], r["single_fit"], rtol=1e-5)
    # examples/multi_device.py, run in the same child with the default MirroredStrategy.
    assert "MirroredStrategy over 2 replicas" in r["example"], r["example"]


def mesh(shape):
    return keras.distribution.DeviceMesh(shape, ["batch", "model"], [f"cpu:{i}" for i in range(int(np.prod(shape)))])


def test_layout_map_refuses_a_model_axis_that_does_not_divide_heads_or_d_ff():
    with pytest.raises(ValueError, match=r"has 4 devices, which does not divide num_heads=6"):
        kt.distribution.layout_map(mesh((2, 4)), num_heads=6, d_ff=2048)
    with pytest.raises(ValueError, match=r"has 3 devices, which does not divide d_ff=1000"):
        kt.distribution.layout_map(mesh((1, 3)), num_heads=6, d_ff=1000)
    with pytest.raises(ValueError, match="no axis 'tensor'"):
        kt.distribution.layout_map(mesh((2, 4)), num_heads=8, d_ff=64, model_axis="tensor")
    with pytest.raises(ValueError, match="`num_heads` must be a positive integer"):  # 0 divides by anything
        kt.distribution.layout_map(mesh((2, 4)), num_heads=0, d_ff=64)


def test_layout_map_covers_every_sharded_weight_of_the_model():
    model = kt.models.Transformer(vocab_size=64, num_layers=1, d_model=32, num_heads=4, d_ff=64)
    model.build()
    layouts = kt.distribution.layout_map(mesh((2, 4)), num_heads=4, d_ff=64)
    split = {v.path for v in model.weights if layouts[v.path] is not None}
    replicated = {v.path for v in model.weights} - split
    assert all(p.endswith(("gamma", "beta")) or "output_dense/bias" in p or "outer_dense/bias" in p
               for p in replicated)
    # embedding; encoder block: q, k, v kernels and biases + output kernel, FFN inner kernel
    # and bias + outer kernel; decoder block: the same with cross-attention as well.
    assert len(split) == 1 + (7 + 3) + (7 + 7 + 3)
