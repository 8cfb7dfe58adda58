"""Greedy and beam search (paper, section 6.1) on the decoder's static-shape KV cache.

Both searches encode the source once, project the encoder output into keys and values
once per decoder layer, and then feed one token per step through the decoder with a
preallocated self-attention cache `(N, max_length, h, d_k)` per layer. All shapes are
fixed before the loop, so the loop (`keras.ops.while_loop`) compiles as one program
under `jax.jit` and `tf.function(jit_compile=True)`; on PyTorch it runs eagerly.

Beam search follows the paper's settings: beam size 4 and length penalty alpha = 0.6,
with the GNMT penalty `lp(Y) = ((5 + |Y|) / 6)^alpha` (Wu et al., 2016); a hypothesis
scores `log P(Y | X) / lp(Y)`. The maximum output length is the input length + 50, and
the search stops early once no live hypothesis can beat the best finished one.
"""

from __future__ import annotations

import functools

import keras
from keras import ops

PAD_ID, START_ID, END_ID = 0, 2, 3
_NEG_INF = -1e9


def length_penalty(length, alpha: float):
    """GNMT length penalty `((5 + length) / 6) ** alpha`."""
    return ops.power((5.0 + ops.cast(length, "float32")) / 6.0, alpha)


def _prepare(model, source_ids, max_length, max_extra_length):
    if not model.built:  # decoding reaches into the blocks, which must exist
        model.build()
    source_ids = ops.convert_to_tensor(source_ids)
    if "int" not in keras.backend.standardize_dtype(source_ids.dtype):
        raise ValueError(f"`source_ids` must be integer token ids. Received: dtype={source_ids.dtype}")
    if len(source_ids.shape) != 2:
        raise ValueError(f"`source_ids` must be (batch, length). Received: shape={tuple(source_ids.shape)}")
    source_ids = ops.cast(source_ids, "int32")
    if max_length is None:
        max_length = source_ids.shape[1] + max_extra_length
    return source_ids, int(max_length)


def beam_search_graph(model, source_ids, beam_size: int = 4, length_penalty_alpha: float = 0.6, max_extra_length=50):
    """`beam_search` for tracing with unknown shapes (the exported SavedModel): the
    maximum length `S + max_extra_length` is computed at run time. Returns `(tokens, scores)`."""
    max_length = ops.shape(source_ids)[1] + max_extra_length
    return _beam(model, max_length, True, 0, beam_size, float(length_penalty_alpha), source_ids)


def _step_fn(model, encoded, source_mask, use_cache, min_length=0):
    """One decoder step at `index`: `(N, 1 + L)` token buffer -> `(N, V)` log-probabilities.

    With the cache, only the token at `index` goes through the decoder; without it, the
    whole buffer does (causally masked), which is what the cache saves. `[PAD]` and
    `[START]` are never produced, nor `[END]` before `min_length` tokens.
    """
    cross_caches = model.decoder.compute_cross_attention_cache(encoded) if use_cache else None

    def step(buffer, index, caches):
        if use_cache:
            tokens = ops.slice(buffer, [0, index], [ops.shape(buffer)[0], 1])
            y = model.target_embedding(tokens, start_index=index)
            y, caches = model.decoder(
                y,
                None,
                encoder_padding_mask=source_mask,
                self_attention_cache=caches,
                cache_index=index,
                cross_attention_cache=cross_caches,
            )
            logits = model.project(y)[:, 0, :]
        else:
            y = model.target_embedding(buffer)
            y = model.decoder(y, encoded, encoder_padding_mask=source_mask)
            logits = ops.take(model.project(y), index, axis=1)
        vocab = ops.arange(ops.shape(logits)[-1])
        banned = ops.logical_or(vocab == PAD_ID, vocab == START_ID)
        banned = ops.logical_or(banned, ops.logical_and(vocab == END_ID, index + 1 < min_length))
        logits = ops.where(banned[None, :], _NEG_INF, logits)
        return ops.log_softmax(logits, axis=-1), caches

    return step


def greedy_search(
    model,
    source_ids,
    max_length: int | None = None,
    max_extra_length: int = 50,
    use_cache: bool = True,
    min_length: int = 0,
):
    """Pick the most probable next token at every step, with the KV cache.

    Args:
        model: A `keras_transformer.models.Transformer`.
        source_ids: Integer `(B, S)` source ids, padded with 0.
        max_length: Most output tokens. Defaults to `S + max_extra_length`.
        max_extra_length: Defaults to `50` (the paper's "input length + 50").
        use_cache: Use the KV cache. `False` re-runs the decoder over the whole prefix
            at every step (same tokens, slower: for checks and benchmarks).
        min_length: No `[END]` before this many tokens. Defaults to `0`.

    Returns:
        Integer `(B, max_length)`: each row is the output tokens, `[END]` (if emitted in
        time) and then padding. `[START]` is not included.
    """
    source_ids, max_length = _prepare(model, source_ids, max_length, max_extra_length)
    return _compiled("greedy", model, max_length, bool(use_cache), int(min_length))(source_ids)


