"""Greedy and beam search (paper, section 6.1) over any model's decoding step.

A search knows nothing of the model. It takes

* `step(token_ids, cache, index) -> (logits, cache)`: given the `(N, 1 + L)` buffer of
  tokens chosen so far (`token_ids[:, 0]` is `[START]`), the model's cache and the
  position `index` of the newest token, the `(N, V)` logits of the token at
  `index + 1` and the updated cache;
* `cache`: any nest of tensors whose leading axis is the batch (`keras.tree`
  structures: lists, tuples, dicts), made by the model (`Transformer.init_cache`);
* the special ids: `[START]` opens every output, `[END]` closes it, `[PAD]` fills
  what follows; neither `[PAD]` nor `[START]` is ever produced.

This is the shape of KerasHub's samplers and Flax's `beam_search(..., tokens_to_logits,
...)`. All shapes are fixed before the loop (`keras.ops.while_loop`), so a search
compiles as one program under `jax.jit` and `tf.function(jit_compile=True)`. The loop
is `keras.ops.while_loop` unless the caller passes another with its signature (PyTorch's
compiled search passes one that runs each iteration as an exported program: see
`keras_transformer.backend.torch_decoding`).

The paper's decoding defaults (beam 4, length penalty alpha 0.6, at most input length
+ 50 tokens) and the default special ids are written once, in
`keras_transformer.defaults`, and re-exported here.
"""

from __future__ import annotations

import keras
from keras import ops

from keras_transformer import _checks, _compat
from keras_transformer.defaults import BEAM_SIZE, END_ID, LENGTH_PENALTY, MAX_EXTRA_LENGTH, PAD_ID, START_ID, UNK_ID

__all__ = [
    "greedy_search", "beam_search", "length_penalty", "eager_while_loop",
    "BEAM_SIZE", "LENGTH_PENALTY", "MAX_EXTRA_LENGTH", "PAD_ID", "UNK_ID", "START_ID", "END_ID",
]

_NEG_INF = -1e9


def eager_while_loop(cond, body, loop_vars):
    """`keras.ops.while_loop` as a Python loop: every iteration runs op by op.

    The search of `Transformer.translate(..., compile=False)`: on JAX,
    `keras.ops.while_loop` is `jax.lax.while_loop`, which traces its body even outside
    `jax.jit`, so a body that reads a tensor's value in Python could not run at all.
    """
    loop_vars = tuple(loop_vars)
    while bool(cond(*loop_vars)):  # a scalar tensor's truth, on every backend
        loop_vars = tuple(body(*loop_vars))
    return loop_vars


def length_penalty(length, alpha: float):
    """GNMT length penalty `((5 + length) / 6) ** alpha` (Wu et al., 2016)."""
    return ops.power((5.0 + ops.cast(length, "float32")) / 6.0, alpha)


