"""Clean-up passes on the graphs `torch.export` records, public `torch.fx` operations only.

`keras_transformer.backend.torch_decoding` runs them on each exported program before it
replays it (each saves a Python call per op and step, or a copy):

* `own_constants_as_attributes`: the constants export lifted to inputs become the
  graph's own tensors, so that its inputs are the weights and the arguments only;
* `drop_no_ops`: the `.to()` calls Keras makes on tensors that already have the dtype
  and the metadata assertions non-strict export adds for each (about 700 of a tiny
  step's 870 nodes), and the `contiguous()` copies of the cache Keras' attention makes
  for PyTorch's attention, which reads any strides, and the permutation of the cache
  Keras' attention makes and PyTorch's attention undoes;
* `fold_constants`: what depends on no input (the step's position table, the masks'
  ranges, the constants export copies on every call) computed once;
* `merge_repeats`: what a graph computes twice from the same inputs (each layer's copy
  of a step's masks and positions) computed once, by torch.fx's common subexpression
  elimination;
* `write_in_place`: a loop's cache write (`index_copy`, which copies the whole cache
  to change one position) made in place into the loop's own tensors, never into a
  tensor the caller still holds or one another loop variable shares;
* `call_public_functions`: for the graphs replayed without Inductor, each ATen operator
  overload called through the public `torch` function that dispatches to it (one C call,
  not the Python `__call__` of `torch.ops`);
* `attention_as_math`: for `torch.compile` only, a decoding step's attention (one query
  per sentence) written as the products and the softmax it computes, which Inductor
  fuses with what surrounds them, in place of PyTorch's fused attention kernel.
"""

from __future__ import annotations

__all__ = ["attention_as_math", "call_public_functions", "drop_no_ops", "fold_constants", "merge_repeats",
           "own_constants_as_attributes", "write_in_place"]


def drop_no_ops(graph) -> None:
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
    # Keras' attention makes its transposed keys and values contiguous: a copy of the
    # whole cache per layer and step. PyTorch's attention reads any strides.
    attention = torch.ops.aten.scaled_dot_product_attention.default
    for node in list(graph.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.contiguous.default and all(
            user.op == "call_function" and user.target is attention for user in node.users
        ):
            node.replace_all_uses_with(node.args[0])
    # Keras keeps a cache as (batch, heads, length, depth), its attention permutes it to
    # (batch, length, heads, depth) and PyTorch's attention back: two views per use.
    for node in list(graph.graph.nodes):
        source = node.args[0] if node.op == "call_function" and node.target is torch.ops.aten.transpose.int else None
        if getattr(source, "target", None) is torch.ops.aten.permute.default:
            order = list(source.args[1])
            first, second = (axis % len(order) for axis in node.args[1:3])
            order[first], order[second] = order[second], order[first]
            if order == list(range(len(order))):
                node.replace_all_uses_with(source.args[0])
    _drop_unused(graph)


def merge_repeats(graph):
    """One node for each computation a graph repeats on the same inputs (a decoding
    step's masks and positions, made again by each layer): torch.fx's common
    subexpression elimination (`CSEPass`). Returns the graph to use (a new one when
    nodes merged) and how many call nodes it saved.

    The pass assumes a functional graph. A write in place (an ATen operator whose name
    ends in an underscore) is allowed into a tensor only it reads (a decoding step
    writes the chosen tokens into a `clone`): neither the write nor what makes its
    tensor is merged. A graph with another write is returned as it is, and so is every
    graph if a PyTorch release moves the pass (torch.fx marks it not backward compatible;
    `test_exported_programs_take_the_weights_as_arguments` then fails)."""
    try:
        from torch.fx.passes.dialect.common.cse_pass import CSEPass, get_CSE_banned_ops
    except ImportError:
        return graph, 0

    calls = [node for node in graph.graph.nodes if node.op == "call_function"]
    writes = [node for node in calls if _is_aten_op(node.target) and node.target.name().split(".")[0].endswith("_")]
    written = [node.args[0] for node in writes]
    if not all(_read_once_new(x) for x in written):
        return graph, 0
    # The pass compares arguments by node, and export gives each use of a constant a read
    # (`get_attr`) of its own: one read per buffer, so that the second layer's masks, made
    # from the same constants as the first's, are merged with them.
    read = {}
    for node in list(graph.graph.nodes):
        if node.op == "get_attr" and read.setdefault(node.target, node) is not node:
            node.replace_all_uses_with(read[node.target])
            graph.graph.erase_node(node)
    banned = get_CSE_banned_ops() | {node.target.overloadpacket for node in writes + written}
    merged = CSEPass(banned_ops=banned)(graph).graph_module
    merged.recompile()
    return merged, len(calls) - sum(node.op == "call_function" for node in merged.graph.nodes)


def own_constants_as_attributes(graph, program) -> None:
    """Make the program's own tensors (the constants export lifted to inputs) attributes
    of the graph, so that its inputs are the values and the arguments only."""
    import torch

    kinds = torch.export.graph_signature.InputKind
    constants = {**program.state_dict, **program.constants}
    placeholders = [node for node in graph.graph.nodes if node.op == "placeholder"]
    first = next(node for node in graph.graph.nodes if node.op != "placeholder")
    for node, spec in zip(placeholders, program.graph_signature.input_specs):
        if spec.kind == kinds.USER_INPUT:
            continue
        node.replace_all_uses_with(_attribute(graph, constants[spec.target], before=first))
        graph.graph.erase_node(node)
    graph.recompile()


def _attribute(graph, value, before):
    """A new node, placed before `before`, reading `value` kept as a buffer of the graph;
    a buffer equal to `value` (dtype, shape, elements) is reused, so that equal constants
    are one input to `merge_repeats`."""
    import torch

    name = next((key for key, buffer in graph.named_buffers() if buffer.dtype == value.dtype
                 and buffer.shape == value.shape and torch.equal(buffer, value)), None)
    if name is None:
        name = f"constant_{len(list(graph.buffers()))}"
        graph.register_buffer(name, value)
    with graph.graph.inserting_before(before):
        return graph.graph.get_attr(name)


def fold_constants(graph, max_elements: int = 1 << 20) -> None:
    """Compute once what depends on no input: a step's position table, its masks'
    `arange`s, the constants export copies on every call (`lift_fresh_copy`). Each
    result (a tensor of at most `max_elements`) becomes an attribute of the graph."""
    import torch

    known = {node: getattr(graph, node.target) for node in graph.graph.nodes if node.op == "get_attr"}
    for node in graph.graph.nodes:
        if node.op != "call_function" or not _is_aten_op(node.target):
            continue
        if node.is_impure() or torch.Tag.nondeterministic_seeded in node.target.tags:
            continue
        inputs = node.all_input_nodes
        if not all(x in known for x in inputs):
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda x: known[x])
        value = node.target(*args, **kwargs)
        if isinstance(value, torch.Tensor) and value.numel() <= max_elements:
            known[node] = value
    for node, value in known.items():
        if node.op == "get_attr" or all(user in known for user in node.users):
            continue
        node.replace_all_uses_with(_attribute(graph, value, before=node))
    _drop_unused(graph)