def beam_search(
    model,
    source_ids,
    beam_size: int = 4,
    length_penalty_alpha: float = 0.6,
    max_length: int | None = None,
    max_extra_length: int = 50,
    return_scores: bool = False,
    use_cache: bool = True,
    min_length: int = 0,
):
    """Beam search with the GNMT length penalty and early stopping, with the KV cache.

    Args:
        model: A `keras_transformer.models.Transformer`.
        source_ids: Integer `(B, S)` source ids, padded with 0.
        beam_size: Hypotheses kept per input. Defaults to `4`.
        length_penalty_alpha: alpha of `((5 + |Y|) / 6)^alpha`. Defaults to `0.6`.
        max_length: Most output tokens. Defaults to `S + max_extra_length`.
        max_extra_length: Defaults to `50`.
        return_scores: Also return the `(B,)` score `log P / lp` of each result.
        use_cache: Use the KV cache. Defaults to `True`.
        min_length: No `[END]` before this many tokens. Defaults to `0`.

    Returns:
        Integer `(B, max_length)`: the best hypothesis per input (tokens, `[END]`, then
        padding), and its score if `return_scores`.
    """
    if beam_size < 1:
        raise ValueError(f"`beam_size` must be >= 1. Received: beam_size={beam_size}")
    source_ids, max_length = _prepare(model, source_ids, max_length, max_extra_length)
    fn = _compiled("beam", model, max_length, bool(use_cache), int(min_length), beam_size, float(length_penalty_alpha))
    tokens, scores = fn(source_ids)
    return (tokens, scores) if return_scores else tokens


def _greedy(model, max_length, use_cache, min_length, source_ids):
    batch = ops.shape(source_ids)[0]
    encoded, source_mask = model.encode(source_ids)
    step = _step_fn(model, encoded, source_mask, use_cache, min_length)
    caches = model.decoder.init_cache(batch, max_length, dtype=encoded.dtype)
    tokens = ops.concatenate(
        [ops.full((batch, 1), START_ID, "int32"), ops.zeros((batch, max_length), "int32")], axis=1
    )
    finished = ops.zeros((batch,), "bool")

    def cond(i, tokens, caches, finished):
        return ops.logical_and(i < max_length, ops.logical_not(ops.all(finished)))

    def body(i, tokens, caches, finished):
        log_probs, caches = step(tokens, i, caches)
        next_token = ops.cast(ops.argmax(log_probs, axis=-1), "int32")
        next_token = ops.where(finished, PAD_ID, next_token)
        tokens = ops.slice_update(tokens, [0, i + 1], next_token[:, None])
        finished = ops.logical_or(finished, next_token == END_ID)
        return i + 1, tokens, caches, finished

    _, tokens, _, _ = ops.while_loop(cond, body, (ops.convert_to_tensor(0, "int32"), tokens, caches, finished))
    return tokens[:, 1:]


