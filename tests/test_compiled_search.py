"""`translate` runs the search compiled for the backend (`jax.jit`, XLA, or on PyTorch
programs exported with `torch.export`): the same tokens as the eager search
(`compile=False`), with the weights of the moment, from several threads at once, and
eagerly with one warning when compiling fails. On PyTorch, `jit_compile=True` trains
eagerly with one warning (Keras' `torch.compile` path is slower than eager here)."""

import contextlib
import threading
import time
import warnings

import keras
import numpy as np
import pytest

import keras_transformer as kt
from keras_transformer.backend.compile import CompileFailedWarning
from keras_transformer.tools.evaluation import quantize_model
from tests.conftest import BACKEND, randomize_weights, run_in_threads, to_numpy

torch_only = pytest.mark.skipif(
    BACKEND != "torch",
    reason="PyTorch's own paths: torch.export programs, torch.compile, and jit_compile=True trained eagerly; "
    "JAX and TensorFlow compile the whole search with XLA and their jit_compile=True is Keras' XLA step",
)
V = 11


def _model(seed, cls=None):
    model = (cls or kt.models.Transformer)(vocab_size=V, num_layers=2, d_model=16, num_heads=2, d_ff=32, dropout=0.0)
    model.build()
    randomize_weights(model, seed, scale=0.6)
    return model


SOURCE = np.array([[4, 5, 6, 7, 1], [6, 6, 4, 0, 0], [9, 10, 0, 0, 0]], "int32")


