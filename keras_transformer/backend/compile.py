"""A search compiled for the running backend, and the store of compiled searches.

* JAX: `jax.jit` of a stateless version of the function: the variables' current values
  are arguments, not constants baked into the program, so weights changed after
  compilation (more training, a loaded checkpoint) are used.
* TensorFlow: `tf.function(jit_compile=True, autograph=False)`; variables are read at run time.
* PyTorch: `keras_transformer.backend.torch_decoding.ExportedSearch` (`torch.export`,
  from the second search of an input shape, the first running eagerly; with
  `mode="torch.compile"`, its programs also go through `torch.compile`).

When compiling fails (a layer that branches on a tensor's value, an op an engine does
not know), the search runs eagerly from then on, with one `CompileFailedWarning` naming
the reason: same tokens, slower. Running out of memory is raised as it is (`out_of_memory`
tells it): the eager search needs as much, and the next, smaller batch compiles. Every
compiled function may be called from several threads at once.
"""

from __future__ import annotations

import collections
import re
import threading
import warnings

import keras

from keras_transformer.decoding import eager_while_loop


class CompileFailedWarning(RuntimeWarning):
    """A search could not be compiled and runs eagerly."""


def compile_search(search, variables, name: str = "search", mode: str = "default"):
    """`search(source_ids)` compiled for the running backend, eager if that fails.

    Args:
        search: `search(source_ids, *, call=None, while_loop=None)`: the whole search
            (for example `Transformer.search` with its settings bound). `call` and
            `while_loop` are how PyTorch runs the encoder call and the loop (see
            `torch_decoding`); JAX and TensorFlow compile the search as one program.
        variables: The variables the search reads (the model's).
        name: Names the search in warnings.
        mode: `"default"`, or on PyTorch `"torch.compile"`: the exported programs run
            through `torch.compile` (see `torch_decoding`).

    Returns:
        A function of the source ids, safe to call from several threads.
    """
    backend = keras.backend.backend()
    if mode not in ("default", "torch.compile") or (mode == "torch.compile" and backend != "torch"):
        raise ValueError(
            f"`compile` must be True, False or, on PyTorch, 'torch.compile'. Received: compile={mode!r} "
            f"on the {backend} backend"
        )
    return _EagerFallback(_compiled(search, variables, mode, backend), search, name)


def _compiled(search, variables, mode, backend):
    if backend == "jax":
        import jax

        variables = list(variables)

        def stateless(values, source_ids):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return search(source_ids)

        jitted = jax.jit(stateless)
        return lambda source_ids: jitted([v.value for v in variables], source_ids)
    if backend == "tensorflow":
        import tensorflow as tf

        # No AutoGraph: the search is written with `keras.ops` loops and conditions, so
        # converting its Python source (about 1.5 s at a beam search's first call) buys nothing.
        return tf.function(search, jit_compile=True, reduce_retracing=True, autograph=False)
    if backend == "torch":
        from keras_transformer.backend.torch_decoding import ExportedSearch

        return ExportedSearch(search, variables, torch_compile=mode == "torch.compile")
    return search


class _EagerFallback:
    """`compiled(source_ids)`, or `search(source_ids)` eagerly once compiling has failed."""

    def __init__(self, compiled, search, name):
        self.compiled, self.search, self.name = compiled, search, name
        self.failure: str | None = None  # why compiling failed; eager from then on
        self._lock = threading.Lock()

    def __call__(self, source_ids):
        if self.failure is None:
            try:
                return self.compiled(source_ids)
            except Exception as error:  # whatever the engine raised: the eager search decides
                if out_of_memory(error):  # a batch too large for the machine: eagerly too
                    raise
                with self._lock:
                    first, self.failure = self.failure is None, _reason(error)
                if first:
                    warnings.warn(
                        f"keras-transformer: the {self.name} could not be compiled on {keras.backend.backend()} "
                        f"and runs eagerly (same tokens, slower). Reason: {self.failure}",
                        CompileFailedWarning,
                        stacklevel=3,
                    )
        return self.search(source_ids, while_loop=eager_while_loop)


def _reason(error: Exception) -> str:
    """The first line of an error, with its type, and that of its cause."""
    cause = error.__cause__ or error
    lines = str(cause).strip().splitlines() or [""]
    return f"{type(cause).__name__}: {lines[0]}"


def out_of_memory(error: BaseException) -> str | None:
    """What says that `error`, or an error it was raised from, is a backend or Python running
    out of memory (a batch too large for the machine is not a bug), or `None`: Python's
    `MemoryError`, TensorFlow's `ResourceExhaustedError`, PyTorch's `OutOfMemoryError` and
    its CPU allocator's "can't allocate memory", XLA's `RESOURCE_EXHAUSTED: Out of memory`."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        lines = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip().splitlines() or [""]  # less Keras' bold
        said = [line.strip() for line in lines if _OUT_OF_MEMORY.search(line)]
        if said or isinstance(error, MemoryError) or type(error).__name__ in ("ResourceExhaustedError",
                                                                              "OutOfMemoryError"):
            return f"{type(error).__name__}: {(said or lines)[0][:200]}".rstrip(": ")
        error = error.__cause__ or error.__context__
    return None


_OUT_OF_MEMORY = re.compile(r"can't allocate memory|RESOURCE_EXHAUSTED: Out of memory|\bOOM when allocating")


class FunctionCache:
    """A bounded least-recently-used store of compiled functions, owned by one model.

    Keys are the static arguments a function was compiled for (search kind, sizes);
    the oldest entry is dropped past `max_entries`, and all go with the model. Safe to
    use from several threads: a function is made once per key. A plain class rather
    than a `dict`, so that Keras' attribute tracking leaves it alone.
    """

    def __init__(self, max_entries: int = 8):
        self.max_entries = max_entries
        self._functions: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.RLock()

    def get(self, key, make):
        """The function stored under `key`, made by `make()` the first time."""
        with self._lock:
            if key in self._functions:
                self._functions.move_to_end(key)
            else:
                self._functions[key] = make()
                while len(self._functions) > self.max_entries:
                    self._functions.popitem(last=False)
            return self._functions[key]

    def __len__(self) -> int:
        return len(self._functions)

    def keys(self) -> list:
        """The keys stored, oldest first."""
        with self._lock:
            return list(self._functions)

    def values(self) -> list:
        """The stored functions, oldest first."""
        with self._lock:
            return list(self._functions.values())

    def clear(self) -> None:
        with self._lock:
            self._functions.clear()
