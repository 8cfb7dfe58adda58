"""The searches a Transformer runs: `search` (traceable) and `translate` (compiled, cached).

`Translating` is a part of `Transformer` kept in its own module: the model's layers,
training and serialization are in `transformer.py`, what turns its decoding step into
output ids is here. It needs from the model `init_cache`, `step`, `uncached_step`,
`encode`, the special ids and `_searches` (the model's cache of compiled searches).
"""

from __future__ import annotations

import os
import re

import keras
import numpy as np
from keras import ops

from keras_transformer import _checks, decoding
from keras_transformer import ops as kt_ops
from keras_transformer.backend.compile import compile_search
from keras_transformer.defaults import BEAM_SIZE, LENGTH_PENALTY, MAX_EXTRA_LENGTH


def first_search_length(source_length):
    """The output room `translate` (and an exported translator) searches with first:
    `S + max(16, S // 2)` for sources `S` tokens wide. An int, or a tensor for a tensor."""
    if isinstance(source_length, int):
        return source_length + max(16, source_length // 2)
    return source_length + ops.maximum(16, source_length // 2)


def _integer_ids(source_ids):
    """`source_ids` as a tensor, refused unless its dtype is an integer one. A list or a
    NumPy array is checked before the backend converts it: strings or objects fail
    differently inside each backend's conversion (a NumPy array is a tensor to Keras' numpy
    backend, whose dtype names have no string kinds)."""
    if ops.is_tensor(source_ids) and not isinstance(source_ids, np.ndarray):
        dtype = keras.backend.standardize_dtype(source_ids.dtype)
        integer = "int" in dtype
    else:
        try:
            source_ids = np.asarray(source_ids)
        except ValueError:  # NumPy's "inhomogeneous shape": rows of different lengths
            raise ValueError("`source_ids` must be a (batch, length) array: rows of one length, the shorter ones "
                             "padded with the model's pad_id. Received rows of different lengths") from None
        dtype = source_ids.dtype
        integer = dtype.kind in "iu"
    if not integer:
        raise ValueError(f"`source_ids` must be integer token ids. Received: dtype={dtype}")
    return ops.convert_to_tensor(source_ids)


class Translating:
    """`search` and `translate` for `Transformer` (see there)."""

    def search(
        self,
        source_ids,
        max_length,
        beam_size: int = BEAM_SIZE,
        length_penalty: float = LENGTH_PENALTY,
        min_length: int = 0,
        use_cache: bool = True,
        num_hypotheses: int = 1,
        *,
        call=None,
        while_loop=None,
        bound_length=None,
        return_complete: bool = False,
        greedy_scores: bool = True,
    ):
        """Greedy (`beam_size=1`) or beam search, traceable: the body of `translate`.

        `max_length` may be a tensor (the exporter traces it from the input's length).
        Returns `(tokens (B, max_length), scores (B,))`, the scores `log P / lp`; with
        `greedy_scores=False` a greedy search computes none (one log-softmax per step
        less) and its scores are zeros. With `num_hypotheses=n > 1` (beam search),
        `(B, n, max_length)` and `(B, n)`.
        `bound_length` and `return_complete` (a third result) are the searches' own,
        see `keras_transformer.decoding.beam_search`.

        `call(fn, *args)` runs the encoder call (defaults to `fn(*args)`) and
        `while_loop` the search's loop (defaults to `keras.ops.while_loop`): the two
        places where PyTorch's compiled search runs exported programs instead
        (`keras_transformer.backend.torch_decoding`).
        """
        if not ops.is_tensor(max_length):  # a tensor is the exporter's, traced
            max_length = _checks.positive_ints(max_length=max_length)
        beam_size, num_hypotheses = _checks.beam(beam_size, num_hypotheses, self.vocab_size)
        use_cache = _checks.flags(use_cache=use_cache)
        source_ids = ops.convert_to_tensor(source_ids, "int32")
        call = call or (lambda fn, *args: fn(*args))
        if use_cache:
            step, cache = self.step, call(self.init_cache, source_ids, max_length)
        else:
            encoder_output, source_mask = call(self.encode, source_ids)
            step, cache = self.uncached_step, {"encoder_output": encoder_output, "source_mask": source_mask}
        batch = ops.shape(source_ids)[0]
        special = dict(start_id=self.start_id, end_id=self.end_id, pad_id=self.pad_id, min_length=min_length)
        if beam_size == 1:
            result = decoding.greedy_search(step, cache, batch, max_length, while_loop=while_loop, return_complete=True,
                                            return_scores=greedy_scores, length_penalty_alpha=length_penalty, **special)
            if not greedy_scores:
                result = result[0], ops.zeros((batch,), "float32"), result[1]
        else:
            result = decoding.beam_search(
                step, cache, batch, max_length, beam_size=beam_size, length_penalty_alpha=length_penalty,
                num_hypotheses=num_hypotheses, while_loop=while_loop, bound_length=bound_length,
                return_complete=True, **special,
            )
        return result if return_complete else result[:2]

    def translate(
        self,
        source_ids,
        beam_size: int = BEAM_SIZE,
        length_penalty: float = LENGTH_PENALTY,
        max_extra_length: int = MAX_EXTRA_LENGTH,
        *,
        max_length: int | None = None,
        min_length: int = 0,
        use_cache: bool = True,
        return_scores: bool = False,
        num_hypotheses: int = 1,
        compile: bool | str = True,
    ):
        """Beam search (section 6.1): the best output ids for each source row.

        The search is compiled for the backend (`jax.jit`, XLA-compiled `tf.function`;
        on PyTorch its encoder call and one loop iteration are exported with
        `torch.export` and replayed) once per batch size, length and setting, and kept
        with the model (the last 8). One model may translate from several threads at
        once.

        Every step reads and reorders a cache as long as the longest output allowed,
        and most outputs end long before it: the search runs first with room for
        `S + max(16, S // 2)` tokens (if `min_length` fits), under the stopping rule
        of the full length. If it ended in time (every output finished, and no live
        hypothesis could still win), that is the full search's result; otherwise the
        full search runs.

        Args:
            source_ids: Integer `(B, S)`, padded with `pad_id`.
            beam_size: Defaults to `4` (the paper). `1` is greedy decoding.
            length_penalty: alpha >= 0 of the GNMT penalty `((5 + |Y|) / 6)^alpha`.
                Defaults to `0.6` (the paper).
            max_extra_length: Longest output = `S + max_extra_length`. Defaults to `50`.
            max_length: Longest output, instead of `S + max_extra_length`.
            min_length: No `[END]` before this many tokens. Defaults to `0`.
            use_cache: Use the KV cache. `False` re-runs the decoder over the whole
                prefix at every step (same tokens, slower: for checks and benchmarks).
            return_scores: Also return the `(B,)` scores `log P / lp`, for greedy
                search too (what a beam of one scores).
            num_hypotheses: n, the size of the n-best list per row, at most
                `beam_size`. Defaults to `1`.
            compile: Run the compiled search. `False` runs the same search eagerly,
                op by op, on every backend (same tokens; a way out when compiling
                fails). A search that cannot be compiled also runs eagerly, with one
                warning naming the reason. On PyTorch, `"torch.compile"` also compiles
                the exported programs with `torch.compile` (faster steps, seconds of
                compilation per shape; see `keras_transformer.backend.torch_decoding`).
                Defaults to `True`.

        Returns:
            Integer `(B, max_length)`: output tokens, `[END]`, then `pad_id`; and the
            scores if `return_scores`. With `num_hypotheses=n > 1`: `(B, n, max_length)`
            best first, and `(B, n)` scores.

        Raises:
            MemoryError: For a model on the CPU, when the cached search's buffer
                (`B x beam_size x max_length` positions of every decoder layer's keys and
                values) would need more than the machine's memory.
        """
        if keras.backend.backend() == "openvino":  # it failed inside: "An OpenVINOKerasTensor is symbolic"
            raise NotImplementedError("`translate` does not run on Keras' openvino backend: its tensors are symbolic "
                                      "inside the search. Use tensorflow, jax, torch or numpy")
        beam_size, num_hypotheses = _checks.beam(beam_size, num_hypotheses, self.vocab_size)
        use_cache, return_scores = _checks.flags(use_cache=use_cache, return_scores=return_scores)
        source_ids = _integer_ids(source_ids)
        if len(source_ids.shape) != 2:
            raise ValueError(f"`source_ids` must be (batch, length). Received: shape={tuple(source_ids.shape)}")
        max_length = _checks.positive_ints(max_length=max_length, optional=True)
        max_extra_length, min_length = _checks.counts(max_extra_length=max_extra_length, min_length=min_length)
        batch, width = source_ids.shape
        if width == 0:  # attention over no positions is undefined
            raise ValueError(f"`source_ids` must hold at least one position per row. Received: shape={(batch, 0)}")
        max_length = int(width + max_extra_length if max_length is None else max_length)
        if min_length > max_length:
            raise ValueError(f"`min_length` must be at most the longest output, {max_length}. "
                             f"Received: min_length={min_length}")
        # Greedy search reads the penalty only for its scores (a beam search always scores):
        # only then may it not overflow.
        scored = beam_size > 1 or return_scores
        _checks.length_penalties(length_penalty=length_penalty, max_length=max_length if scored else None)
        if batch == 0:  # nothing to search: empty results of the shapes a search returns
            shape = (0, max_length) if num_hypotheses == 1 else (0, num_hypotheses, max_length)
            tokens, scores = ops.zeros(shape, "int32"), ops.zeros(shape[:-1], "float32")
            return (tokens, scores) if return_scores else tokens
        # Here, not only in the embedding: inside the compiled search the ids cannot be read,
        # and a lookup past the table clamps (JAX) or fails inside the search.
        kt_ops.check_token_ids(source_ids, self.vocab_size, name="source_ids")
        if not self.built:
            self.build()
        mode = "default" if compile is True else compile

        source_ids = ops.cast(source_ids, "int32")
        settings = dict(beam_size=int(beam_size), length_penalty=float(length_penalty), min_length=int(min_length),
                        use_cache=use_cache, num_hypotheses=num_hypotheses, greedy_scores=scored)
        # Most outputs end long before the longest allowed: searching first with a short
        # buffer (what every step reads and reorders) gives the same result when it
        # ends in time, and the full search runs only when it did not.
        first = min(max_length, first_search_length(int(source_ids.shape[1])))
        short = min_length <= first < max_length  # an output must have room for `[END]`
        # A compiled search holds the variables it was made with: a model whose variables
        # were replaced since (`quantize`, LoRA) gets a new one.
        variables = self.variables
        for length in ([first] if short else []) + [max_length]:
            if use_cache:
                self._check_cache_fits(batch, beam_size, length, variables[0])
            tokens, scores, complete = self._run_search(source_ids, length, max_length, settings, compile, mode,
                                                        variables)
            if length == max_length or bool(complete):
                break
        if length < max_length:
            padding = [[0, 0]] * (len(tokens.shape) - 1) + [[0, max_length - length]]
            tokens = ops.pad(tokens, padding, constant_values=self.pad_id)
        return (tokens, scores) if return_scores else tokens

    def _check_cache_fits(self, batch: int, beam_size: int, max_length: int, variable) -> None:
        """Refuse, with `MemoryError`, a search whose self-attention cache alone would not fit
        in the memory of the machine the model runs on, its CPU: on PyTorch the system killed
        the process (the zeros were allocated, and the first steps that read them ended it);
        JAX's error came only when the result was read."""
        if not _on_cpu(variable):  # one of the model's variables: where the model runs
            return
        attentions = [block.self_attention for block in self.decoder.blocks]
        per_position = sum(a.num_heads * (a._key_dim + a._value_dim) * _itemsize(a.compute_dtype) for a in attentions)
        needed, memory = batch * beam_size * max_length * per_position, memory_bytes()
        if memory is not None and needed > memory:
            raise MemoryError(
                f"The search's cache needs {needed / 2**30:.1f} GiB ({batch} x {beam_size} rows (batch x beam) x "
                f"{max_length} positions x {per_position} bytes), more than this machine's {memory / 2**30:.1f} GiB: "
                "ask for a shorter `max_length`, a smaller beam or fewer sentences at once"
            )

    def _run_search(self, source_ids, length, bound_length, settings, compile, mode, variables):
        """`search` with a buffer of `length`, compiled once per settings and `variables`."""
        if compile is False:
            return self.search(source_ids, length, **settings, while_loop=decoding.eager_while_loop,
                               bound_length=bound_length, return_complete=True)

        def make():
            def search(ids, **runner):
                return self.search(ids, length, **settings, bound_length=bound_length, return_complete=True, **runner)

            return compile_search(search, variables, name=f"search of model '{self.name}'", mode=mode)

        key = (length, bound_length, *settings.values(), mode, tuple(map(id, variables)))
        return self._searches.get(key, make)(source_ids)


def memory_bytes() -> int | None:
    """The memory this process may use: the machine's, or its control group's limit if
    lower (a container's); `None` where the system does not say."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def _on_cpu(variable) -> bool:
    try:
        return "cpu" in str(variable.value.device).lower()
    except (AttributeError, ValueError):  # an array over several devices has no one device: not checked
        return False


def _itemsize(dtype: str) -> int:
    return int(re.search(r"\d+", keras.backend.standardize_dtype(dtype)).group()) // 8