def _compiled_translate(model, source, *args, **kwargs):
    """`model.translate` compiled: on PyTorch a shape's first search runs eagerly and its
    second exports the programs, so the search is run twice and the second is returned."""
    if BACKEND == "torch":
        model.translate(source, *args, **kwargs)
    return model.translate(source, *args, **kwargs)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_compiled_search_gives_the_eager_search_tokens(beam_size):
    model = _model(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled, compiled_scores = _compiled_translate(model, SOURCE, beam_size, max_length=5, return_scores=True)
        eager, eager_scores = model.translate(SOURCE, beam_size, max_length=5, return_scores=True, compile=False)
    # Not a word: the searches read a tensor's truth and NumPy reads token ids itself (Keras'
    # conversion on PyTorch warned of NumPy 2's `copy` at every call and, eagerly, every token).
    assert [str(w.message) for w in caught] == []
    np.testing.assert_array_equal(to_numpy(compiled, "int32"), to_numpy(eager, "int32"))
    np.testing.assert_allclose(to_numpy(compiled_scores), to_numpy(eager_scores), atol=1e-5)
    # A second input of the same shape reuses the compiled search and still follows its input.
    other = SOURCE[::-1].copy()
    np.testing.assert_array_equal(
        to_numpy(model.translate(other, beam_size, max_length=5), "int32"),
        to_numpy(model.translate(other, beam_size, max_length=5, compile=False), "int32"),
    )


def test_compiled_search_uses_weights_set_after_compilation():
    model, other = _model(0), _model(1)
    before = to_numpy(_compiled_translate(model, SOURCE, 2, max_length=7), "int32")
    expected = to_numpy(other.translate(SOURCE, 2, max_length=7, compile=False), "int32")
    assert not np.array_equal(before, expected)  # the two models differ, so the check can fail
    model.set_weights(other.get_weights())
    np.testing.assert_array_equal(to_numpy(model.translate(SOURCE, 2, max_length=7), "int32"), expected)


def test_a_model_quantized_after_translating_searches_with_its_int8_weights():
    model = _model(0)
    _, before = _compiled_translate(model, SOURCE, 2, max_length=4, return_scores=True)
    quantize_model(model, "int8")  # Keras' model.quantize: every Dense kernel int8, with its scale
    _, after = _compiled_translate(model, SOURCE, 2, max_length=4, return_scores=True)
    _, eager = model.search(SOURCE, 4, beam_size=2)  # the same search, uncompiled, on the variables of now
    assert np.abs(to_numpy(before) - to_numpy(eager)).max() > 1e-3  # int8 changes the scores: the check can fail
    np.testing.assert_allclose(to_numpy(after), to_numpy(eager), atol=1e-4)


def test_quantizing_frees_the_float_kernels_and_leaves_the_collector_as_it_was():
    import gc
    import weakref

    model = _model(0)
    kernels = [weakref.ref(w) for w in model.weights if w.path.endswith("/kernel")]
    assert kernels and gc.get_freeze_count() == 0
    quantize_model(model, "int8")
    assert gc.get_freeze_count() == 0  # nothing left set aside
    assert [k for k in kernels if k() is not None] == []  # the float kernels are gone
    assert all(w.dtype == "int8" for w in model.weights if w.path.endswith("/kernel"))
    # A process that freezes objects itself keeps its frozen ones.
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        quantize_model(_model(1), "int8")
        assert gc.get_freeze_count() > frozen // 2 > 0  # still frozen (less the few freed meanwhile)
    finally:
        gc.unfreeze()


def test_models_quantized_in_two_threads_are_quantized_one_at_a_time():
    """The collector's frozen set and the warning filters `quantize_model` changes are the
    process's: two threads (a server loading two runs) quantize one after the other."""
    import gc

    at_once = _AtOnce(pause=0.2)

    class StandIn:  # Keras' `quantize`, slowly, with the warning `quantize_model` hides
        quantize = staticmethod(at_once.counted(lambda mode: warnings.warn(
            "Layer LayerNormalization does not have a `quantize` method implemented.")))

    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as shown:
        assert run_in_threads(lambda i: quantize_model(StandIn(), "int8"), count=2) == []
    assert at_once.most == 1 and shown == [] and warnings.filters == filters and gc.get_freeze_count() == 0


@pytest.mark.parametrize("beam_size", [1, 2])
def test_four_threads_translate_with_one_model(beam_size):
    # Every thread starts at once on a new model, so the search is also compiled while the
    # others wait for it; 20 calls each, on three inputs of one shape.
    model = _model(3)
    inputs = [SOURCE, SOURCE[::-1].copy(), np.roll(SOURCE, 1, axis=1)]
    expected = [to_numpy(model.translate(x, beam_size, max_length=6, compile=False), "int32") for x in inputs]
    assert not np.array_equal(expected[0], expected[1])  # a mixed-up answer would show
    results = []

    def work(worker):
        for call in range(20):
            which = (worker + call) % 3
            results.append((which, to_numpy(model.translate(inputs[which], beam_size, max_length=6), "int32")))

    assert run_in_threads(work) == []
    assert len(results) == 80
    for which, tokens in results:
        np.testing.assert_array_equal(tokens, expected[which])
    if BACKEND == "torch":  # the threads ran the exported programs too, not only eager searches
        (search,) = model._searches.values()
        assert len(search.compiled.programs) == 2


@torch_only
def test_two_models_exporting_in_two_threads_each_export_and_leave_the_warning_filters(monkeypatch):
    """Two models (a server with two language pairs) export their programs in two threads
    at once: torch.export runs in one at a time, both get their programs (in two threads
    together both exports failed, pytorch/pytorch#105943, and both searched eagerly), and the
    process's warning filters are what they were."""
    import torch

    models = [_model(0), _model(1)]
    expected = [to_numpy(m.translate(SOURCE, 1, max_length=4, compile=False), "int32") for m in models]
    at_once = _AtOnce(pause=0.1)
    monkeypatch.setattr(torch.export, "export", at_once.counted(torch.export.export))
    filters, results = list(warnings.filters), {}

    def work(i):  # each thread's second search exports its model's programs
        results[i] = [to_numpy(models[i].translate(SOURCE, 1, max_length=4), "int32") for _ in range(2)]

    assert run_in_threads(work, count=2) == []
    for i in range(2):
        for tokens in results[i]:
            np.testing.assert_array_equal(tokens, expected[i])
        assert len(models[i]._searches) == 1 and len(next(iter(models[i]._searches.values())).compiled.programs) == 2
    assert at_once.most == 1  # one export at a time: each put back the filters it found
    assert warnings.filters == filters


class _BranchingTransformer(kt.models.Transformer):
    """A model whose step reads a tensor's value in Python: no engine can compile it."""

    def step(self, token_ids, cache, index):
        logits, cache = super().step(token_ids, cache, index)
        if float(keras.ops.convert_to_numpy(keras.ops.max(logits))) > 1e30:  # never, but it must be read
            logits = -logits
        return logits, cache


def test_a_search_that_cannot_be_compiled_runs_eagerly_with_one_warning():
    model = _model(4, cls=_BranchingTransformer)
    expected = to_numpy(model.translate(SOURCE, 2, max_length=4, compile=False), "int32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = to_numpy(model.translate(SOURCE, 2, max_length=4), "int32")
        second = to_numpy(model.translate(SOURCE, 2, max_length=4), "int32")
    failed = [w for w in caught if issubclass(w.category, CompileFailedWarning)]
    assert len(failed) == 1, [str(w.message) for w in caught]
    assert "runs eagerly" in str(failed[0].message) and "Reason: " in str(failed[0].message)
    np.testing.assert_array_equal(first, expected)
    np.testing.assert_array_equal(second, expected)


class _NonzeroTransformer(kt.models.Transformer):
    """A model whose step makes a tensor of data-dependent shape (always empty here)."""

    def step(self, token_ids, cache, index):
        logits, cache = super().step(token_ids, cache, index)
        picked = keras.ops.nonzero(keras.ops.greater(logits, 1e30))[0]
        return logits + keras.ops.cast(keras.ops.size(picked), logits.dtype), cache


@torch_only
def test_an_export_that_fails_on_a_data_dependent_shape_prints_no_graph(capsys):
    """torch.export printed the partial graph of the failed export on stderr, twice (640 lines
    for this 1-block model), before the one warning that gives the reason."""
    model = _model(4, cls=_NonzeroTransformer)
    expected = to_numpy(model.translate(SOURCE, 2, max_length=4, compile=False), "int32")
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the second search of a shape exports
            np.testing.assert_array_equal(to_numpy(model.translate(SOURCE, 2, max_length=4), "int32"), expected)
    failed = [str(w.message) for w in caught if issubclass(w.category, CompileFailedWarning)]
    assert len(failed) == 1 and "runs eagerly" in failed[0] and "data-dependent" in failed[0], failed
    assert "def forward" not in capsys.readouterr().err


class _NoisyTransformer(kt.models.Transformer):
    """A model whose step draws random numbers (zero noise here): the draw reads the seed
    generator's state as a Python number, which an export cannot."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.noise = keras.random.SeedGenerator(1)

    def step(self, token_ids, cache, index):
        logits, cache = super().step(token_ids, cache, index)
        return logits + 0.0 * keras.random.normal(keras.ops.shape(logits), seed=self.noise), cache


@torch_only
def test_a_step_that_draws_random_numbers_runs_eagerly_with_only_its_warning(capfd):
    """PyTorch's symbolic-shapes logger also wrote `W... Unable to find user code corresponding
    to {u0}` on stderr (through a handler of its own), a line beside the one warning."""
    import logging

    model = _model(4, cls=_NoisyTransformer)
    expected = to_numpy(model.translate(SOURCE, 2, max_length=4, compile=False), "int32")
    logged = logging.Handler()
    logged.emit = lambda record: records.append(record.getMessage())
    records, torch_logger = [], logging.getLogger("torch.fx.experimental.symbolic_shapes")
    torch_logger.addHandler(logged)  # beside PyTorch's own handler, which writes to stderr
    capfd.readouterr()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CompileFailedWarning)
            for _ in range(2):  # the second search of a shape exports
                np.testing.assert_array_equal(to_numpy(model.translate(SOURCE, 2, max_length=4), "int32"), expected)
    finally:
        torch_logger.removeHandler(logged)
    failed = [str(w.message) for w in caught if issubclass(w.category, CompileFailedWarning)]
    assert len(failed) == 1 and "runs eagerly" in failed[0], failed
    assert records == [] and capfd.readouterr().err == "", records


@torch_only
def test_only_the_exporting_threads_stderr_is_held_and_only_the_graph_is_dropped(capsys):
    import sys

    from keras_transformer.backend.export_output import without_failure_dumps

    class Failed(Exception):
        partial_fx_graph = "def forward(self): ..."

    inside, written = threading.Event(), threading.Event()

    def other():
        inside.wait()
        sys.stderr.write("another thread's line\n")  # while the export runs
        written.set()

    thread = threading.Thread(target=other)
    thread.start()
    with pytest.raises(Failed):
        with without_failure_dumps():
            sys.stderr.write("export's own warning\n")
            inside.set()
            written.wait(10)
            assert capsys.readouterr().err == "another thread's line\n"  # not held
            print(Failed.partial_fx_graph, file=sys.stderr)
            raise Failed()
    thread.join()
    assert capsys.readouterr().err == "export's own warning\n"  # the graph dropped, the rest written
    assert not type(sys.stderr).__name__ == "_Stderr"


@torch_only
def test_only_the_exporting_threads_shape_records_are_held_and_dropped_if_it_fails():
    import logging

    from keras_transformer.backend.export_output import without_failure_dumps

    logger, records = logging.getLogger("torch.fx.experimental.symbolic_shapes"), []
    logged = logging.Handler()
    logged.emit = lambda record: records.append(record.getMessage())
    logger.addHandler(logged)
    try:
        for fails in (False, True):
            records.clear()
            with contextlib.suppress(RuntimeError), without_failure_dumps():
                logger.warning("about u0")
                thread = threading.Thread(target=logger.warning, args=("another thread's",))
                thread.start()
                thread.join()
                assert records == ["another thread's"]  # not held
                if fails:
                    raise RuntimeError("could not guard on u0")
            assert records == ["another thread's"] + ([] if fails else ["about u0"])
    finally:
        logger.removeHandler(logged)
    assert logger.filters == []


def test_running_out_of_memory_is_raised_and_the_search_stays_compiled():
    # A batch too large for the machine made the model's search eager for good (a server's
    # one large request, and every request after it ran eagerly), after running out again.
    from keras_transformer.backend.compile import _EagerFallback

    def compiled(source_ids):
        if source_ids == "large":
            try:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 12288000000 bytes")
            except RuntimeError as cause:
                raise RuntimeError("Exception encountered when calling MultiHeadAttention.call().") from cause
        if source_ids == "branching":
            raise TypeError("a tensor's value read in Python")
        return "compiled"

    search = _EagerFallback(compiled, lambda source_ids, while_loop: "eager", "search")
    with pytest.raises(RuntimeError, match="MultiHeadAttention"):
        search("large")
    assert search.failure is None and search("small") == "compiled"
    with pytest.warns(CompileFailedWarning, match="Reason: TypeError: a tensor's value read in Python"):
        assert search("branching") == "eager"  # what compiling cannot do: eager from then on
    assert search("small") == "eager"


def test_each_backends_out_of_memory_error_is_told_from_a_bug():
    from keras_transformer.backend.compile import out_of_memory

    errors = []
    if BACKEND == "tensorflow":
        # Provoked, it costs the allocator's 10 s of retries: TensorFlow's own class, by name.
        import tensorflow as tf

        errors.append(tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[274877906944]"))
    else:  # 1 TiB: XLA's and PyTorch's CPU allocators refuse at once
        with pytest.raises(Exception) as refused:
            keras.ops.ones((2**38,))
        errors.append(refused.value)
    if BACKEND == "torch":
        import torch

        errors.append(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"))
    for error in errors:
        assert out_of_memory(error), repr(error)
    assert out_of_memory(ValueError("Exception encountered when calling Dense.call(): shapes differ")) is None


def test_compile_accepts_true_false_or_torch_compile_on_pytorch():
    model = _model(0)
    with pytest.raises(ValueError, match="Received: compile='xla'"):
        model.translate(SOURCE, 1, max_length=4, compile="xla")
    if BACKEND != "torch":
        with pytest.raises(ValueError, match="on PyTorch, 'torch.compile'"):
            model.translate(SOURCE, 1, max_length=4, compile="torch.compile")


@torch_only
def test_torch_compile_gives_the_eager_search_tokens():
    model = _model(5)
    # With a sentence of padding only: its cross-attention may attend to no key.
    source = np.concatenate([SOURCE, np.zeros((1, SOURCE.shape[1]), "int32")])
    # Beam search: its scores (log-probabilities) follow every attention weight.
    expected, expected_scores = model.translate(source, 2, max_length=5, compile=False, return_scores=True)
    expected = to_numpy(expected, "int32")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFailedWarning)  # a fallback would hide a failure
        got, scores = _compiled_translate(model, source, 2, max_length=5, compile="torch.compile", return_scores=True)
    np.testing.assert_array_equal(to_numpy(got, "int32"), expected)
    np.testing.assert_allclose(to_numpy(scores), to_numpy(expected_scores), atol=1e-5)
    # The decoding step's four attentions (self and cross, two layers) were written out
    # for Inductor; the encoder call's keep PyTorch's fused kernel.
    (search,) = model._searches.values()
    assert sorted(p.attentions_written_out for p in search.compiled.programs.values()) == [0, 4]
    # The compiled programs (Inductor's C++ wrapper) serve several threads at once.
    results = []

    def work(worker):
        for _ in range(5):
            results.append(to_numpy(model.translate(source, 2, max_length=5, compile="torch.compile"), "int32"))

    assert run_in_threads(work) == [] and len(results) == 20
    for tokens in results:
        np.testing.assert_array_equal(tokens, expected)


def _count_torch_compilations(monkeypatch) -> list:
    """`torch.compile` with a backend that records each compilation (its number of inputs)
    and runs the graph as it is, instead of Inductor (whose C++ takes seconds per program)."""
    import torch

    compiled, real_compile = [], torch.compile

    def counting(graph, example_inputs):
        compiled.append(len(example_inputs))
        return graph.forward

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: real_compile(fn, backend=counting, dynamic=False,
                                                                            fullgraph=True))
    return compiled


@torch_only
def test_torch_compile_compiles_each_program_once(monkeypatch):
    """A beam search's first loop variables hold one tensor twice, its later ones never do;
    Dynamo guards on which arguments are one tensor, and compiled the loop's iteration again
    at the second iteration (Inductor's C++: seconds). Here a backend that only counts."""
    compiled = _count_torch_compilations(monkeypatch)
    model = _model(5)
    for _ in range(2):
        got = _compiled_translate(model, SOURCE, 2, max_length=5, compile="torch.compile")
    np.testing.assert_array_equal(to_numpy(got, "int32"),
                                  to_numpy(model.translate(SOURCE, 2, max_length=5, compile=False), "int32"))
    assert len(compiled) == 2, compiled  # the encoder call and the loop's iteration


@torch_only
def test_four_threads_translate_through_torch_compile_with_two_models(monkeypatch):
    """`compile="torch.compile"` from a threaded server with two models: Dynamo's frames are
    entered by four threads, while the programs are exported and compiled. Dynamo is not
    safe in two threads at once (pytorch/pytorch#105943; with Inductor, about one run in
    four of this failed and fell back to eager), so these searches take turns. A backend
    that counts stands in for Inductor (whose C++ takes seconds per program here)."""
    compiled = _count_torch_compilations(monkeypatch)
    models = [_model(4), _model(6)]
    inputs = [SOURCE, SOURCE[::-1].copy(), np.roll(SOURCE, 1, axis=1)]
    expected = [[to_numpy(m.translate(x, 2, max_length=6, compile=False), "int32") for x in inputs] for m in models]
    at_once = _AtOnce()
    for model in models:  # a shape's first search (eager) made, then each search counted while it runs
        model.translate(SOURCE, 2, max_length=6, compile="torch.compile")
        (search,) = model._searches.values()
        search.compiled.search = at_once.counted(search.compiled.search)
    results = []

    def work(worker):
        for call in range(4):
            which = (worker + call) % 3
            tokens = models[worker % 2].translate(inputs[which], 2, max_length=6, compile="torch.compile")
            results.append((worker % 2, which, to_numpy(tokens, "int32")))

    assert run_in_threads(work) == []
    assert len(results) == 16
    for model, which, tokens in results:
        np.testing.assert_array_equal(tokens, expected[model][which])
    assert len(compiled) == 4, compiled  # each program compiled once, however many threads reached it
    assert at_once.most == 1  # one search at a time


class _AtOnce:
    """Counts how many calls of the functions it wraps run at one moment; `most`: the most
    at once. Each call waits `pause` seconds first, for the others to come in."""

    def __init__(self, pause: float = 0.02):
        self.pause, self.inside, self.most, self._lock = pause, 0, 0, threading.Lock()

    def counted(self, fn):
        def call(*args, **kwargs):
            with self._lock:
                self.inside += 1
                self.most = max(self.most, self.inside)
            time.sleep(self.pause)
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.inside -= 1

        return call


@torch_only
def test_attention_written_out_computes_what_pytorchs_fused_kernel_does():
    import torch

    from keras_transformer.backend.torch_graph import attention_as_math

    class Attentions(torch.nn.Module):
        def forward(self, q1, q3, k, v, mask):
            attend = torch.nn.functional.scaled_dot_product_attention
            additive = torch.where(mask[:, :, :1], 0.0, -1e9)  # how Keras passes a mask
            return (attend(q1, k, v, attn_mask=additive, scale=0.3),  # one query: a decoding step's
                    attend(q1, k, v, attn_mask=mask[:, :, :1], is_causal=False, dropout_p=0.0),
                    attend(q1, k, v),
                    attend(q3, k, v, attn_mask=mask))  # three queries: kept

    g = torch.Generator().manual_seed(0)
    q1, q3, k, v = (torch.randn(shape, generator=g) for shape in ((3, 2, 1, 4), (3, 2, 3, 4), (3, 2, 6, 4), (3, 2, 6, 4)))
    mask = torch.rand((3, 1, 3, 6), generator=g) > 0.4
    mask[1] = False  # a sentence whose queries may attend to no key
    mask[2, :, :, 0] = True
    args = (q1, q3, k, v, mask)
    graph = torch.export.export(Attentions(), args).graph_module
    expected = graph(*args)
    assert attention_as_math(graph) == 3
    targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.aten.scaled_dot_product_attention.default) == 1
    got = graph(*args)
    # No key to attend to: the mean of the values with Keras' additive mask, zeros with a boolean one.
    np.testing.assert_allclose(expected[0][1].numpy(), v[1].mean(dim=-2, keepdim=True).numpy(), atol=1e-6)
    assert not expected[1][1].any()
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)


@torch_only
def test_a_shapes_first_search_runs_eagerly_and_its_second_exports():
    # Exporting costs seconds, more than an eager search of a few sentences: a shape used
    # once is never exported, one used again is; every call gives the eager search's tokens.
    model = _model(7)
    expected = to_numpy(model.translate(SOURCE, 2, max_length=5, compile=False), "int32")
    programs = []
    for source in (SOURCE, SOURCE, SOURCE, SOURCE[:2], SOURCE[:2]):
        got = to_numpy(model.translate(source, 2, max_length=5), "int32")
        np.testing.assert_array_equal(got, expected[:len(source)])
        (search,) = model._searches.values()
        programs.append(len(search.compiled.programs))
    assert programs == [0, 2, 2, 2, 4]  # the encoder call and the loop iteration, per shape


@torch_only
def test_exported_programs_take_the_weights_as_arguments():
    import torch

    from keras_transformer.backend import torch_graph

    # Nothing of the model's state is baked in: a program holds no variable's value.
    model = _model(6)
    # Beam search, and greedy search, whose step writes the chosen tokens with one
    # `index_copy` (`_compat.update_along`; `keras.ops.slice_update` on PyTorch copied the
    # tokens and wrote into the copy through index grids: eight operations more per step).
    _compiled_translate(model, SOURCE, 2, max_length=5)
    _compiled_translate(model, SOURCE, 1, max_length=5)
    searches = list(model._searches.values())
    assert [len(search.compiled.programs) for search in searches] == [2, 2]  # the encoder call, one loop iteration
    programs = [program for search in searches for program in search.compiled.programs.values()]
    weights = [to_numpy(v.value) for v in model.variables]
    pointers = {v.value.untyped_storage().data_ptr() for v in model.variables}
    public = torch_graph._public_functions()
    for program in programs:
        # Replayed op by op, each operator through its public function where it has one.
        targets = {node.target for node in program.graph.graph.nodes if node.op == "call_function"}
        assert torch.add in targets and not targets & set(public)
        assert not {t for t in targets if "meshgrid" in str(t) or "index_put" in str(t)}, targets
        # Its own tensors: the scalars Keras made and what `_fold_constants` computed from
        # them (position tables, masks' ranges), none of them a weight or a weight's copy.
        own = [to_numpy(b) for b in program.graph.buffers()]
        assert own and not any(b.untyped_storage().data_ptr() in pointers for b in program.graph.buffers())
        assert not any(b.shape == w.shape and np.array_equal(b, w) for b in own for w in weights)
        # What depends on no input was computed once, not on every call.
        computed = [node for node in program.graph.graph.nodes if node.op == "call_function"]
        assert all(any(x.op != "get_attr" for x in node.all_input_nodes) for node in computed)
        # Nothing computed twice (`merge_repeats`; but for the in-place writes and the copies
        # they write into), from one constant held twice, or permuted and then put back.
        assert program.merged > 0
        writes = [node for node in computed if getattr(node.target, "__name__", "").split(".")[0].endswith("_")]
        pure = [node for node in computed if node not in writes and node not in [w.args[0] for w in writes]]
        # A constant is compared by name: two reads of it are one input.
        keys = [repr((node.target, *torch.fx.node.map_arg((node.args, node.kwargs), _by_name))) for node in pure]
        assert len(set(keys)) == len(keys), sorted(k for k in keys if keys.count(k) > 1)
        assert len({(b.dtype, tuple(b.shape), b.numpy().tobytes()) for b in program.graph.buffers()}) == len(own)
        for node in computed:
            source = node.args[0] if node.target is torch.transpose else None
            assert getattr(source, "target", None) is not torch.permute, node


@torch_only
@pytest.mark.parametrize("beam_size", [1, 2])
def test_translations_can_be_trained_on(beam_size):
    # The search runs in PyTorch's inference mode, whose tensors cannot be saved for a
    # backward pass: what `translate` returns is out of it (back-translation trains on it).
    import torch

    model = _model(0)
    for _ in range(2):  # eager, then the exported programs
        tokens, scores = model.translate(SOURCE, beam_size, max_length=6, return_scores=True)
        assert not tokens.is_inference() and not scores.is_inference()
        weights = torch.ones(V, 3, requires_grad=True)
        (torch.nn.functional.embedding(tokens, weights).sum() + (scores * weights[0, 0]).sum()).backward()
        assert float(weights.grad.sum()) == pytest.approx(3 * tokens.numel() + float(scores.sum()))
    (search,) = model._searches.values()
    assert len(search.compiled.programs) == 2  # the second search ran the exported programs


def _by_name(node):
    return node.target if node.op == "get_attr" else node


@torch_only
def test_a_loop_writes_its_cache_in_place_but_never_into_the_callers_tensors():
    # The cache write of an exported iteration (`index_copy`, a copy of the whole cache
    # for one position) writes into the loop's own tensor: the speed of the search.
    from keras_transformer import _compat
    from keras_transformer.backend.torch_decoding import ExportedSearch

    def search(buffer, call=None, while_loop=None):
        loop = while_loop or keras.ops.while_loop

        def body(i, a, b, total):
            written = _compat.update_along(a, i, keras.ops.ones((2, 1)) * keras.ops.cast(i + 1, "float32"), axis=1)
            total = total + keras.ops.sum(b)  # reads `b` after `a` was written
            return i + 1, written, written, total  # one tensor as two loop variables

        return loop(lambda i, a, b, total: i < 5, body, (0, buffer, keras.ops.zeros((2, 5)), keras.ops.zeros(())))

    buffer = keras.ops.zeros((2, 5))
    exported = ExportedSearch(search, [], eager_calls=0)
    got = exported(buffer)
    expected = search(buffer)
    for x, y in zip(got, expected):
        np.testing.assert_array_equal(to_numpy(x), to_numpy(y))  # `total` differs if `b` was written as `a`
    np.testing.assert_array_equal(to_numpy(buffer), np.zeros((2, 5)))  # the caller's tensor is untouched
    (program,) = exported.programs.values()
    assert program.written == [1]  # `a` is written in place, `b` (read by nothing) is not

    # A loop variable that is a weight (the iteration gives the variable's value back) is
    # copied before it is written: the weights stay as they are.
    weight = keras.Variable(np.zeros((2, 5)), dtype="float32")

    def from_the_weight(buffer, call=None, while_loop=None):
        def body(i, a, total):
            written = _compat.update_along(a, i, keras.ops.ones((2, 1)) * keras.ops.cast(i + 1, "float32"), axis=1)
            return i + 1, keras.ops.convert_to_tensor(weight), total + keras.ops.sum(written)

        return (while_loop or keras.ops.while_loop)(lambda i, a, total: i < 5, body, (0, buffer, keras.ops.zeros(())))

    got = ExportedSearch(from_the_weight, [weight], eager_calls=0)(buffer)
    assert float(to_numpy(got[2])) == float(to_numpy(from_the_weight(buffer)[2])) == 2 * (1 + 2 + 3 + 4 + 5)
    np.testing.assert_array_equal(to_numpy(weight.value), np.zeros((2, 5)))
    # The model's own search: every decoder layer's self-attention keys and values are
    # written in place.
    model = _model(6)
    _compiled_translate(model, SOURCE, 2, max_length=5)
    (model_search,) = model._searches.values()
    loops = [p for p in model_search.compiled.programs.values() if p.written]
    assert len(loops) == 1 and len(loops[0].written) == 2 * model.num_layers


def _bucketed_batches():
    # Three batch signatures, as token-budget bucketing makes them, then the first again.
    rng = np.random.default_rng(3)
    batches = []
    for batch, source_length, target_length in [(6, 5, 7), (3, 9, 10), (12, 4, 5), (6, 5, 7)]:
        x = {
            "source_ids": rng.integers(4, V, (batch, source_length)).astype("int32"),
            "target_ids": rng.integers(4, V, (batch, target_length)).astype("int32"),
        }
        batches.append((x, rng.integers(4, V, (batch, target_length)).astype("int32")))
    return batches


def _compiled(jit_compile):
    keras.utils.set_random_seed(0)
    model = kt.models.Transformer(vocab_size=V, num_layers=2, d_model=16, num_heads=2, d_ff=32, dropout=0.0)
    model.build()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2), loss=kt.losses.LabelSmoothedCrossEntropy(0.1),
        metrics=[kt.metrics.MaskedAccuracy()], jit_compile=jit_compile,
    )
    return model


@torch_only
def test_jit_compile_on_pytorch_warns_once_and_trains_like_the_eager_step():
    eager = _compiled(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = _compiled(True)
        for x, y in _bucketed_batches():
            expected = eager.train_on_batch(x, y, return_dict=True)
            got = compiled.train_on_batch(x, y, return_dict=True)
            np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-4)
            np.testing.assert_allclose(got["accuracy"], expected["accuracy"], rtol=1e-4)
    said = [str(w.message) for w in caught if "jit_compile=True" in str(w.message)]
    assert len(said) == 1 and "keras-team/keras#21851" in said[0] and "eagerly" in said[0]
    assert compiled.jit_compile is False
    for a, b in zip(eager.get_weights(), compiled.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-5)


@torch_only
def test_a_model_saved_with_jit_compile_loads_to_translate_without_a_word(tmp_path):
    # A run trained on JAX or TensorFlow saves jit_compile=True with its compile settings:
    # every `translate` of it on PyTorch printed the warning about training.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compiled(True).save(tmp_path / "model.keras")
        model = keras.saving.load_model(tmp_path / "model.keras")
        model.translate(SOURCE, 1, max_length=3)
        assert [str(w.message) for w in caught if "jit_compile" in str(w.message)] == []
        x, y = _bucketed_batches()[0]
        model.train_on_batch(x, y)  # training starts: said once
        model.train_on_batch(x, y)
    assert len([w for w in caught if "jit_compile=True on PyTorch" in str(w.message)]) == 1


@torch_only
def test_an_exported_loop_follows_a_body_that_changes_shapes_and_exports_a_steady_one_once():
    from keras_transformer.backend.torch_decoding import ExportedSearch

    def search(x, call=None, while_loop=None):
        loop = while_loop or keras.ops.while_loop
        grown = loop(lambda i, y: i < 3, lambda i, y: (i + 1, keras.ops.concatenate([y, y[:1] * 2.0])), (0, x))[1]
        steady = loop(lambda i, y: i < 5, lambda i, y: (i + 1, y * 2.0 + 1.0), (0, x))[1]
        return grown, steady

    x = keras.ops.convert_to_tensor(np.array([1.0, 3.0], "float32"))
    exported = ExportedSearch(search, [], eager_calls=0)
    grown, steady = exported(x)
    expected_grown, expected_steady = search(x)
    np.testing.assert_array_equal(to_numpy(grown), to_numpy(expected_grown))  # [1, 3, 2, 4, 8]
    np.testing.assert_array_equal(to_numpy(steady), to_numpy(expected_steady))
    # Two loops of one name (lambdas in one function) keep their own programs: one per
    # shape the growing body met (three), one for the steady body, reused for its five steps.
    assert len(exported.programs) == 4
