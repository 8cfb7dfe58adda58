"""Greedy and beam search: equal to each other at beam 1, exact against enumeration on a
tiny model, the KV cache changes nothing but speed, and the searches work for any model
that offers a step function (a decoder-only language model here)."""

import itertools
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_transformer as kt
from keras_transformer import _compat, decoding
from keras_transformer.defaults import MAX_LENGTH_PENALTY
from tests.conftest import BACKEND, only_on, randomize_weights, to_numpy

# The searches' rules are checked here on the search each backend runs fastest for a few
# tokens of a tiny model: compiled on JAX (whose eager ops compile one by one), eagerly on
# TensorFlow and PyTorch (where compiling a search takes longer than these run). That the
# compiled search gives the eager one's tokens and scores is test_compiled_search's check,
# in every suite, and the short-buffer test below compiles on every backend.
COMPILE = BACKEND == "jax"
V = 7  # ids 0..3 reserved; the searches never emit [PAD]=0 or [START]=2


def _model(seed=0, scale=0.6):
    model = kt.models.Transformer(vocab_size=V, num_layers=2, d_model=16, num_heads=2, d_ff=32, dropout=0.0)
    model.build()
    randomize_weights(model, seed, scale=scale)
    return model


def _source():
    return np.array([[4, 5, 6, 1], [6, 6, 4, 0], [5, 0, 0, 0]], "int32")


def _score_sequences(model, source_row, sequences, alpha):
    """log P(y | x) / lp(|y|) for each complete sequence, by teacher forcing."""
    n = len(sequences)
    length = max(len(s) for s in sequences)
    decoder_input = np.full((n, length), 4, "int32")  # filler after the end: causally invisible
    for r, s in enumerate(sequences):
        decoder_input[r, : len(s)] = [decoding.START_ID] + list(s[:-1])
    logits = to_numpy(model({"source_ids": np.repeat(source_row[None], n, 0), "target_ids": decoder_input}))
    logits[..., [decoding.PAD_ID, decoding.START_ID]] = -1e9
    log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    scores = []
    for r, s in enumerate(sequences):
        logp = sum(log_probs[r, t, tok] for t, tok in enumerate(s))
        scores.append(logp / ((5 + len(s)) / 6) ** alpha)
    return np.array(scores)


def test_beam_of_one_equals_greedy():
    # With alpha = 0 a single beam stops exactly when greedy does: once [END] is the
    # most probable token, nothing alive can score higher.
    model = _model()
    greedy = to_numpy(model.translate(_source(), beam_size=1, max_length=8, compile=COMPILE), "int32")
    # beam_size=1 in `translate` is greedy; call the beam search itself with one beam.
    beam, _ = model.search(_source(), 8, beam_size=1, length_penalty=0.0, use_cache=True)
    beam = to_numpy(beam, "int32")
    np.testing.assert_array_equal(beam, greedy)


def test_greedy_scores_are_the_outputs_log_probability_over_the_length_penalty():
    # Rows that end at once and one that runs to the limit, each scored as beam search scores
    # a hypothesis: log P(y | x) / lp(|y|), |y| with [END].
    model, alpha = _model(seed=0), 0.6
    tokens, scores = model.translate(_source(), beam_size=1, length_penalty=alpha, max_length=6, return_scores=True,
                                     compile=COMPILE)
    tokens, scores = to_numpy(tokens, "int32"), to_numpy(scores)
    outputs = [list(row[: list(row).index(decoding.END_ID) + 1]) if decoding.END_ID in row else list(row)
               for row in tokens]
    assert sorted({len(o) for o in outputs}) == [1, 6], outputs  # ended early, and not
    for b, output in enumerate(outputs):
        assert scores[b] == pytest.approx(_score_sequences(model, _source()[b], [output], alpha)[0], abs=1e-4)
    # Without scores, a greedy search computes none: the same tokens.
    np.testing.assert_array_equal(to_numpy(model.translate(_source(), beam_size=1, max_length=6, compile=COMPILE),
                                           "int32"), tokens)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.5])
