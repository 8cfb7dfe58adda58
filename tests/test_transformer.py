import keras
import numpy as np
import pytest

import keras_transformer as kt
from tests import reference as ref
from tests.conftest import model_weights, random_ids, randomize_weights, to_numpy


def _small(**kwargs):
    args = dict(vocab_size=23, num_layers=2, d_model=8, num_heads=2, d_ff=16)
    args.update(kwargs)
    return kt.models.Transformer(**args)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "source_ids": random_ids(rng, 3, 7, 23, pad_from=[7, 5, 3]),
        "target_ids": random_ids(rng, 3, 6, 23, pad_from=[6, 6, 2]),
    }


@pytest.mark.parametrize("norm_first", [False, True])
def test_model_matches_reference(norm_first):
    model = _small(norm_first=norm_first)
    model.build()
    randomize_weights(model, scale=0.3)
    batch = _batch()
    logits = to_numpy(model(batch))
    expected = ref.transformer(batch["source_ids"], batch["target_ids"], model_weights(model), 2, norm_first=norm_first)
    # Compare where targets are real tokens (outputs at padded positions are unused).
    real = batch["target_ids"] != 0
    np.testing.assert_allclose(logits[real], expected[real], atol=1e-4, rtol=1e-5)


def test_one_matrix_is_shared_when_tied():
    tied = _small()
    tied.build()
    embeddings = [w.path.split("/", 1)[1] for w in tied.weights if "embedding" in w.path]
    assert embeddings == ["embedding/embeddings"]
    untied = _small(tie_weights=False)
    untied.build()
    # Two more (V x d) matrices: target embedding and output projection.
    assert untied.count_params() - tied.count_params() == 2 * 23 * 8
    assert tuple(untied(_batch()).shape) == (3, 6, 23)


@pytest.mark.parametrize("pad_id", [0, 9])
def test_masks_come_from_ids(pad_id):
    model = _small(dropout=0.0, pad_id=pad_id, start_id=2 if pad_id else 1, end_id=3)
    model.build()
    randomize_weights(model, scale=0.3)
    batch = _batch(1)
    for key in batch:  # the pad id of this model, wherever `_batch` padded with 0
        batch[key] = np.where(batch[key] == 0, pad_id, np.where(batch[key] == pad_id, 4, batch[key])).astype("int32")
    base = to_numpy(model(batch))
    # The same rows with extra padding on the right give the same logits at the real
    # positions: padding is masked out of every attention, whatever its length.
    padded = {k: np.pad(v, ((0, 0), (0, 3)), constant_values=pad_id) for k, v in batch.items()}
    out = to_numpy(model(padded))
    real = batch["target_ids"] != pad_id
    np.testing.assert_allclose(out[:, : base.shape[1]][real], base[real], atol=1e-5)
    # Without the mask the extra positions would be attended to: a real id there changes the result.
    unmasked = {k: np.pad(v, ((0, 0), (0, 3)), constant_values=5) for k, v in batch.items()}
    assert not np.allclose(to_numpy(model(unmasked))[:, : base.shape[1]][real], base[real], atol=1e-3)
    # A later target token never influences earlier logits (causal decoder).
    changed = {k: v.copy() for k, v in batch.items()}
    changed["target_ids"][0, 4] = 22 if changed["target_ids"][0, 4] != 22 else 21
    out = to_numpy(model(changed))
    np.testing.assert_allclose(out[0, :4], base[0, :4], atol=1e-5)
    assert not np.allclose(out[0, 4:], base[0, 4:], atol=1e-4)