def greedy_search(
    step,
    cache,
    batch_size,
    max_length,
    *,
    start_id: int,
    end_id: int,
    pad_id: int,
    min_length: int = 0,
    while_loop=None,
    return_complete: bool = False,
    return_scores: bool = False,
    length_penalty_alpha: float = LENGTH_PENALTY,
):
    """Pick the most probable next token at every step.

    Args:
        step: `step(token_ids, cache, index) -> (logits, cache)`, see the module.
        cache: The model's cache for `batch_size` rows.
        batch_size: N, the rows decoded together.
        max_length: Most output tokens L (an int, or a scalar tensor when traced).
        start_id: The `[START]` id, the first input token.
        end_id: The `[END]` id; a row is finished once it emits it.
        pad_id: The `[PAD]` id, written after `[END]`.
        min_length: No `[END]` before this many tokens. Defaults to `0`.
        while_loop: Runs the loop, with `keras.ops.while_loop`'s signature. Defaults
            to `keras.ops.while_loop`.
        return_complete: Also return a boolean scalar, whether every row emitted
            `[END]`: then a longer `max_length` would give the same tokens (and padding).
        return_scores: Also return each row's score as `beam_search` scores a
            hypothesis, `log P(Y | X) / lp(|Y|)` (`|Y|` counts `[END]`): the same
            number a beam of one gives. Costs a log-softmax per step.
        length_penalty_alpha: alpha of the scores' length penalty, >= 0. Defaults to
            `0.6` (the paper).

    Returns:
        Integer `(N, L)`: each row is the output tokens, `[END]` (if emitted in time)
        and then padding. `[START]` is not included. With `return_scores=True`, then
        the `(N,)` scores; with `return_complete=True`, then `complete`.
    """
    if return_scores:  # as beam search checks its penalty: a score divides by it
        _checks.length_penalties(length_penalty_alpha=length_penalty_alpha,
                                 max_length=max_length if isinstance(max_length, int) else None)
    alpha = float(length_penalty_alpha)
    tokens = ops.concatenate(
        [ops.full((batch_size, 1), start_id, "int32"), ops.full((batch_size, max_length), pad_id, "int32")], axis=1
    )
    finished = ops.zeros((batch_size,), "bool")
    banned = _Banned(start_id, end_id, pad_id, min_length)
    # The log-probability of each row's output so far, when asked for: a loop variable of
    # its own, so that the search without scores computes nothing more.
    extra = (ops.zeros((batch_size,), "float32"),) if return_scores else ()

    def cond(i, tokens, cache, finished, *logp):
        return ops.logical_and(i < max_length, ops.logical_not(ops.all(finished)))

    def body(i, tokens, cache, finished, *logp):
        logits, cache = step(tokens, cache, i)
        logits = banned(logits, i)
        next_token = ops.cast(ops.argmax(logits, axis=-1), "int32")
        next_token = ops.where(finished, pad_id, next_token)
        if return_scores:  # a finished row adds nothing (its pad token's -inf is dropped)
            chosen = ops.take_along_axis(ops.log_softmax(logits, axis=-1), next_token[:, None], axis=1)[:, 0]
            logp = (logp[0] + ops.where(finished, 0.0, chosen),)
        tokens = _compat.update_along(tokens, i + 1, next_token[:, None], axis=1)
        finished = ops.logical_or(finished, next_token == end_id)
        return (i + 1, tokens, cache, finished, *logp)

    loop = while_loop or ops.while_loop
    _, tokens, _, finished, *logp = loop(cond, body, (ops.convert_to_tensor(0, "int32"), tokens, cache, finished,
                                                      *extra))
    result = (tokens[:, 1:],)
    if return_scores:  # the output's length: its tokens up to and with `[END]` (never `[PAD]`)
        length = ops.sum(ops.cast(result[0] != pad_id, "int32"), axis=1)
        result += (logp[0] / length_penalty(length, alpha),)
    if return_complete:
        result += (ops.all(finished),)
    return result if len(result) > 1 else result[0]


