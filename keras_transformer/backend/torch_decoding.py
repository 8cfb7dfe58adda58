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

Exporting the step alone is not enough: measured with `benchmarks/decode.py`'s workload
(tiny preset, 8 sentences x 64 tokens, 2 CPU cores), eager 1,002 / 753 tokens/s (greedy /
beam 4), the exported step with the search's bookkeeping eager 4,032 / 1,482; the
bookkeeping's thirty-odd Keras ops per step cost as much as the model.

Each exported program takes the model's weights as arguments (`keras.StatelessScope`
maps the variables to them while exporting), so it holds no state: weights changed
after export (training, `load_weights`) are used, and any number of threads can run one
program at once. Programs are kept per function and per shapes and dtypes of the
arguments, in the `ExportedSearch` of one model and one setting. The exported graphs run
as `torch.fx.GraphModule`s, called directly with flat tensors, after one clean-up with
public `torch.fx` operations (`_drop_no_ops`): the `.to()` calls Keras makes on tensors
that already have the dtype, and the metadata assertions non-strict export adds for each
(about 700 of a tiny step's 870 nodes, each a Python call per step).

When exporting fails (a layer that branches on a tensor's value, an op export does not
know), `keras_transformer.backend.compile` runs the search eagerly, with one warning
naming the reason, and it gives the same tokens. `Transformer.translate(...,
compile=False)` asks for the eager search directly.

`translate(..., compile="torch.compile")` also compiles each exported program with
`torch.compile` (Inductor). In one run of `benchmarks/decode.py` on the workload above:
9,375 / 4,612 tokens/s (greedy / beam 4) against 4,150 / 2,027 for the exported programs
alone and 768 / 789 eager (JAX: 24,864 / 8,370), but 16-20 s of Inductor compilation per
program shape on 2 CPU cores, against 1-2 s to export. The exported programs are the
default; on a GPU, `torch.compile`'s `reduce-overhead` mode (CUDA graphs) removes the
per-step launch cost. (A `make_fx` record replayed as TorchScript, which this module
replaces, measured 14,604 / 6,158 on the same workload; TorchScript is no longer
developed, and that recorder shared state between threads.)
"""

from __future__ import annotations

import warnings

import keras


class ExportedSearch:
    """A search whose encoder call and loop iteration run as exported programs.

    Args:
        search: `search(source_ids, *, call=None, while_loop=None)`, see
            `keras_transformer.backend.compile.compile_search`.
        variables: The variables the search reads, passed to every exported program.
        torch_compile: Also compile each exported program with `torch.compile`
            (Inductor; `mode="reduce-overhead"`, CUDA graphs, on a GPU). Faster
            steps, but seconds of compilation per program on a CPU.
        max_programs: Exported programs kept (per function and argument shapes).

    Call arguments:
        source_ids: Integer `(B, S)`.

    Returns:
        What `search` returns. Raises what `torch.export` raised if a function cannot
        be exported (`compile_search` then runs the search eagerly).
    """

    def __init__(self, search, variables, torch_compile: bool = False, max_programs: int = 16):
        from keras_transformer.backend.compile import FunctionCache

        self.search = search
        self.variables = list(variables)
        self.torch_compile = torch_compile
        self.programs = FunctionCache(max_entries=max_programs)

    def __call__(self, source_ids):
        import torch

        values = [v.value for v in self.variables]  # the weights of this moment
        run = _Run(self, values)
        with torch.no_grad():
            return self.search(source_ids, call=run.call, while_loop=run.while_loop)

    def program(self, kind, fn, args):
        """The exported program of `fn` for arguments of these shapes, made once.

        `kind` names the function: its code objects, so that two functions of one name
        (two lambdas) never share a program, while a closure made anew by every search
        call does. Values a function captures are part of the search's settings, which
        an `ExportedSearch` is made for."""
        key = (kind, _signature(args))
        return self.programs.get(key, lambda: self._export(fn, args))

    def _export(self, fn, args):
        import torch

        # Distinct copies: export follows tensors by identity, and one tensor passed as two
        # arguments (a beam search's first finished and live hypotheses) would become one
        # input of the program.
        leaves = [x.clone() if isinstance(x, torch.Tensor) else x for x in keras.tree.flatten(args)]
        program = _Program(fn, self.variables, args, leaves)
        if self.torch_compile:
            on_gpu = any(x.device.type == "cuda" for x in leaves if isinstance(x, torch.Tensor))
            program.graph = torch.compile(program.graph, dynamic=False, fullgraph=True,
                                          mode="reduce-overhead" if on_gpu else None)
        return program


class _Program:
    """`fn` exported for arguments shaped like `args`: called with the variables' values
    and arguments of that structure, it returns what `fn` would, as new tensors.

    The exported graph is called directly, with flat tensors: the program's constants
    (from `ExportedProgram.constants` and `.state_dict`, by the graph signature) and
    the values and argument leaves; `keras.tree` flattens the arguments and packs the
    results. (`ExportedProgram.module()` would check the inputs' structure and shapes
    again on every call: a third of a tiny model's step.)
    """

    def __init__(self, fn, variables, args, leaves):
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
        with warnings.catch_warnings():
            # Keras' own notices while its Python runs on fake tensors; export's warnings
            # (a Python value baked into the graph) stay on.
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            warnings.filterwarnings("ignore", category=FutureWarning, module="copyreg")
            program = torch.export.export(Flat(), (values, tensors), strict=False)
        self.output_structure = outputs[-1]
        kinds = torch.export.graph_signature.InputKind
        constants = {**program.state_dict, **program.constants}
        # The graph's inputs in order: the program's own tensors, then ours (values, tensors).
        self.own = [None if spec.kind == kinds.USER_INPUT else constants[spec.target]
                    for spec in program.graph_signature.input_specs]
        if any(spec.kind != torch.export.graph_signature.OutputKind.USER_OUTPUT
               for spec in program.graph_signature.output_specs):
            raise ValueError("the function writes into its inputs")
        self.graph = program.graph_module
        _drop_no_ops(self.graph)

    def __call__(self, values, *args):
        import torch

        tensors = [x for x in keras.tree.flatten(args) if isinstance(x, torch.Tensor)]
        ours = iter([*values, *tensors])
        flat = self.graph(*(next(ours) if own is None else own for own in self.own))
        return keras.tree.pack_sequence_as(self.output_structure, list(flat))


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
        signature = _signature(loop_vars)
        program = self.search.program(kind, iteration, loop_vars)
        loop_vars, keep_going = program(self.values, *loop_vars)
        # A program's outputs have fixed shapes: if they are its inputs' (a search's
        # loop), the same program runs every later iteration, with no lookup per token.
        same_shapes = _signature(loop_vars) == signature
        while bool(keep_going):
            if not same_shapes:
                program = self.search.program(kind, iteration, loop_vars)
            loop_vars, keep_going = program(self.values, *loop_vars)
        return loop_vars


def _drop_no_ops(graph) -> None:
    """Remove what costs a Python call per step and computes nothing: the `.to()` calls
    Keras makes on tensors that already have the dtype and device (`convert_to_tensor`,
    `cast`), and the metadata assertions non-strict export adds for each (about 700 of
    a tiny model step's 870 nodes). Public `torch.fx` operations only."""
    import torch

    conversions = (torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten.to.device)
    for node in list(graph.graph.nodes):
        if node.op != "call_function" or node.target not in conversions:
            continue
        source, result = node.args[0], node.meta.get("val")
        before = getattr(source, "meta", {}).get("val")
        if isinstance(before, torch.Tensor) and isinstance(result, torch.Tensor) and (
            before.dtype == result.dtype and before.device == result.device
        ):
            node.replace_all_uses_with(source)
    # Nodes without users go, but for the program's inputs and outputs and the ops that
    # write into a tensor: the assertions count as side effects to FX and have no users.
    graph.graph.eliminate_dead_code(
        is_impure_node=lambda node: node.op in ("placeholder", "output")
        or (node.is_impure() and "assert" not in str(node.target))
    )
    graph.recompile()


def _signature(args):
    """Hashable shapes, dtypes and structure of a nest of tensors and Python values."""
    leaves = keras.tree.flatten(args)
    structure = keras.tree.map_structure(lambda _: 0, args)
    return (
        repr(structure),
        tuple((tuple(x.shape), str(x.dtype), str(x.device)) if hasattr(x, "shape") else ("static", x) for x in leaves),
    )
