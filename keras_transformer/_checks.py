"""Argument checks shared by the layers, the model, the loss, the searches and the tools'
text functions: one rule, one wording. `where` names the object that refuses (`"Layer 'encoder': "`)."""

from __future__ import annotations

import math
import numbers

import keras
import numpy as np

from keras_transformer.defaults import MAX_INT

_LOG_FLOAT32_MAX = math.log(3.4028234663852886e38)  # the largest float32


def _integers(where: str, minimum: int, kind: str, optional: bool, values: dict):
    """Refuse any value that is not an integer in `[minimum, MAX_INT]` (`None` passes when
    `optional`); `kind` says what is wanted. NumPy's integers count (a size read from an
    array, a sweep over `np.arange`), booleans do not. Returns the values as Python ints,
    in the order given: the value alone for one, a tuple for several."""
    out = []
    for name, value in values.items():
        if optional and value is None:
            out.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
            raise ValueError(f"{where}`{name}` must be {kind}{' or None' if optional else ''}. "
                             f"Received: {name}={value!r}")
        if value > MAX_INT:
            raise ValueError(f"{where}`{name}` must be at most {MAX_INT} (the engines hold sizes and counts in "
                             f"int32). Received: {name}={value!r}")
        out.append(int(value))
    return _returned(out)


def _returned(values: list):
    """The checked values as the check functions return them: one alone, several as a tuple."""
    return values[0] if len(values) == 1 else tuple(values)


def positive_ints(where: str = "", *, optional: bool = False, **values):
    """Refuse any value that is not an integer >= 1 (`None` passes when `optional`); returns
    the values as Python ints (one alone, several as a tuple, in the order given)."""
    return _integers(where, 1, "a positive integer", optional, values)


def flags(where: str = "", **values):
    """Refuse any value that is not a boolean: a setting read from text (`"false"`, `"no"`)
    is true to Python and would silently turn a switch on. NumPy's booleans count.
    Returns the values as Python bools (one alone, several as a tuple)."""
    out = []
    for name, value in values.items():
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{where}`{name}` must be True or False. Received: {name}={value!r}")
        out.append(bool(value))
    return _returned(out)


def window(where: str, value):
    """Refuse a restricted-attention window that is not an integer in `[1, MAX_INT]`
    (`None`, full attention, passes); returns it as a Python int or None."""
    return _integers(where, 1, "an integer >= 1 (the distance r of restricted self-attention)", True,
                     {"window": value})


def counts(where: str = "", **values):
    """Refuse any value that is not an integer >= 0; returns them as Python ints (one
    alone, several as a tuple, in the order given)."""
    return _integers(where, 0, "an integer >= 0", False, values)


def special_ids(where: str, vocab_size: int, **ids) -> tuple:
    """Refuse a special token id that is not an integer in `[0, vocab_size)`, or two
    special ids that are the same (the model's and the tokenizer's reserved ids); returns
    them as Python ints, in the order given."""
    for name, value in ids.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < vocab_size:
            raise ValueError(f"{where}`{name}` must be a token id in [0, vocab_size={vocab_size}). "
                             f"Received: {name}={value!r}")
    ids = {name: int(value) for name, value in ids.items()}
    if len(set(ids.values())) != len(ids):
        raise ValueError(f"{where}the special ids must differ. Received: {ids}")
    return tuple(ids.values())


def rates(where: str = "", **values):
    """Refuse any value outside [0, 1) (dropout rates, label smoothing); returns them as
    Python floats (one alone, several as a tuple, in the order given)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value < 1.0:
            raise ValueError(f"{where}`{name}` must be in [0, 1). Received: {name}={value!r}")
    return _returned([float(value) for value in values.values()])


def length_penalties(where: str = "", *, max_length=None, **values) -> None:
    """Refuse any value that is not a finite real number >= 0 (a NaN or infinite length
    penalty would score every hypothesis NaN, and the search would return any of them; a
    negative one turns the normalisation around and favours the shortest hypotheses; the
    command line refuses it too). With `max_length` (a Python int), also a value whose
    penalty `((5 + n) / 6)^alpha` overflows float32 for an output that long: every such
    hypothesis would score 0."""
    for name, value in values.items():
        if not _finite_real(value) or value < 0:
            raise ValueError(f"{where}`{name}` must be a finite number >= 0. Received: {name}={value!r}")
        if isinstance(max_length, int) and value * math.log((5 + max_length) / 6) >= _LOG_FLOAT32_MAX:
            largest = math.floor(10 * _LOG_FLOAT32_MAX / math.log((5 + max_length) / 6)) / 10
            raise ValueError(f"{where}`{name}` makes the length penalty ((5 + n) / 6)^{name} overflow float32 for "
                             f"outputs of up to {max_length} tokens, and every such hypothesis would score 0: use at "
                             f"most {largest}. Received: {name}={value!r}")


def _finite_real(value) -> bool:
    """A real number (not a bool) that a float holds finitely: an integer past float's range
    (`10**400`) is not one, and `math.isfinite` would raise `OverflowError` for it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def numbers_above(where: str, bound: float, **values):
    """Refuse any value that is not a finite real number > `bound`; returns them as Python
    floats (one alone, several as a tuple, in the order given)."""
    for name, value in values.items():
        if not _finite_real(value) or value <= bound:
            raise ValueError(f"{where}`{name}` must be a finite number > {bound}. Received: {name}={value!r}")
    return _returned([float(value) for value in values.values()])