def _beam(model, max_length, use_cache, min_length, beam_size, alpha, source_ids):
    batch = ops.shape(source_ids)[0]
    k = beam_size
    # Every input is decoded as k rows: (B, S) -> (B * k, S).
    flat_source = ops.repeat(source_ids, k, axis=0)
    encoded, source_mask = model.encode(flat_source)
    step = _step_fn(model, encoded, source_mask, use_cache, min_length)
    caches = model.decoder.init_cache(batch * k, max_length, dtype=encoded.dtype)

    sequences = ops.concatenate(
        [ops.full((batch, k, 1), START_ID, "int32"), ops.zeros((batch, k, max_length), "int32")], axis=2
    )  # (B, k, 1 + L)
    # Only the first beam is live at the start, so the first step expands one hypothesis.
    alive_logp = ops.tile(ops.convert_to_tensor([[0.0] + [_NEG_INF] * (k - 1)], "float32"), (batch, 1))
    finished_seq = ops.zeros_like(sequences)
    finished_score = ops.full((batch, k), _NEG_INF, "float32")

    def gather_beams(x, indices):
        # x: (B, k, ...) gathered by indices (B, m) along axis 1. The static m is restored
        # explicitly: traced with unknown lengths (export), the loop needs fixed beam axes.
        m, rank = indices.shape[1], len(x.shape)
        out = ops.take_along_axis(x, ops.reshape(indices, (batch, m) + (1,) * (rank - 2)), axis=1)
        tail = [x.shape[d] if x.shape[d] is not None else ops.shape(x)[d] for d in range(2, rank)]
        return ops.reshape(out, [batch, m] + tail)

    def gather_cache(c, indices):
        # c: (B * k, L, h, d); rows b*k + j are reordered by indices (B, k). Shapes are
        # read at run time: L is unknown when exporting for inputs of any length.
        shape = ops.shape(c)
        c = ops.reshape(c, (batch, k, -1))
        c = gather_beams(c, indices)
        return ops.reshape(c, shape)

    def cond(i, sequences, alive_logp, caches, finished_seq, finished_score):
        # The best a live hypothesis can still score: its log-probability only falls,
        # and the length penalty is largest at max_length.
        best_alive = ops.max(alive_logp, axis=1) / length_penalty(max_length, alpha)
        best_finished = ops.max(finished_score, axis=1)
        can_improve = ops.any(best_alive > best_finished)
        return ops.logical_and(i < max_length, can_improve)

    def body(i, sequences, alive_logp, caches, finished_seq, finished_score):
        log_probs, caches = step(ops.reshape(sequences, (batch * k, -1)), i, caches)
        log_probs = ops.reshape(log_probs, (batch, k, -1))  # (B, k, V)
        vocab_size = ops.shape(log_probs)[-1]
        candidates = ops.reshape(alive_logp[:, :, None] + log_probs, (batch, -1))  # (B, k * V)
        # 2k candidates: enough that k of them are live even if k end here.
        top_logp, top_index = ops.top_k(candidates, 2 * k)
        beam_index = top_index // vocab_size
        token = ops.cast(top_index % vocab_size, "int32")
        candidate_seq = gather_beams(sequences, beam_index)  # (B, 2k, 1 + L)
        position = ops.cast(ops.arange(max_length + 1) == i + 1, "int32")[None, None, :]
        candidate_seq = candidate_seq * (1 - position) + token[:, :, None] * position
        # Candidates grown from dead (-inf) beams are never hypotheses.
        real = top_logp > _NEG_INF / 2
        ended = ops.logical_and(token == END_ID, real)

        # Finished: the old ones plus candidates that emitted [END], best k by score.
        end_score = top_logp / length_penalty(i + 1, alpha)
        end_score = ops.where(ended, end_score, _NEG_INF)
        all_seq = ops.concatenate([finished_seq, candidate_seq], axis=1)
        all_score = ops.concatenate([finished_score, end_score], axis=1)
        finished_score, keep = ops.top_k(all_score, k)
        finished_seq = gather_beams(all_seq, keep)

        # Alive: the best k candidates that did not end.
        live_logp = ops.where(ended, _NEG_INF, top_logp)
        alive_logp, keep = ops.top_k(live_logp, k)
        sequences = gather_beams(candidate_seq, keep)
        source_beam = ops.take_along_axis(beam_index, keep, axis=1)  # (B, k)
        caches = [tuple(gather_cache(c, source_beam) for c in pair) for pair in caches]
        return i + 1, sequences, alive_logp, caches, finished_seq, finished_score

    loop_vars = (ops.convert_to_tensor(0, "int32"), sequences, alive_logp, caches, finished_seq, finished_score)
    i, sequences, alive_logp, _, finished_seq, finished_score = ops.while_loop(cond, body, loop_vars)
    # Inputs with nothing finished (every hypothesis reached max_length) fall back to the
    # best live hypothesis, scored with the penalty of its full length.
    alive_score = alive_logp[:, 0] / length_penalty(i, alpha)
    use_finished = finished_score[:, 0] > _NEG_INF / 2
    best = ops.where(use_finished[:, None], finished_seq[:, 0], sequences[:, 0])
    score = ops.where(use_finished, finished_score[:, 0], alive_score)
    return best[:, 1:], score


def _compiled(kind, model, *static):
    """The search for `model`, compiled for the backend; cached per model and static args."""
    cache = model.__dict__.setdefault("_kt_decoders", {})
    key = (kind, *static)
    if key not in cache:
        fn = functools.partial(_greedy if kind == "greedy" else _beam, model, *static)
        cache[key] = _compile(fn, model)
    return cache[key]


def _compile(fn, model):
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        # Trace with the variables as arguments (stateless) so that weights updated
        # after compilation are used, not baked in as constants.
        variables = model.variables

        def stateless(values, source_ids):
            mapping = list(zip(variables, values))
            with keras.StatelessScope(state_mapping=mapping):
                return fn(source_ids)

        jitted = jax.jit(stateless)
        return lambda source_ids: jitted([v.value for v in variables], source_ids)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(fn, jit_compile=True, reduce_retracing=True)
    return fn
