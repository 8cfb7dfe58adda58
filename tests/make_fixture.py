"""Write tests/fixtures/transformer_small.npz: weights, inputs and logits of a small
Transformer, produced once (on the TensorFlow backend) and checked on every backend.

Run: KERAS_BACKEND=tensorflow python -m tests.make_fixture
"""

import pathlib

import keras
import numpy as np

import keras_transformer as kt

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "transformer_small.npz"
CONFIG = dict(vocab_size=31, num_layers=2, d_model=16, num_heads=4, d_ff=32, dropout=0.1)


def weight_key(variable):
    # Paths start with the model's (auto-numbered) name; drop it.
    return "w:" + variable.path.split("/", 1)[1]


def main():
    keras.utils.set_random_seed(7)
    model = kt.models.Transformer(**CONFIG)
    model.build()
    rng = np.random.default_rng(7)
    source = rng.integers(4, 31, size=(3, 9)).astype("int32")
    target = rng.integers(4, 31, size=(3, 7)).astype("int32")
    source[1, 6:] = 0
    target[2, 4:] = 0
    logits = keras.ops.convert_to_numpy(model({"source_ids": source, "target_ids": target}))
    arrays = {weight_key(v): keras.ops.convert_to_numpy(v) for v in model.weights}
    FIXTURE.parent.mkdir(exist_ok=True)
    np.savez(FIXTURE, source_ids=source, target_ids=target, logits=logits, backend=keras.backend.backend(), **arrays)
    print(f"wrote {FIXTURE} ({len(arrays)} weights) on {keras.backend.backend()}")


if __name__ == "__main__":
    main()