def positive_numbers(where: str = "", **values):
    """Refuse any value that is not a finite real number > 0 (a scale, an epsilon); returns
    them as Python floats."""
    return numbers_above(where, 0, **values)


def labels_and_logits(where: str, y_true, y_pred) -> None:
    """Refuse labels whose shape is not the logits' less their last axis (`(B, T)` for
    `(B, T, V)`), where both shapes are known: targets not cut to the logits' length, or
    one-hot labels, would otherwise fail inside the backend with its own message. Refuse
    labels outside `[0, V)` where their values are on the host (eager): PyTorch read the
    log-probability of such a label modulo V (pytorch/pytorch#196106), and -1 as the last class's."""
    labels, logits = tuple(y_true.shape), tuple(y_pred.shape)
    if len(labels) != len(logits) - 1 or any(a is not None and b is not None and a != b
                                             for a, b in zip(labels, logits)):
        raise ValueError(f"{where}the labels must be shaped like the logits less their last axis ((B, T) for "
                         f"(B, T, V)). Received: y_true.shape={labels}, y_pred.shape={logits}")
    classes, readable = logits[-1], concrete_values(y_true, from_device=False)
    if classes is not None and readable is not None and readable.size:
        low, high = (int(v) if float(v).is_integer() else float(v) for v in (readable.min(), readable.max()))
        if low < 0 or high >= classes:
            raise ValueError(f"{where}the labels must be token ids in [0, {classes}) (the logits' last axis). "
                             f"Received: min={low}, max={high}")


def cache_position(where: str, cache_index, new_positions, cache_length) -> None:
    """Refuse a cache position that is not an integer, or (a Python integer, with the
    lengths known) whose `new_positions` written from it would not fit in the cache's
    `cache_length` positions: JAX clamped such a write into the cache without a word, and
    PyTorch wrote at a float position's integer part."""
    if hasattr(cache_index, "dtype"):
        dtype = keras.backend.standardize_dtype(cache_index.dtype)
        if "int" not in dtype:
            raise ValueError(f"{where}`cache_index` must be an integer. Received: dtype={dtype}")
        return
    if isinstance(cache_index, bool) or not isinstance(cache_index, numbers.Integral):
        raise ValueError(f"{where}`cache_index` must be an integer. Received: cache_index={cache_index!r}")
    if cache_index < 0 or None not in (new_positions, cache_length) and cache_index + new_positions > cache_length:
        raise ValueError(f"{where}`cache_index` must leave room for the {new_positions} new position(s) in a cache of "
                         f"{cache_length} positions: in [0, {cache_length} - {new_positions}]. "
                         f"Received: cache_index={cache_index}")