def test_base_preset_parameter_count():
    """Paper's base model with a shared vocabulary V:

    per attention: 4 (d^2 + d); per FFN: 2 d d_ff + d_ff + d; per LayerNorm: 2 d;
    encoder layer = attention + FFN + 2 norms; decoder layer = 2 attentions + FFN +
    3 norms; total = N (encoder + decoder layer) + V d (one tied embedding).
    With V = 37000 (the paper's shared BPE vocabulary) this is 63,082,496 (the paper
    rounds to 65M).
    """
    V, N, d, dff = 37000, 6, 512, 2048
    attn, ffn, norm = 4 * (d * d + d), 2 * d * dff + dff + d, 2 * d
    expected = N * ((attn + ffn + 2 * norm) + (2 * attn + ffn + 3 * norm)) + V * d
    assert expected == 63_082_496
    model = kt.models.Transformer.from_preset("base", vocab_size=V)
    model.build()
    assert model.count_params() == expected
    assert (model.num_layers, model.d_model, model.num_heads, model.d_ff, model.dropout) == (6, 512, 8, 2048, 0.1)


def test_presets_and_overrides():
    big = kt.models.PRESETS["big"]
    assert (big["num_layers"], big["d_model"], big["num_heads"], big["d_ff"], big["dropout"]) == (6, 1024, 16, 4096, 0.3)
    tiny = kt.models.Transformer.from_preset("tiny", vocab_size=50, dropout=0.0)
    assert tiny.dropout == 0.0 and tiny.d_model == kt.models.PRESETS["tiny"]["d_model"]
    with pytest.raises(ValueError, match="preset='huge'"):
        kt.models.Transformer.from_preset("huge", vocab_size=10)


def test_bad_model_inputs():
    with pytest.raises(ValueError, match=r"d_model=10, num_heads=4"):
        _small(d_model=10, num_heads=4)
    # Each size, rate and epsilon is checked by the model itself, before any layer is made.
    for settings, message in ((dict(d_model=-1), "`d_model` must be a positive integer. Received: d_model=-1"),
                              (dict(d_ff=0), "`d_ff` must be a positive integer. Received: d_ff=0"),
                              (dict(num_heads=True), "`num_heads` must be a positive integer"),
                              (dict(vocab_size=0), "`vocab_size` must be a positive integer"),
                              (dict(num_layers=2.0), "`num_layers` must be a positive integer"),
                              (dict(dropout=1.5), r"`dropout` must be in \[0, 1\)"),
                              (dict(layer_norm_epsilon=-1e-6), "`layer_norm_epsilon` must be a finite number > 0"),
                              # A switch read from text: "no" made a pre-norm model, "false" a tied one.
                              (dict(norm_first="no"), "`norm_first` must be True or False. Received: norm_first='no'"),
                              (dict(tie_weights="false"), "`tie_weights` must be True or False")):
        with pytest.raises(ValueError, match=message):
            _small(**settings)
    # The layers' switches, each named by its layer.
    for make, name in ((lambda: kt.layers.EncoderBlock(2, 8, norm_first="yes", name="x"), "norm_first"),
                       (lambda: kt.layers.Decoder(1, 2, 8, norm_first=1, name="x"), "norm_first"),
                       (lambda: kt.layers.MultiHeadAttention(2, use_bias="no", name="x"), "use_bias"),
                       (lambda: kt.layers.PositionwiseFFN(8, use_bias=None, name="x"), "use_bias"),
                       (lambda: kt.layers.SinusoidalEmbedding(9, 4, scale="no", name="x"), "scale")):
        with pytest.raises(ValueError, match=rf"Layer '.*': `{name}` must be True or False"):
            make()
    assert _small(norm_first=np.bool_(True)).get_config()["norm_first"] is True  # NumPy's, as Python's
    model = _small()
    with pytest.raises(ValueError, match="'source_ids' and 'target_ids'"):
        model({"source": np.ones((1, 2), "int32")})
    with pytest.raises(ValueError, match="integer"):
        model({"source_ids": np.ones((1, 2), "float32"), "target_ids": np.ones((1, 2), "int32")})
    with pytest.raises(ValueError, match=r"max=99"):
        model({"source_ids": np.array([[4, 99]], "int32"), "target_ids": np.array([[2, 5]], "int32")})