def test_wide_beam_finds_the_exhaustive_best(alpha):
    model = _model(seed=3, scale=0.8)
    max_length = 3
    allowed = [t for t in range(V) if t not in (decoding.PAD_ID, decoding.START_ID)]
    non_end = [t for t in allowed if t != decoding.END_ID]
    # Every complete hypothesis: up to max_length - 1 tokens, then [END].
    candidates = [tuple(p) + (decoding.END_ID,) for n in range(max_length) for p in itertools.product(non_end, repeat=n)]
    source = _source()
    tokens, scores = model.translate(
        source, beam_size=len(allowed) ** max_length, length_penalty=alpha, max_length=max_length, return_scores=True,
        compile=COMPILE,
    )
    tokens, scores = to_numpy(tokens, "int32"), to_numpy(scores)
    for b in range(len(source)):
        exhaustive = _score_sequences(model, source[b], candidates, alpha)
        best = candidates[int(exhaustive.argmax())]
        found = tuple(tokens[b, : len(best)])
        assert found == best, (b, found, best)
        assert scores[b] == pytest.approx(exhaustive.max(), abs=1e-4)


def test_n_best_list_is_the_exhaustive_top_n():
    model = _model(seed=3, scale=0.8)
    max_length, n, alpha = 3, 6, 0.6
    allowed = [t for t in range(V) if t not in (decoding.PAD_ID, decoding.START_ID)]
    non_end = [t for t in allowed if t != decoding.END_ID]
    candidates = [tuple(p) + (decoding.END_ID,) for k in range(max_length) for p in itertools.product(non_end, repeat=k)]
    source = _source()
    width = len(allowed) ** max_length
    tokens, scores = model.translate(source, beam_size=width, length_penalty=alpha, max_length=max_length,
                                     return_scores=True, num_hypotheses=n, compile=COMPILE)
    tokens, scores = to_numpy(tokens, "int32"), to_numpy(scores)
    assert tokens.shape == (len(source), n, max_length) and scores.shape == (len(source), n)
    best_only = to_numpy(model.translate(source, beam_size=width, length_penalty=alpha, max_length=max_length,
                                         compile=COMPILE), "int32")
    np.testing.assert_array_equal(tokens[:, 0], best_only)
    for b in range(len(source)):
        exhaustive = _score_sequences(model, source[b], candidates, alpha)
        np.testing.assert_allclose(scores[b], np.sort(exhaustive)[::-1][:n], atol=1e-4)
        for j in range(n):
            found = tuple(tokens[b, j, : list(tokens[b, j]).index(decoding.END_ID) + 1])
            assert exhaustive[candidates.index(found)] == pytest.approx(scores[b, j], abs=1e-4)
    with pytest.raises(ValueError, match="num_hypotheses"):
        model.translate(source, beam_size=2, num_hypotheses=3)


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_cache_gives_the_same_tokens_as_rerunning_the_decoder(search):
    model = _model(seed=5)
    kwargs = dict(max_length=10, beam_size=3 if search == "beam" else 1, return_scores=True, compile=COMPILE)
    cached = model.translate(_source(), use_cache=True, **kwargs)
    full = model.translate(_source(), use_cache=False, **kwargs)
    np.testing.assert_allclose(to_numpy(cached[1]), to_numpy(full[1]), atol=1e-4)
    np.testing.assert_array_equal(to_numpy(cached[0], "int32"), to_numpy(full[0], "int32"))


def test_greedy_matches_a_plain_python_loop():
    """Reference: call the model on the growing prefix and take the argmax."""
    model = _model(seed=7)
    source = _source()
    result = to_numpy(model.translate(source, beam_size=1, max_length=4, compile=COMPILE), "int32")
    prefix = np.full((len(source), 1), decoding.START_ID, "int32")
    done = np.zeros(len(source), bool)
    for _ in range(4):
        logits = to_numpy(model({"source_ids": source, "target_ids": prefix}))[:, -1]
        logits[:, [decoding.PAD_ID, decoding.START_ID]] = -np.inf
        nxt = np.where(done, decoding.PAD_ID, logits.argmax(-1))
        done |= nxt == decoding.END_ID
        prefix = np.concatenate([prefix, nxt[:, None].astype("int32")], 1)
    np.testing.assert_array_equal(result, prefix[:, 1:])


def test_output_shape_and_padding_after_end():
    model = _model(seed=9)
    out = to_numpy(model.translate(_source(), max_extra_length=5, compile=COMPILE), "int32")
    assert out.shape == (3, 4 + 5)  # input length + max_extra_length
    ended_early = 0
    for row in out:
        ends = np.flatnonzero(row == model.end_id)
        if len(ends):
            assert (row[ends[0] + 1 :] == model.pad_id).all()
            ended_early += ends[0] < len(row) - 1
        assert model.start_id not in row
    assert ended_early >= 1, out  # the padding rule was checked on at least one row