def beam_search(
    step,
    cache,
    batch_size,
    max_length,
    *,
    start_id: int,
    end_id: int,
    pad_id: int,
    beam_size: int = BEAM_SIZE,
    length_penalty_alpha: float = LENGTH_PENALTY,
    min_length: int = 0,
    num_hypotheses: int = 1,
    while_loop=None,
    bound_length=None,
    return_complete: bool = False,
):
    """Beam search with the GNMT length penalty and early stopping.

    A hypothesis `Y` scores `log P(Y | X) / lp(|Y|)` with `lp(n) = ((5 + n) / 6)^alpha`.
    The search stops once no live hypothesis can beat the best finished one: its
    log-probability only falls, so it scores at most `log P / lp(bound_length)`.

    Args:
        step: `step(token_ids, cache, index) -> (logits, cache)`, see the module.
        cache: The model's cache for `batch_size` rows; each row is repeated for its
            `beam_size` hypotheses, and rows are reordered as hypotheses are chosen,
            but for tensors `step` returns as it got them (the same tensor, such as the
            encoder's keys and values): their rows are equal within each input.
        batch_size: N, the inputs decoded together.
        max_length: Most output tokens L (an int, or a scalar tensor when traced).
        start_id: The `[START]` id.
        end_id: The `[END]` id.
        pad_id: The `[PAD]` id, written after `[END]`.
        beam_size: Hypotheses kept per input k. Defaults to `4` (the paper).
        length_penalty_alpha: alpha, >= 0. Defaults to `0.6` (the paper).
        min_length: No `[END]` before this many tokens. Defaults to `0`.
        num_hypotheses: n, how many hypotheses to return per input (the n-best
            list), at most `beam_size`. Defaults to `1`.
        while_loop: Runs the loop, with `keras.ops.while_loop`'s signature. Defaults
            to `keras.ops.while_loop`.
        bound_length: The longest output the stopping rule allows for. Defaults to
            `max_length`. `Transformer.translate` searches first with a short
            `max_length` (the cache and the token buffer, what every step reads and
            reorders) and the full length here; only if that was not enough does it
            search again with the full length.
        return_complete: Also return a boolean scalar, whether the search stopped
            because no live hypothesis could beat the finished ones within
            `bound_length` tokens: then searching with `max_length=bound_length`
            gives the same hypotheses (and more padding).

    Returns:
        `(tokens, scores)`: integer `(N, L)`, the best hypothesis per input (tokens,
        `[END]`, then padding), and its `(N,)` score. With `num_hypotheses=n > 1`,
        `(N, n, L)` and `(N, n)`, best first: the finished hypotheses by score, then
        (where fewer than n finished) the live ones, scored at their full length.
        With `return_complete=True`, `(tokens, scores, complete)`.
    """
    beam_size, num_hypotheses = _checks.beam(beam_size, num_hypotheses)
    lengths = [max_length] + ([] if bound_length is None else [bound_length])  # the longest the penalty sees
    _checks.length_penalties(length_penalty_alpha=length_penalty_alpha,
                             max_length=max(lengths) if all(isinstance(n, int) for n in lengths) else None)
    k = beam_size
    alpha = float(length_penalty_alpha)
    banned = _Banned(start_id, end_id, pad_id, min_length)
    # Every input is decoded as k rows b * k + j: (N, ...) -> (N * k, ...).
    cache = keras.tree.map_structure(lambda x: ops.repeat(x, k, axis=0), cache)
    sequences = ops.concatenate(
        [ops.full((batch_size, k, 1), start_id, "int32"), ops.full((batch_size, k, max_length), pad_id, "int32")],
        axis=2,
    )  # (N, k, 1 + L)
    # Only the first beam is live at the start, so the first step expands one hypothesis.
    # (Built with ops, not a Python list of k floats: a beam of 2**31 made 17 GB of list.)
    alive_logp = ops.tile(ops.where(ops.arange(k) == 0, 0.0, _NEG_INF)[None, :], (batch_size, 1))
    finished_seq = sequences
    finished_score = ops.full((batch_size, k), _NEG_INF, "float32")

    def gather_beams(x, indices):
        # x: (N, m, ...) -> (N, m', ...) picked along axis 1 by indices (N, m'). Works
        # through the flat row index, so trailing axes may be unknown (export traces
        # with inputs of any length).
        m, m_new = x.shape[1], indices.shape[1]
        rows = ops.reshape(indices + ops.arange(batch_size)[:, None] * m, (-1,))
        flat = _compat.take_rows(ops.reshape(x, (-1,) + tuple(ops.shape(x)[2:])), rows)
        return ops.reshape(flat, (batch_size, m_new) + tuple(ops.shape(x)[2:]))

    def reorder_cache(cache, beam_index, before):
        # Row b * k + j of every cache tensor becomes row b * k + beam_index[b, j]. A
        # tensor the step returned as it got it (`before`: the encoder's keys and
        # values, the source mask) holds k equal rows per input, so it stays as it is.
        rows = ops.reshape(beam_index + ops.arange(batch_size)[:, None] * k, (-1,))
        return keras.tree.map_structure(lambda x, old: x if x is old else _compat.take_rows(x, rows), cache, before)

    bound = max_length if bound_length is None else bound_length

    def can_improve(alive_logp, finished_score):
        # The best a live hypothesis can still score: its log-probability only falls,
        # and the length penalty is largest at the longest output.
        best_alive = ops.max(alive_logp, axis=1) / length_penalty(bound, alpha)
        return ops.any(best_alive > ops.max(finished_score, axis=1))

    def cond(i, sequences, alive_logp, cache, finished_seq, finished_score):
        return ops.logical_and(i < max_length, can_improve(alive_logp, finished_score))

    def body(i, sequences, alive_logp, before, finished_seq, finished_score):
        logits, cache = step(ops.reshape(sequences, (batch_size * k, -1)), before, i)
        log_probs = ops.log_softmax(banned(logits, i), axis=-1)
        log_probs = ops.reshape(log_probs, (batch_size, k, -1))  # (N, k, V)
        vocab_size = ops.shape(log_probs)[-1]
        candidates = ops.reshape(alive_logp[:, :, None] + log_probs, (batch_size, -1))  # (N, k * V)
        # 2k candidates: enough that k of them are live even if k end here.
        top_logp, top_index = ops.top_k(candidates, 2 * k)
        beam_index = top_index // vocab_size
        token = ops.cast(top_index % vocab_size, "int32")
        candidate_seq = gather_beams(sequences, beam_index)  # (N, 2k, 1 + L)
        position = ops.cast(ops.arange(ops.shape(sequences)[2]) == i + 1, "int32")[None, None, :]
        candidate_seq = candidate_seq * (1 - position) + token[:, :, None] * position
        # Candidates grown from dead (-inf) beams are never hypotheses.
        real = top_logp > _NEG_INF / 2
        ended = ops.logical_and(token == end_id, real)

        # Finished: the old ones plus candidates that emitted [END], best k by score.
        end_score = ops.where(ended, top_logp / length_penalty(i + 1, alpha), _NEG_INF)
        all_seq = ops.concatenate([finished_seq, candidate_seq], axis=1)
        all_score = ops.concatenate([finished_score, end_score], axis=1)
        finished_score, keep = ops.top_k(all_score, k)
        finished_seq = gather_beams(all_seq, keep)

        # Alive: the best k candidates that did not end.
        alive_logp, keep = ops.top_k(ops.where(ended, _NEG_INF, top_logp), k)
        sequences = gather_beams(candidate_seq, keep)
        cache = reorder_cache(cache, ops.take_along_axis(beam_index, keep, axis=1), before)
        return i + 1, sequences, alive_logp, cache, finished_seq, finished_score

    loop_vars = (ops.convert_to_tensor(0, "int32"), sequences, alive_logp, cache, finished_seq, finished_score)
    loop = while_loop or ops.while_loop
    i, sequences, alive_logp, _, finished_seq, finished_score = loop(cond, body, loop_vars)
    tokens, scores = _best(i, sequences, alive_logp, finished_seq, finished_score, alpha, num_hypotheses, gather_beams)
    if not return_complete:
        return tokens, scores
    # Complete when the search with max_length=bound would stop here too (always so
    # when bound is max_length: the loop ended).
    return tokens, scores, ops.logical_not(ops.logical_and(i < bound, can_improve(alive_logp, finished_score)))