def test_numpy_numbers_are_taken_as_python_numbers():
    """Sizes read from an array or a sweep over `np.arange` are NumPy scalars: taken like
    Python's, and kept as Python numbers (the config stays JSON, the searches' keys and
    shapes plain ints); NumPy's booleans and a float where an integer is wanted are not."""
    import json

    i = np.int64
    model = _small(vocab_size=i(23), num_layers=np.int32(2), d_model=np.uint8(8), num_heads=i(2), d_ff=i(16),
                   dropout=np.float32(0.25), layer_norm_epsilon=np.float32(1e-6), max_wavelength=np.float32(1e4),
                   pad_id=i(0), start_id=i(2), end_id=i(3))
    config = model.get_config()
    for name in ("vocab_size", "num_layers", "d_model", "num_heads", "d_ff", "pad_id", "start_id", "end_id"):
        assert type(config[name]) is int, (name, type(config[name]))
    for name in ("dropout", "layer_norm_epsilon", "max_wavelength"):
        assert type(config[name]) is float, (name, type(config[name]))
    json.dumps(config)  # raised TypeError for NumPy scalars
    assert model.encoder.num_layers == 2 and type(model.encoder.num_layers) is int
    source = np.array([[5, 6, 7], [8, 9, 0]], "int32")
    expected = to_numpy(model.translate(source, beam_size=2, max_length=4, min_length=1, num_hypotheses=2))
    got = model.translate(source, beam_size=i(2), max_length=np.int32(4), min_length=i(1), num_hypotheses=i(2))
    np.testing.assert_array_equal(to_numpy(got), expected)
    layer = kt.layers.MultiHeadAttention(num_heads=i(2), key_dim=i(4), window=i(3), dropout=np.float32(0.5))
    assert (type(layer.num_heads), type(layer.key_dim), type(layer.window), type(layer.dropout)) == (int, int, int, float)
    for settings in (dict(d_model=np.bool_(True)), dict(num_layers=np.float64(2.0))):
        with pytest.raises(ValueError, match="must be a positive integer"):
            _small(**settings)
    with pytest.raises(ValueError, match="`beam_size` must be a positive integer"):
        model.translate(source, beam_size=np.float64(2))


def test_model_save_and_load_keras_format(tmp_path):
    model = _small(tie_weights=False, norm_first=True)
    batch = _batch(2)
    expected = to_numpy(model(batch))
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, kt.models.Transformer)
    assert loaded.get_config() == model.get_config()
    np.testing.assert_allclose(to_numpy(loaded(batch)), expected, atol=1e-6)


def test_build_again_and_keras_copies_of_the_model():
    # A second `build()` added every layer's weights again, which Keras refuses ("You cannot
    # add new elements of state ... already built"); so did `build()` on the built models
    # that `clone_model` and `model_from_json` give.
    model = _small()
    model.build()
    model.build()
    batch = _batch(3)
    expected = to_numpy(model(batch))
    for copy in (keras.models.clone_model(model), keras.models.model_from_json(model.to_json())):
        copy.build()
        copy.set_weights(model.get_weights())
        np.testing.assert_allclose(to_numpy(copy(batch)), expected, atol=1e-6)


def test_ids_of_the_wrong_rank_are_refused():
    model = _small()
    batch = _batch()
    with pytest.raises(ValueError, match=r"`source_ids` must be token ids of shape \(batch, length\)\. Received: source_ids.shape=\(7,\)"):
        model({"source_ids": batch["source_ids"][0], "target_ids": batch["target_ids"]})
    with pytest.raises(ValueError, match=r"target_ids.shape=\(3, 6, 1\)"):
        model({"source_ids": batch["source_ids"], "target_ids": batch["target_ids"][..., None]})