def largest_beam(vocab_size: int) -> int:
    """The largest beam a search over `vocab_size` tokens can keep: each step takes the
    top-k of `beam_size * vocab_size` candidates, whose indices are int32 on every backend
    (JAX refuses a larger top-k; TensorFlow and PyTorch run out of memory first)."""
    return max(1, MAX_INT // vocab_size)


def beam(beam_size, num_hypotheses, vocab_size: int | None = None) -> tuple[int, int]:
    """Refuse a beam size below 1 (or, given `vocab_size`, above `largest_beam`) or a number
    of hypotheses outside [1, beam_size]; returns both as Python ints."""
    beam_size = positive_ints(beam_size=beam_size)
    if vocab_size is not None and beam_size > largest_beam(vocab_size):
        raise ValueError(f"`beam_size` times the vocabulary size must be at most {MAX_INT} (the search's top-k "
                         f"indexes beam_size x vocab_size candidates in int32): at most {largest_beam(vocab_size)} "
                         f"for vocab_size={vocab_size}. Received: beam_size={beam_size}")
    if (isinstance(num_hypotheses, bool) or not isinstance(num_hypotheses, numbers.Integral)
            or not 1 <= num_hypotheses <= beam_size):
        raise ValueError(
            f"`num_hypotheses` must be an integer in [1, beam_size={beam_size}]. "
            f"Received: num_hypotheses={num_hypotheses!r}"
        )
    return beam_size, int(num_hypotheses)


def texts(value, name: str = "texts") -> list:
    """`value` as a list of texts (`str` or `bytes`). A bare string is refused, since as a
    sequence it would be taken for one text per character, and so is anything else that
    is not a sequence of texts (`None`, a number, a list holding one)."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"`{name}` must be a list of strings; for one text, pass [text]. Received: {value!r:.60}")
    try:
        value = list(value)
    except TypeError:
        raise TypeError(f"`{name}` must be a list of strings. Received: {value!r:.60}") from None
    wrong = next(((i, t) for i, t in enumerate(value) if not isinstance(t, (str, bytes))), None)
    if wrong is not None:
        raise TypeError(f"`{name}` must be strings. Received: {name}[{wrong[0]}]={wrong[1]!r:.60}")
    # TensorFlow's strings are UTF-8: a str with lone surrogates (bytes of another encoding
    # decoded with surrogateescape) failed inside it, and invalid UTF-8 bytes translated to "".
    for i, text in enumerate(value):
        try:
            text.decode("utf-8") if isinstance(text, bytes) else text.encode("utf-8")
        except UnicodeError as e:
            raise ValueError(f"`{name}` must be UTF-8 text. Received: {name}[{i}]={text!r:.60} ({e.reason} at "
                             f"position {e.start})") from None
    return value


def boolean_mask(where: str, name: str, mask):
    """`mask` as booleans, `True` = may attend (booleans, or 0 and 1, or ids: not 0). A
    float mask with other values, where they can be read, is refused: an additive mask
    (0 = attend, a large negative number = not: PyTorch's float `attn_mask`) read as
    booleans would attend exactly where it forbids."""
    if not keras.backend.is_float_dtype(getattr(mask, "dtype", "bool")):
        return keras.ops.cast(mask, "bool")
    values = concrete_values(mask, from_device=False)
    if values is not None and values.size and not np.isin(values, (0, 1)).all():
        raise ValueError(
            f"{where}`{name}` must be boolean, `True` = may attend (or 0 and 1). Received: a float mask with "
            f"values from {values.min():g} to {values.max():g}; an additive mask (0 = attend, a large negative "
            f"number = not) says the opposite here: pass `{name}=mask == 0`."
        )
    return keras.ops.cast(mask, "bool")


def concrete_values(x, from_device: bool = True):
    """`x` as a NumPy array where its values exist (eager), else `None`: a traced tensor
    (`jax.jit`, `tf.function`, a `KerasTensor`, TorchDynamo's tracing) has none. With
    `from_device=False`, also `None` for a tensor NumPy cannot read where it is (a PyTorch
    tensor on a GPU), whose copy would wait for the work queued on the device."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, keras.KerasTensor) or torch_compiling():
        return None
    try:  # NumPy reads a CPU tensor of any backend where it is
        return np.asarray(x)
    except Exception:  # noqa: BLE001 - tracers and graph tensors have no values.
        pass
    if not from_device or not hasattr(x, "numpy"):  # a tracer or a graph tensor has no values to read
        return None
    try:  # a tensor NumPy cannot read where it is (a PyTorch tensor on a GPU)
        return np.asarray(keras.ops.convert_to_numpy(x))
    except Exception:  # noqa: BLE001 - PyTorch's fake tensors while exporting have no values.
        return None


def torch_compiling() -> bool:
    """Whether TorchDynamo is tracing (`torch.compile`, Keras' `jit_compile=True` on
    PyTorch): reading a tensor's values there broke the graph at every layer that checks
    its ids, and would wait for the device at every step."""
    if keras.backend.backend() != "torch":
        return False
    import torch

    return torch.compiler.is_compiling()