def _best(i, sequences, alive_logp, finished_seq, finished_score, alpha, num_hypotheses, gather_beams):
    """The beam search's result from its last state: see `beam_search`."""
    # Inputs with nothing finished (every hypothesis reached max_length) fall back to the
    # best live hypothesis, scored with the penalty of its full length.
    alive_score = alive_logp / length_penalty(i, alpha)  # (N, k)
    if num_hypotheses > 1:
        # Finished hypotheses rank first, then live ones; dead slots (-inf) last.
        real_finished = finished_score > _NEG_INF / 2
        rank = ops.concatenate(
            [ops.where(real_finished, finished_score, 2 * _NEG_INF), alive_score + _NEG_INF / 4], axis=1
        )
        _, keep = ops.top_k(rank, num_hypotheses)
        hypotheses = gather_beams(ops.concatenate([finished_seq, sequences], axis=1), keep)
        scores = ops.take_along_axis(ops.concatenate([finished_score, alive_score], axis=1), keep, axis=1)
        return hypotheses[:, :, 1:], scores
    use_finished = finished_score[:, 0] > _NEG_INF / 2
    best = ops.where(use_finished[:, None], finished_seq[:, 0], sequences[:, 0])
    score = ops.where(use_finished, finished_score[:, 0], alive_score[:, 0])
    return best[:, 1:], score


class _Banned:
    """Sets the logits of tokens a search never produces to -inf: `[PAD]` and `[START]`
    always, `[END]` before `min_length` tokens."""

    def __init__(self, start_id, end_id, pad_id, min_length):
        self.start_id, self.end_id, self.pad_id, self.min_length = start_id, end_id, pad_id, min_length

    def __call__(self, logits, index):
        logits = ops.cast(logits, "float32")
        vocab = ops.arange(ops.shape(logits)[-1])
        banned = ops.logical_or(vocab == self.pad_id, vocab == self.start_id)
        if self.min_length:
            banned = ops.logical_or(banned, ops.logical_and(vocab == self.end_id, index + 1 < self.min_length))
        return ops.where(banned[None, :], _NEG_INF, logits)