def write_in_place(graph, values_count: int) -> list[int]:
    """Make `index_copy` (a cache write: a copy of the whole cache, to change one
    position) write in place where nothing else reads the tensor it copies: an
    intermediate result of an op that returns new memory, or an argument tensor.
    Returns the positions, among the argument tensors, of those written into."""
    import torch

    placeholders = [node for node in graph.graph.nodes if node.op == "placeholder"]
    written = []
    for node in graph.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.index_copy.default:
            continue
        source = node.args[0]
        if source.op == "placeholder" and len(source.users) == 1:
            position = placeholders.index(source) - values_count
            if position < 0:  # a weight
                continue
            written.append(position)
        elif not _read_once_new(source):
            continue
        node.target = torch.ops.aten.index_copy_.default
    graph.recompile()
    return written


def _drop_unused(graph) -> None:
    """Nodes without users go, but for the program's inputs and outputs and the ops that
    write into a tensor: the assertions count as side effects to FX and have no users."""
    graph.graph.eliminate_dead_code(
        is_impure_node=lambda node: node.op in ("placeholder", "output")
        or (node.is_impure() and "assert" not in str(node.target))
    )
    graph.recompile()


def _read_once_new(node) -> bool:
    """Whether `node` is an ATen operator's new tensor (not a view of another) that one
    node alone reads: that reader may write into it in place unseen by the rest."""
    return (getattr(node, "op", None) == "call_function" and _is_aten_op(node.target) and not node.target.is_view
            and len(node.users) == 1)


def _is_aten_op(target) -> bool:
    """Whether an FX node's target is an ATen operator overload (what export records),
    which says in its schema whether its result may alias an input (`is_view`)."""
    return hasattr(target, "tags") and hasattr(target, "is_view")


