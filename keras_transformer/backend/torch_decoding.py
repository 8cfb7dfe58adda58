"""PyTorch decoding on `torch.export`: the encoder call and one loop iteration, exported.

Eager PyTorch runs a decoding step through Keras' Python layer by layer, op by op: most
of a small model's decoding time. Here two functions of a search are exported with
`torch.export.export` (non-strict: the Python of Keras runs once, on fake tensors, and
the ATen operations it performs are kept) and the exported programs are replayed:

* the encoder call (`Transformer.init_cache`): the source through the encoder, and the
  decoder's precomputed encoder-decoder keys and values;
* one iteration of the search's loop: the model's decoding step, the search's
  bookkeeping (top-k, reordering the cache, finished hypotheses), then the loop's
  condition on the result. The loop itself is Python: one call of the exported program
  and one read of a boolean per token.

Exporting the step alone is not enough (`benchmarks/decode.py`'s workload, tiny, 8 x 64
tokens, 2 CPU cores: eager 1,002 / 753 tokens/s greedy / beam 4, the step exported 4,032 /
1,482): the bookkeeping's thirty-odd Keras ops per step cost as much as the model.

Each exported program takes the model's weights as arguments (`keras.StatelessScope`
maps the variables to them while exporting), so it holds no state: weights changed
after export (training, `load_weights`) are used, and any number of threads can run one
program at once. Programs are kept per function and per shapes and dtypes of the
arguments, in the `ExportedSearch` of one model and one setting. The exported graphs run
as `torch.fx.GraphModule`s, called directly with flat tensors, after the clean-up passes
of `keras_transformer.backend.torch_graph` (no-op conversions dropped, constants folded,
a loop's cache written in place, repeated computations merged, each operator called
through its public `torch` function): each saves Python per op and step, or a copy.

Exporting costs more than an eager search of a few sentences (three sentences x 40 tokens,
beam 4, 2 CPU cores: `tiny` 1.0 s eager against 4.6 s exported at the first call, `small`
1.6 s against 5.9 s), so the first search of an input shape runs eagerly and the second
exports: a shape used once never pays for an export, one used again pays at most one
eager search more.

When exporting fails (a layer that branches on a tensor's value, an op export does not
know), `keras_transformer.backend.compile` runs the search eagerly, with one warning
naming the reason, and it gives the same tokens (the partial graph `torch.export` prints
on stderr for a failure on a data-dependent value is dropped). `Transformer.translate(...,
compile=False)` asks for the eager search directly.

`translate(..., compile="torch.compile")` also compiles each exported program with
`torch.compile` (Inductor with its C++ wrapper: a step's ~50 kernels are called from C++,
not from generated Python), the attention of a decoding step written out as the products
and the softmax it computes (`torch_graph.attention_as_math`: Inductor fuses them; it keeps
PyTorch's fused attention as a call of its own). In three runs of `benchmarks/decode.py` on
the workload above (the last with the searches in inference mode): 17,165 / 7,782, 13,320 /
7,727 and 18,182 / 8,060 tokens/s (greedy / beam 4) against 9,840 / 4,473, 9,854 / 3,469 and
10,333 / 5,424 for the exported programs and 873 / 718, 925 / 708 and 962 / 750 eager (JAX:
32,382 / 7,266, 31,848 / 8,687 and 30,127 / 8,807); greedy in ten processes
alternated, 16,372-17,208 with the attention written out and 10,089-14,995 without. But
a shape's first two searches take seconds of compilation on 2 CPU cores with Inductor's
caches cold (the benchmark's shape: 25-26 s greedy, then 12 s beam 4, whose encoder call is
the greedy search's program; about 5 s once its on-disk cache holds the programs), against
3 s to export. The exported programs are the default. Dynamo is not safe in two threads at
once, so the searches of this mode run one at a time in a process (see
`_PT2_ONE_AT_A_TIME`); the default mode's run in any number of threads.

AOTInductor (`torch._inductor.aoti_compile_and_package` on the same cleaned programs,
re-exported, the weights still arguments), measured once beside the modes above on the
same workload, one process each, medians of 7 (greedy / beam 4 tokens/s; JAX 29,846 /
7,021; exported 10,240 / 4,036; `torch.compile` 15,839 / 4,806): called as its package
loader returns it, 10,196 / 7,000 (each call loads the program's input and output specs
again and flattens its arguments in Python: a greedy step's whole gain); called through
`loader.boxed_run`, a `torch._C` binding, 18,868 / 6,015. Its compilation took 48-55 s
for a greedy and a beam search (a shape's second search 24-37 s). Not used: the default
cannot wait that long for a shape, and its fast call is a private binding.

On a GPU, the same tokens in every mode, but a step of a small model is launch-bound, and
`torch.compile`'s CUDA graphs refused these programs: `docs/guides/backends.md` has the figures.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import warnings

import keras

from keras_transformer.backend.export_output import without_failure_dumps
from keras_transformer.backend.torch_graph import (
    attention_as_math,
    call_public_functions,
    drop_no_ops,
    fold_constants,
    merge_repeats,
    own_constants_as_attributes,
    write_in_place,
)
from keras_transformer.decoding import eager_while_loop


class ExportedSearch:
    """A search whose encoder call and loop iteration run as exported programs.

    Args:
        search: `search(source_ids, *, call=None, while_loop=None)`, see
            `keras_transformer.backend.compile.compile_search`.
        variables: The variables the search reads, passed to every exported program.
        torch_compile: Also compile each exported program with `torch.compile`
            (Inductor, default mode, C++ wrapper). Faster steps, but seconds of compilation per
            program shape.
        max_programs: Exported programs kept (per function and argument shapes).
        eager_calls: Calls of each source shape that run eagerly before its programs are
            exported (default 1: the second search of a shape exports; 0 exports on the
            first).

    Call arguments:
        source_ids: Integer `(B, S)`.

    Returns:
        What `search` returns. Raises what `torch.export` raised if a function cannot
        be exported (`compile_search` then runs the search eagerly).
    """

    def __init__(self, search, variables, torch_compile: bool = False, max_programs: int = 16,
                 eager_calls: int = 1):
        from keras_transformer.backend.compile import FunctionCache

        self.search = search
        self.variables = list(variables)
        self.torch_compile = torch_compile
        self.programs = FunctionCache(max_entries=max_programs)
        self.eager_calls = eager_calls
        # A call counter per recent source shape (4 x max_programs of them), each made once;
        # `next` on an `itertools.count` is one C call, atomic under the GIL.
        self._calls = FunctionCache(max_entries=4 * max_programs)

    def __call__(self, source_ids):
        import torch

        calls = next(self._calls.get(_signature(source_ids), lambda: itertools.count(1)))
        # Inference mode, not only `no_grad`: none of a step's ~130 operations keeps a
        # version counter or a view's record (a greedy search ~10% faster). Its tensors can
        # never enter autograd, so the results leave it as clones: a user may train on them.
        with torch.inference_mode(), (_PT2_ONE_AT_A_TIME if self.torch_compile else contextlib.nullcontext()):
            if calls <= self.eager_calls:  # a shape not seen enough: eager
                result = self.search(source_ids, while_loop=eager_while_loop)
            else:
                run = _Run(self, [v.value for v in self.variables])  # the weights of this moment
                result = self.search(source_ids, call=run.call, while_loop=run.while_loop)
        return keras.tree.map_structure(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, result)

    def program(self, kind, fn, args, loop: bool = False):
        """The exported program of `fn` for arguments of these shapes, made once.

        `kind` names the function: its code objects, so that two functions of one name
        (two lambdas) never share a program, while a closure made anew by every search
        call does. Values a function captures are part of the search's settings, which
        an `ExportedSearch` is made for."""
        key = (kind, _signature(args))
        return self.programs.get(key, lambda: self._export(fn, args, loop))

    def _export(self, fn, args, loop=False):
        import torch

        # Distinct copies: export follows tensors by identity, and one tensor passed as two
        # arguments (a beam search's first finished and live hypotheses) would become one
        # input of the program.
        leaves = [x.clone() if isinstance(x, torch.Tensor) else x for x in keras.tree.flatten(args)]
        # A loop's iteration writes its new keys and values into the cache it is given
        # (the loop owns it), unless Inductor compiles the graph: it has its own pass.
        program = _Program(fn, self.variables, args, leaves, in_place=loop and not self.torch_compile)
        if self.torch_compile:
            # A step's attention as operations Inductor fuses; its C++ wrapper: the kernels
            # called from C++, not from generated Python.
            program.attentions_written_out = attention_as_math(program.graph)
            program.graph = torch.compile(program.graph, dynamic=False, fullgraph=True, options={"cpp_wrapper": True})
        else:  # replayed op by op: each through its public function, one C call
            call_public_functions(program.graph)
        return program


class _Program:
    """`fn` exported for arguments shaped like `args`: called with the variables' values
    and arguments of that structure, it returns what `fn` would, as new tensors.

    The exported graph is called directly, with flat tensors (the values, then the
    argument leaves); `keras.tree` flattens the arguments and packs the results.
    (`ExportedProgram.module()` would check the inputs' structure and shapes again on
    every call: a third of a tiny model's step.) Before it runs, the graph is cleaned
    by the passes of `torch_graph`: no-op conversions dropped (`drop_no_ops`), what
    depends only on constants computed once (`fold_constants`), what it computes twice
    computed once (`merge_repeats`) and, with
    `in_place=True`, the cache writes made in place (`write_in_place`).

    Args:
        in_place: The graph may write into the argument tensors it overwrites anyway
            (a decoding loop's cache, `index_copy`): `run(..., owned=True)` then says
            the caller gives those tensors up; otherwise they are copied first.
    """

    def __init__(self, fn, variables, args, leaves, in_place: bool = False):
        import torch

        static = [x for x in leaves if not isinstance(x, torch.Tensor)]
        tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        outputs = []

        class Flat(torch.nn.Module):
            def forward(self, values, tensors):
                call_leaves = list(static)
                for i, x in zip(tensor_at, tensors):
                    call_leaves.insert(i, x)
                with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                    out = fn(*keras.tree.pack_sequence_as(args, call_leaves))
                outputs.append(keras.tree.map_structure(lambda _: 0, out))
                return tuple(keras.tree.flatten(out))

        values = [v.value.detach() for v in variables]
        tensors = [leaves[i] for i in tensor_at]
        with _PT2_ONE_AT_A_TIME, warnings.catch_warnings():
            # Keras' own notices while its Python runs on fake tensors; export's warnings
            # (a Python value baked into the graph) stay on.
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")
            with without_failure_dumps():
                program = torch.export.export(Flat(), (values, tensors), strict=False)
        self.output_structure = outputs[-1]
        if any(spec.kind != torch.export.graph_signature.OutputKind.USER_OUTPUT
               for spec in program.graph_signature.output_specs):
            raise ValueError("the function writes into its inputs")
        self.graph = program.graph_module
        own_constants_as_attributes(self.graph, program)
        drop_no_ops(self.graph)
        fold_constants(self.graph)
        self.graph, self.merged = merge_repeats(self.graph)
        self.written = write_in_place(self.graph, len(values)) if in_place else []
        self.attentions_written_out = 0  # see `torch_graph.attention_as_math`

    def __call__(self, values, *args):
        """`fn(*args)` with the variables' values `values`."""
        import torch

        tensors = [x for x in keras.tree.flatten(args) if isinstance(x, torch.Tensor)]
        return keras.tree.pack_sequence_as(self.output_structure, list(self.run(values, tensors)))

    def run(self, values, tensors, owned: bool = False, held=frozenset()):
        """The graph on flat tensors; returns its flat outputs. With `owned`, the caller
        gives up `tensors` (the graph may write into them) but for those sharing memory
        with another of them or with `held` (the storages of `values`)."""
        if self.written:
            tensors = list(tensors)
            # Each tensor's memory read once: a search's loop asks this at every token.
            storages = [_storage(x) for x in tensors] if owned else []
            for i in self.written:
                if not owned or storages[i] in held or storages.count(storages[i]) > 1:
                    tensors[i] = tensors[i].clone()
        return self.graph(*values, *tensors)


# `torch.export`, and Dynamo (which runs a `torch.compile`d graph and compiles it at its
# first call), are not safe in two threads at once (pytorch/pytorch#105943, "PT2 is not
# thread safe"). Two models exporting together in two threads each failed ("Trying to pop
# empty mode stack", "We found a fake tensor in the exported program constant's list") and
# searched eagerly from then on. With `compile="torch.compile"`, four threads of two models
# failed now and then ("torch.compile with fullgraph=True found no compiled frames", about
# one run in four), even with only the compiled graphs' calls taken in turn (the other
# threads' eager first searches ran meanwhile); and Dynamo compiled a graph once per
# thread that entered before its first compilation was done (four threads: seven
# compilations of a beam search's two programs instead of two). `warnings.catch_warnings`
# around an export also saves and puts back the process's warning filters, which two at
# once would leave with the other's `ignore` filters. So exports, and the searches of
# `compile="torch.compile"` (each whole), run one at a time in a process; the exported
# graphs of the default mode, plain `torch.fx` code, run in any number of threads at once.
_PT2_ONE_AT_A_TIME = threading.RLock()


def _storage(x) -> int:
    return x.untyped_storage().data_ptr()


class _Run:
    """The `call` and `while_loop` of one search call: the programs of `search`, fed
    with the weights read at the start of this call (nothing is stored on the shared
    `ExportedSearch` but the programs)."""

    def __init__(self, search: ExportedSearch, values):
        self.search, self.values = search, values

    def call(self, fn, *args):
        """`fn(*args)`, exported once per argument shapes."""
        return self.search.program(fn.__code__, fn, args)(self.values, *args)

    def while_loop(self, cond, body, loop_vars):
        """`keras.ops.while_loop(cond, body, loop_vars)`: "`body`, then `cond` of its
        result" exported once per loop-variable shapes, replayed until `cond` is false."""
        loop_vars = tuple(keras.tree.map_structure(keras.ops.convert_to_tensor, tuple(loop_vars)))
        if not bool(cond(*loop_vars)):
            return loop_vars

        def iteration(*loop_vars):
            new = tuple(body(*loop_vars))
            return new, cond(*new)

        kind = (body.__code__, cond.__code__)
        program = self.search.program(kind, iteration, loop_vars, loop=True)
        held = {_storage(x) for x in self.values}
        tensors = _distinct(keras.tree.flatten(loop_vars))
        flat = program.run(self.values, tensors, held=held)
        new_vars, keep_going = keras.tree.pack_sequence_as(program.output_structure, list(flat))
        if _signature(new_vars) != _signature(loop_vars):
            # Outputs shaped unlike the inputs: each iteration finds its own program.
            while bool(keep_going):
                program = self.search.program(kind, iteration, new_vars)
                new_vars, keep_going = program(self.values, *new_vars)
            return new_vars
        # A search's loop: the same program every iteration, fed its own flat outputs
        # (the loop's own tensors, so its cache is written in place), no lookup per token.
        while bool(keep_going):
            flat = program.run(self.values, flat[:-1], owned=True, held=held)
            keep_going = flat[-1]
        return keras.tree.pack_sequence_as(loop_vars, list(flat[:-1]))


def _distinct(tensors: list) -> list:
    """`tensors`, each repetition of one tensor replaced by a copy. A search's first loop
    variables may hold one tensor twice (a beam search's first finished and live
    hypotheses), its later ones never do: `torch.compile` guards on which arguments are
    the same tensor and would compile the iteration a second time for the second call."""
    seen, out = set(), []
    for x in tensors:
        out.append(x.clone() if id(x) in seen else x)
        seen.add(id(x))
    return out


def _signature(args):
    """Hashable shapes, dtypes and structure of a nest of tensors and Python values."""
    leaves = keras.tree.flatten(args)
    structure = keras.tree.map_structure(lambda _: 0, args)
    return (
        repr(structure),
        tuple((tuple(x.shape), str(x.dtype), str(x.device)) if hasattr(x, "shape") else ("static", x) for x in leaves),
    )