def test_special_ids_are_checked():
    with pytest.raises(ValueError, match=r"`pad_id` must be a token id in \[0, vocab_size=23\)"):
        _small(pad_id=23)
    with pytest.raises(ValueError, match=r"`start_id` must be a token id .* Received: start_id=True"):
        _small(start_id=True)  # a bool is not an id (True would be id 1)
    with pytest.raises(ValueError, match="must differ"):
        _small(start_id=3, end_id=3)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                    reason="a TensorFlow matter: tf.function traces a step twice when the first trace creates "
                           "variables; Keras builds them before tracing on JAX and PyTorch")
@pytest.mark.parametrize("build_first", [True, False])
def test_the_training_step_is_traced_once(build_first):
    model = kt.models.Transformer(vocab_size=40, num_layers=1, d_model=16, num_heads=2, d_ff=32)
    if build_first:
        model.build()
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[kt.metrics.MaskedAccuracy()])
    if not build_first:
        model.build()
    traces = []
    step = model.train_step

    def counted(*args):
        traces.append(1)
        return step(*args)

    model.train_step = counted
    ids = np.random.default_rng(0).integers(4, 40, size=(16, 6)).astype("int32")
    history = model.fit({"source_ids": ids, "target_ids": ids}, ids, batch_size=8, epochs=2, verbose=0)
    assert len(traces) == 1
    assert np.isfinite(history.history["loss"]).all() and "accuracy" in history.history


@pytest.mark.skipif(keras.backend.backend() == "tensorflow",
                    reason="Keras' TensorFlow trainer updates tf.Variables in place and never sets their values "
                           "aside; the JAX trainer does (the workaround checked here), PyTorch's suite checks the same "
                           "contract on a trainer that also keeps them (18 s of tracing on TensorFlow)")
def test_a_failed_fit_evaluate_or_predict_keeps_the_weights():
    """A call that fails (targets of the wrong shape, inputs the model refuses) leaves
    the model as it was. On JAX Keras 3.15 left it without its weights,
    the next call failing with "'NoneType' object is not callable" (see
    `_compat.state_kept_if_a_loop_fails`)."""
    model = _small(dropout=0.0)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    batch = _batch()
    targets = batch["target_ids"]
    model.fit(batch, targets, verbose=0)
    state = [*model.weights, *model.optimizer.variables]  # the weights and Adam's state
    before = [to_numpy(v) for v in state]

    def unchanged():
        for value, variable in zip(before, state):
            np.testing.assert_array_equal(to_numpy(variable), value, err_msg=variable.path)

    tokens = to_numpy(model.translate(batch["source_ids"], max_length=5))
    wrong = np.ones((3, 9), "int32")  # not the logits' (3, 6)
    for call in (lambda: model.fit(batch, wrong, verbose=0), lambda: model.evaluate(batch, wrong, verbose=0),
                 lambda: model.predict((batch["source_ids"], targets), verbose=0)):
        with pytest.raises(ValueError):
            call()
        unchanged()
    np.testing.assert_array_equal(to_numpy(model.translate(batch["source_ids"], max_length=5)), tokens)

    # A step ran before the failure: `predict` keeps the weights, `fit` those of that step.
    def batches(bad):
        yield batch, targets
        yield batch, wrong if bad else targets

    with pytest.raises(ValueError):
        model.predict((x for x in (batch, (batch["source_ids"], targets))), verbose=0)
    unchanged()
    twin = _small(dropout=0.0)
    twin.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    twin.fit(batch, targets, verbose=0)
    for theirs, ours in zip([*twin.weights, *twin.optimizer.variables], [*model.weights, *model.optimizer.variables]):
        theirs.assign(to_numpy(ours))  # a copy: a JAX step donates the buffers it is given
    with pytest.raises(ValueError):
        model.fit(batches(bad=True), steps_per_epoch=2, shuffle=False, verbose=0)
    twin.fit(batches(bad=False), steps_per_epoch=1, shuffle=False, verbose=0)
    for theirs, variable in zip(twin.weights, model.weights):
        np.testing.assert_allclose(to_numpy(variable), to_numpy(theirs), rtol=1e-5, atol=1e-7, err_msg=variable.path)