def attention_as_math(graph) -> int:
    """Write each attention of one query (`scaled_dot_product_attention` with a query
    length of 1, no dropout, not causal: a decoding step's) as the operations it
    computes, `softmax(q k^T * scale + mask) v`, for Inductor to compile with what
    surrounds it. Returns how many were rewritten.

    PyTorch's fused attention is one kernel call, fastest where the graph is replayed op
    by op, but Inductor keeps it as an opaque call of its own. `benchmarks/decode.py`'s
    greedy workload under `torch.compile` (tiny, 8 x 64 tokens, 2 CPU cores), ten
    processes alternated: 16,372-17,208 tokens/s written out, 10,089-14,995 with the
    kernel, the same tokens; the exported programs replayed without Inductor lost 8%
    greedy that way, so only `torch.compile`'s programs are rewritten. Attention over many
    queries (the encoder's) keeps the fused kernel, which never forms the scores of every
    pair at once.
    """
    import torch

    attention = torch.ops.aten.scaled_dot_product_attention.default
    rewritten = 0
    for node in graph.graph.nodes:
        if node.op != "call_function" or node.target is not attention:
            continue
        settings = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), node.args), **node.kwargs)
        if (settings["query"].meta["val"].shape[-2] != 1 or settings.get("dropout_p", 0.0) != 0.0
                or settings.get("is_causal") or settings.get("enable_gqa")):
            continue
        node.target = _attention
        rewritten += 1
    graph.recompile()
    return rewritten


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """What `scaled_dot_product_attention` computes without dropout, the softmax in
    float32. A float mask is added to the scores (Keras passes its masks so); with a
    boolean one (`True`: may attend), a query that may attend to no key gets zeros, as
    the fused kernel gives."""
    import torch

    if scale is None:
        scale = query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-2, -1)).float() * scale
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        weights = torch.softmax(torch.where(attn_mask, scores, float("-inf")), dim=-1)
        weights = torch.where(attn_mask, weights, 0.0)  # a row of no key: NaN from the softmax, zeros here
    else:
        weights = torch.softmax(scores if attn_mask is None else scores + attn_mask, dim=-1)
    return torch.matmul(weights.to(value.dtype), value)


def call_public_functions(graph) -> int:
    """Call the ATen operators of a decoding step through the public `torch` functions
    that dispatch to them, with the same arguments: `torch.add` for `aten.add.Tensor`.
    Returns how many nodes changed.

    An exported graph calls `torch.ops.aten.add.Tensor(...)`, whose Python `__call__`
    costs about 2.3 us per call against 1.5 us for `torch.add` (a tiny tensor, 2 CPU
    cores), and a greedy step of the tiny preset makes about 170 such calls. Greedy /
    beam 4 on `benchmarks/decode.py`'s workload, the exported programs, processes
    alternated: 7,234-8,580 / 4,079-4,208 tokens/s with the public functions, 6,644-6,755
    / 3,016-3,610 without, the same tokens. Operators not in the table keep their
    overload.
    """
    table = _public_functions()
    changed = 0
    for node in graph.graph.nodes:
        if node.op == "call_function" and node.target in table:
            node.target = table[node.target]
            changed += 1
    graph.recompile()
    return changed


def _public_functions() -> dict:
    """ATen overloads and the public function that takes the same arguments in the same
    order and computes that overload (`torch.Tensor.to` for `aten.to.dtype`)."""
    import torch

    aten = torch.ops.aten
    return {
        aten.add.Tensor: torch.add, aten.mul.Tensor: torch.mul, aten.matmul.default: torch.matmul,
        aten.reshape.default: torch.reshape, aten.transpose.int: torch.transpose, aten.permute.default: torch.permute,
        aten.unsqueeze.default: torch.unsqueeze, aten.flatten.using_ints: torch.flatten, aten.select.int: torch.select,
        aten.stack.default: torch.stack, aten.index_select.default: torch.index_select,
        aten.embedding.default: torch.embedding, aten.layer_norm.default: torch.layer_norm, aten.relu.default: torch.relu,
        aten.sin.default: torch.sin, aten.cos.default: torch.cos, aten.argmax.default: torch.argmax,
        aten.where.self: torch.where, aten.where.ScalarSelf: torch.where, aten.where.ScalarOther: torch.where,
        aten.logical_and.default: torch.logical_and, aten.logical_or.default: torch.logical_or,
        aten.logical_not.default: torch.logical_not, aten.lt.Scalar: torch.lt, aten.lt.Tensor: torch.lt,
        aten.ge.Tensor: torch.ge, aten.ge.Scalar: torch.ge, aten.eq.Scalar: torch.eq, aten.eq.Tensor: torch.eq,
        aten.ne.Tensor: torch.ne, aten.ne.Scalar: torch.ne, aten.greater_equal.Tensor: torch.greater_equal,
        aten.not_equal.Tensor: torch.not_equal, aten.to.dtype: torch.Tensor.to,
        aten.scaled_dot_product_attention.default: torch.nn.functional.scaled_dot_product_attention,
    }