def test_an_empty_batch_gives_empty_results_of_the_search_shapes():
    # A server's batch can be empty: no search runs, and the shapes are those of a search.
    model, empty = _model(), _source()[:0]
    for settings, shapes in ((dict(beam_size=1), [(0, 9), (0,)]), (dict(beam_size=3, num_hypotheses=2), [(0, 2, 9), (0, 2)])):
        tokens, scores = model.translate(empty, max_length=9, return_scores=True, **settings)
        assert [tuple(tokens.shape), tuple(scores.shape)] == shapes
        assert keras.backend.standardize_dtype(tokens.dtype) == "int32" and not model._searches
    assert tuple(model.translate(empty, max_extra_length=3).shape) == (0, _source().shape[1] + 3)


def test_bad_arguments():
    model = _model()
    with pytest.raises(ValueError, match="beam_size"):
        model.translate(_source(), beam_size=0)
    with pytest.raises(ValueError, match="integer"):
        model.translate(_source().astype("float32"), beam_size=1)
    with pytest.raises(ValueError, match=r"\(batch, length\)"):
        model.translate(_source()[0])
    # `search`, translate's body, failed inside the cache write on a zero length.
    for settings, message in ((dict(max_length=0), "`max_length` must be a positive integer. Received: max_length=0"),
                              (dict(max_length=3, beam_size=0), "`beam_size` must be a positive integer")):
        with pytest.raises(ValueError, match=re.escape(message)):
            model.search(_source(), **settings)
    for settings, message in ((dict(max_length=0), "`max_length` must be a positive integer or None"),
                              (dict(max_length=2.5), "`max_length` must be a positive integer or None"),
                              (dict(max_extra_length=-5), "`max_extra_length` must be an integer >= 0"),
                              (dict(min_length=-1), "`min_length` must be an integer >= 0"),
                              (dict(max_length=5, min_length=6), "`min_length` must be at most the longest output, 5"),
                              # int32 sizes in every engine: a larger one failed inside the backend.
                              (dict(max_length=2**31), r"`max_length` must be at most 2147483647 \(the engines"),
                              (dict(beam_size=2**40), r"`beam_size` must be at most 2147483647"),
                              # The top-k of beam x vocabulary candidates has int32 indices: JAX refused it
                              # inside the compiled search, and the eager one built a 17 GB Python list.
                              (dict(beam_size=2**31 // model.vocab_size + 1),
                               rf"`beam_size` times the vocabulary size must be at most 2147483647 .*: at most "
                               rf"{2**31 // model.vocab_size} for vocab_size={model.vocab_size}\.")):
        with pytest.raises(ValueError, match=message):
            model.translate(_source(), **settings)
    with pytest.raises(ValueError, match=r"at least one position per row. Received: shape=\(3, 0\)"):
        model.translate(_source()[:, :0])
    # A switch read from text ("no") is true to Python: it turned the cache or the scores on.
    for settings in (dict(use_cache="no"), dict(return_scores="false"), dict(use_cache=None), dict(use_cache=1)):
        (name, value), = settings.items()
        with pytest.raises(ValueError, match=re.escape(f"`{name}` must be True or False. Received: {name}={value!r}")):
            model.translate(_source(), **settings)
    with pytest.raises(ValueError, match="`use_cache` must be True or False"):
        model.search(_source(), 3, use_cache="yes")
    assert model.translate(_source(), max_length=3, use_cache=np.bool_(False)).shape == (3, 3)
    # Ids of another kind, as a list, a NumPy array or a tensor: the same sentence on every
    # backend (strings failed inside JAX's and PyTorch's conversion, each its own way).
    for ids, dtype in ((np.array([["a", "b"]]), "<U1"), ([[5.0, 6.0]], "float64"), ([[True]], "bool"),
                       (np.array([[5, None]]), "object"), (keras.ops.ones((1, 2)), "float32")):
        with pytest.raises(ValueError, match=rf"^`source_ids` must be integer token ids. Received: dtype={dtype}$"):
            model.translate(ids)
    assert model.translate([[5, 6]], max_length=3).shape == (1, 3)  # a list of ints is ids
    with pytest.raises(ValueError, match=r"^`source_ids` must be a \(batch, length\) array: rows of one length, "
                                         r"the shorter ones padded with the model's pad_id. Received rows of "):
        model.translate([[5, 6], [7]])  # NumPy's own message said "inhomogeneous shape"
    vocab_size = model.vocab_size
    for bad in (vocab_size, -1):
        source = _source().copy()
        source[0, 0] = bad
        with pytest.raises(ValueError, match=rf"`source_ids` must be in \[0, {vocab_size}\) \(vocab_size={vocab_size}\)"):
            model.translate(source)
    # -0.5 was accepted (the CLI refuses it); 10**400 raised OverflowError from math.isfinite.
    for alpha in (float("nan"), float("inf"), "0.6", -0.5, 10**400):
        with pytest.raises(ValueError, match="`length_penalty` must be a finite number >= 0"):
            model.translate(_source(), length_penalty=alpha)
    with pytest.raises(ValueError, match="`length_penalty_alpha` must be a finite number"):
        decoding.beam_search(lambda *a: None, {}, 1, 3, start_id=2, end_id=3, pad_id=0, length_penalty_alpha=float("nan"))
    with pytest.raises(ValueError, match="`length_penalty_alpha` must be a finite number"):
        decoding.greedy_search(lambda *a: None, {}, 1, 3, start_id=2, end_id=3, pad_id=0, return_scores=True,
                               length_penalty_alpha=float("nan"))


def test_a_search_whose_cache_cannot_fit_in_memory_is_refused_before_it_starts(monkeypatch):
    # PyTorch's process was killed by the system (its zeros were allocated, and the first
    # steps that read them ended it); JAX's out-of-memory error came when the result was read.
    from keras_transformer.models import translating

    model = _model()
    if not translating._on_cpu(model.variables[0]):
        pytest.skip("the search's cache is checked against the memory of the machine, for a model on its CPU")
    # 2 layers x 2 heads x (8 + 8) key and value channels x 4 bytes per position and row.
    needed = 3 * 2 * 12 * 256  # 3 sentences x beam 2 x 12 positions
    with pytest.raises(MemoryError, match=re.escape(
            "The search's cache needs 1397.0 GiB (3 x 2 rows (batch x beam) x 976562500 positions x 256 bytes), "
            "more than this machine's ")):
        model.translate(_source(), beam_size=2, max_length=976562500, min_length=976562500)
    monkeypatch.setattr(translating, "memory_bytes", lambda: needed)
    assert model.translate(_source(), beam_size=2, max_length=12, min_length=12).shape == (3, 12)  # just fits
    with pytest.raises(MemoryError, match=r"x 13 positions x 256 bytes\), more than this machine's 0.0 GiB"):
        model.translate(_source(), beam_size=2, max_length=13, min_length=13)
    assert model.translate(_source(), beam_size=2, max_length=13, min_length=13, use_cache=False).shape == (3, 13)
    monkeypatch.setattr(translating, "memory_bytes", lambda: None)  # a system that does not say
    assert model.translate(_source(), beam_size=2, max_length=13, min_length=13).shape == (3, 13)


def test_a_length_penalty_that_overflows_float32_is_refused():
    # alpha = 60 with outputs of 70 tokens: ((5 + 70) / 6)^60 is past float32, every long
    # hypothesis scored -0.0 and the search returned any of them. The message gives the
    # largest alpha that fits, and the library's own penalty agrees with it.
    model = _model()
    message = r"overflow float32 for outputs of up to 70 tokens, and every such hypothesis would score 0: use at most "
    with pytest.raises(ValueError, match=message) as refused:
        model.translate(_source(), 4, length_penalty=60.0, max_length=70)
    largest = float(re.search(r"use at most ([0-9.]+)\. Received", str(refused.value)).group(1))
    assert np.isfinite(to_numpy(decoding.length_penalty(70, largest)))
    assert np.isinf(to_numpy(decoding.length_penalty(70, largest + 0.1)))
    with pytest.raises(ValueError, match=message):
        decoding.beam_search(lambda *a: None, {}, 1, 70, start_id=2, end_id=3, pad_id=0, length_penalty_alpha=60.0)
    # The bound where the longest output is not known (the command line, a SavedModel).
    assert np.isfinite(to_numpy(decoding.length_penalty(42_000, MAX_LENGTH_PENALTY)))


@only_on("jax", "the bound and the order are the model's own Python; compiling a search on each backend is "
                "test_compiled_search's, in every suite")
def test_compiled_searches_are_bounded_and_owned_by_the_model():
    model = _model()
    assert model._searches.max_entries == 8
    model._searches.max_entries = 2  # the same rule with fewer compilations
    for n in (3, 4, 5):
        model.translate(_source(), beam_size=1, max_length=n)
    # Keys start with the longest output: the newest settings are kept, the oldest (3) dropped.
    assert [key[0] for key in model._searches.keys()] == [4, 5]
    model.translate(_source(), beam_size=1, max_length=5)  # found: nothing made, nothing dropped
    assert [key[0] for key in model._searches.keys()] == [4, 5]
    model.translate(_source(), beam_size=1, max_length=3)  # made again, dropping the oldest
    assert [key[0] for key in model._searches.keys()] == [5, 3]


class _TinyLM:
    """A decoder-only language model from the library's layers, with a step function:
    what a search needs, and nothing the searches know about."""

    def __init__(self, vocab_size=9, d_model=16, seed=0):
        self.embedding = kt.layers.SinusoidalEmbedding(vocab_size, d_model)
        self.decoder = kt.layers.Decoder(num_layers=2, num_heads=2, d_ff=32, dropout=0.0)
        self.embedding.build((None, None))
        self.decoder.build((None, None, d_model))  # no encoder: decoder-only blocks
        randomize_weights(self.decoder, seed, scale=0.5)
        randomize_weights(self.embedding, seed + 1, scale=0.8)

    def logits(self, ids):
        """Full causal pass: `(B, T)` ids -> `(B, T, V)` logits."""
        return self.embedding(self.decoder(self.embedding(ids)), reverse=True)

    def init_cache(self, batch_size, max_length):
        return self.decoder.init_cache(batch_size, max_length)

    def step(self, token_ids, cache, index):
        tokens = keras.ops.slice(token_ids, [0, index], [keras.ops.shape(token_ids)[0], 1])
        y, cache = self.decoder(self.embedding(tokens, start_index=index), cache=cache, cache_index=index)
        return self.embedding(y, reverse=True)[:, 0], cache


SPECIAL = dict(start_id=5, end_id=6, pad_id=7)  # not the defaults: the search must use these


def test_greedy_search_on_a_decoder_only_model_matches_its_full_passes():
    lm = _TinyLM()
    n, length = 3, 6
    tokens = to_numpy(decoding.greedy_search(lm.step, lm.init_cache(n, length), n, length, **SPECIAL), "int32")
    # Reference: rerun the whole prefix at every step, never choosing [PAD] or [START].
    prefix = np.full((n, 1), SPECIAL["start_id"], "int32")
    done = np.zeros(n, bool)
    for _ in range(length):
        logits = to_numpy(lm.logits(prefix))[:, -1]
        logits[:, [SPECIAL["pad_id"], SPECIAL["start_id"]]] = -np.inf
        nxt = np.where(done, SPECIAL["pad_id"], logits.argmax(-1))
        done |= nxt == SPECIAL["end_id"]
        prefix = np.concatenate([prefix, nxt[:, None].astype("int32")], 1)
    np.testing.assert_array_equal(tokens, prefix[:, 1:])
    assert SPECIAL["start_id"] not in tokens


def test_beam_search_on_a_decoder_only_model_finds_the_exhaustive_best():
    lm = _TinyLM(vocab_size=8, seed=2)
    max_length, alpha = 3, 0.6
    allowed = [t for t in range(8) if t not in (SPECIAL["pad_id"], SPECIAL["start_id"])]
    non_end = [t for t in allowed if t != SPECIAL["end_id"]]
    candidates = [tuple(p) + (SPECIAL["end_id"],) for n in range(max_length) for p in itertools.product(non_end, repeat=n)]
    tokens, scores = decoding.beam_search(
        lm.step, lm.init_cache(1, max_length), 1, max_length, beam_size=len(allowed) ** max_length,
        length_penalty_alpha=alpha, **SPECIAL,
    )
    # Exhaustive scores by teacher forcing every candidate through the full pass.
    width = max(len(c) for c in candidates)
    inputs = np.full((len(candidates), width), non_end[0], "int32")
    for r, c in enumerate(candidates):
        inputs[r, : len(c)] = [SPECIAL["start_id"], *c[:-1]]
    logits = to_numpy(lm.logits(inputs))
    logits[..., [SPECIAL["pad_id"], SPECIAL["start_id"]]] = -1e9
    log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    exhaustive = np.array([
        sum(log_probs[r, t, tok] for t, tok in enumerate(c)) / ((5 + len(c)) / 6) ** alpha
        for r, c in enumerate(candidates)
    ])
    best = candidates[int(exhaustive.argmax())]
    assert tuple(to_numpy(tokens, "int32")[0, : len(best)]) == best
    assert to_numpy(scores)[0] == pytest.approx(exhaustive.max(), abs=1e-4)


def test_beam_search_reorders_only_the_cache_the_step_changes(monkeypatch):
    # The encoder's keys and values (a tensor the step returns as it got it) hold equal
    # rows for every hypothesis of an input: reordering them would copy them for nothing.
    taken = []
    take_rows = _compat.take_rows

    def recording_take(x, rows):
        taken.append(tuple(x.shape))
        return take_rows(x, rows)

    def step(tokens, cache, index):
        logits = keras.ops.stack([keras.ops.sum(cache["source"], axis=1) * 0.1 * (t + 1) for t in range(V)], axis=1)
        return logits, {**cache, "history": cache["history"] + keras.ops.cast(index, "float32")}

    cache = {"source": keras.ops.convert_to_tensor(np.arange(6, dtype="float32").reshape(2, 3)),
             "history": keras.ops.zeros((2, 5))}
    monkeypatch.setattr(_compat, "take_rows", recording_take)
    decoding.beam_search(step, cache, 2, 4, start_id=decoding.START_ID, end_id=decoding.END_ID,
                         pad_id=decoding.PAD_ID, beam_size=3, while_loop=decoding.eager_while_loop)
    assert (6, 5) in taken  # the history, reordered each step
    assert (6, 3) not in taken  # the source, never


@only_on("torch", "which buffers `translate` tries and which result it keeps is the model's own Python; each "
                  "backend's compiled search is test_compiled_search's, in every suite (here 19 s on TensorFlow)")
@pytest.mark.parametrize("beam_size, num_hypotheses", [(1, 1), (3, 2)])
def test_translate_tries_a_short_buffer_first_with_the_full_searchs_result(beam_size, num_hypotheses):
    # The source is 4 wide: `translate` searches with 20 tokens first, then the full 30.
    # Model 0's outputs all end within 20 tokens; some of model 1's do not (many random
    # models never end), so it is searched again; with min_length 21, only the full search
    # (the same rule for every beam size: checked once).
    source = _source()
    cases = ((0, 0, {20}), (1, 0, {20, 30})) + (((0, 21, {30}),) if beam_size == 1 else ())
    for seed, min_length, lengths in cases:
        model = _model(seed=seed, scale=0.8)
        expected = model.search(source, 30, beam_size=beam_size, min_length=min_length, num_hypotheses=num_hypotheses)
        got = model.translate(source, beam_size, max_length=30, min_length=min_length, num_hypotheses=num_hypotheses,
                              return_scores=True)
        assert {key[0] for key in model._searches.keys()} == lengths
        np.testing.assert_array_equal(to_numpy(got[0], "int32"), to_numpy(expected[0], "int32"))
        np.testing.assert_allclose(to_numpy(got[1]), to_numpy(expected[1]), atol=1e-5)


def test_translate_refuses_the_openvino_backend_in_one_sentence(monkeypatch):
    # Keras' openvino backend failed inside the search ("An OpenVINOKerasTensor is symbolic").
    model = _model()
    monkeypatch.setattr(keras.backend, "backend", lambda: "openvino")
    with pytest.raises(NotImplementedError, match="^`translate` does not run on Keras' openvino backend"):
        model.translate(_source())


@only_on("jax", "the checks of this file on Keras' numpy backend, in a child process: the same in every suite")
def test_the_searches_hold_on_the_numpy_backend():
    # `translate` and `evaluate` run on KERAS_BACKEND=numpy, whose `slice_update` writes in
    # place: a beam search there reordered no cache and returned hypotheses whose scores the
    # model did not give them (the exhaustive tests failed; see `_compat.update_along`), and
    # string ids failed inside Keras' dtype names.
    child = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-p", "no:xdist"],
        env={**os.environ, "KERAS_BACKEND": "numpy"}, capture_output=True, text=True, timeout=600,
    )
    assert child.returncode == 0, child.stdout[-4000:]
    passed = re.search(r"\b(\d+) passed", child.stdout)
    assert passed and int(passed.group(1)) >= 10, child.stdout[-1000:]  # the searches ran, not only skips
