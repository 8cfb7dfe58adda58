"""Same weights, same outputs, whatever the backend: a fixture made once is checked
in every backend's run."""

import numpy as np

import keras_transformer as kt
from tests.conftest import to_numpy
from tests.make_fixture import CONFIG, FIXTURE, weight_key


def test_fixture_logits_reproduce_on_this_backend():
    data = np.load(FIXTURE)
    model = kt.models.Transformer(**CONFIG)
    model.build()
    keys = [weight_key(v) for v in model.weights]
    assert sorted(keys) == sorted(k for k in data.files if k.startswith("w:"))
    for v in model.weights:
        v.assign(data[weight_key(v)])
    logits = to_numpy(model({"source_ids": data["source_ids"], "target_ids": data["target_ids"]}))
    np.testing.assert_allclose(logits, data["logits"], atol=1e-5, rtol=1e-5)
