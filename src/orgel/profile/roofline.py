"""Block costs for a device not at hand: a roofline per op from the captured FLOPs and bytes.

:func:`estimate_costs` turns a captured :class:`~orgel.graph.opgraph.OpGraph`
(captured on real tensors or on the meta device: only shapes, FLOPs and saved
bytes are read) and a :class:`~orgel.costs.devices.Device` into the same
:class:`~orgel.costs.table.BlockCosts` table that profiling measures, so every
planner and the simulator run unchanged. Per op:

* its class (:func:`op_class`): ``matmul`` (linear, matmul, bmm, conv),
  ``attention`` (SDPA), ``normalization`` (norms, softmax, reductions),
  ``elementwise`` (the rest), or ``free`` (views, no kernel);
* its forward time, the roofline ``max(FLOPs / (peak x eff), bytes / (bandwidth
  x eff))`` with ``eff`` the device's efficiency for the class, peak by the
  op's math mode (``fp32``, or ``tf32`` when asked, ``bf16``, ``fp16``) and
  bytes = inputs + parameters + output;
* its backward: a matmul's input gradient costs one forward per activation
  input that needs a gradient, its weight gradient one forward (the
  ``wgrad`` column); attention's backward 2.5 forwards (flash attention's five
  GEMMs against two); any other op's backward twice its forward traffic, its
  parameters' gradient (a norm's scale, an embedding's table) one forward.

**Float8 linears** (``float8=True``, torchtitan's ``float8.enable_float8_linear``: torchao's
dynamic tensorwise scaling of every ``nn.Linear`` but the output head): a ``linear`` op
with a weight, other than one that makes a model output, runs its three GEMMs (forward,
input gradient, weight gradient) at the device's ``fp8`` peak (the same ``matmul``
efficiency as bf16; measured FP8 GEMMs often reach less, so this is optimistic) with
its operands read at one byte per element, and pays the casts as memory traffic at the
``elementwise`` efficiency. A cast of a bf16 tensor of ``B`` bytes (``B/2`` elements)
is an amax pass (reads ``B``) and the cast (reads ``B``, writes ``B/2``): ``2.5 B``.
Forward: the weight's cast and the input's (once per input: the q, k and v projections
cast the normed input once, as torchtitan's ``PrepareFloat8ModuleInput`` and compile
do). Backward: the output gradient's cast, and a transposed FP8 copy (read and write,
``B`` in all) of each operand a backward GEMM takes transposed (weight, output gradient
and input). The weights are cast every micro-batch (torchtitan's FSDP Float8
all-gather casts them once per step: not priced, a few percent of a layer); attention
(SDPA), the head, norms and the rest stay as they were.

A block takes the sum of its ops, but never less than the host needs to issue
their kernels (``launch_us`` each; a backward issues two per op). Memory is
read from the capture: parameters, the bytes autograd saved (activations),
the values other blocks read (output), twice the largest value (temporary: a
value and its gradient). The loss (outside the graph) is charged to the block
that makes the model's outputs as a softmax cross-entropy over them. The
optimizer is Adam in fp32: 4 x parameters of state, one more as the step's
temporaries, and seven passes over the parameter bytes per step.
"""

from __future__ import annotations

from typing import Any

try:  # a size's runtime value without a guard: torch >= 2.12, then the older name
    from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw
except ImportError:  # torch 2.11 (the GPU machines' image)
    from torch.fx.experimental.symbolic_shapes import size_hint as guarding_hint_or_throw  # type: ignore[attr-defined,no-redef]

from orgel.costs.blocks import BlockCosts
from orgel.costs.devices import FP32_MATMUL_EFFICIENCY, Device
from orgel.costs.mesh import TPSplit

_FREE = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "expand_as",
         "unsqueeze", "squeeze", "getitem", "size", "flatten", "unflatten", "split", "chunk",
         "unbind", "narrow", "slice", "select", "alias", "detach", "view_as", "dim",
         "numel", "unfold", "as_strided", "_assert_tensor_metadata", "getattr",
         "movedim", "split_with_sizes", "identity"}
_MATMUL = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "einsum",
           "conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose2d",
           "__matmul__"}
_ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "flash_attention",
              "_scaled_dot_product_cudnn_attention"}
_NORMALIZATION = {"layer_norm", "native_layer_norm", "rms_norm", "group_norm", "batch_norm",
                  "native_batch_norm", "instance_norm", "softmax", "_softmax", "log_softmax",
                  "_log_softmax", "mean", "sum", "var", "std", "amax", "amin", "max", "min",
                  "norm", "cumsum", "logsumexp", "var_mean", "cross_entropy", "nll_loss"}
_TYPE_CASTS = {"to", "float", "half", "bfloat16", "type", "type_as", "_to_copy"}
_MODES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}

#: Adam in fp32: read parameter, gradient and two moments, write three.
ADAM_PASSES = 7
#: The loss's softmax cross-entropy: passes over the logits forward and backward.
LOSS_FORWARD_PASSES, LOSS_BACKWARD_PASSES = 3, 2


def op_class(op: str, opgraph: Any = None, node: Any = None) -> str:
    """``matmul``, ``attention``, ``normalization``, ``elementwise`` or ``free`` for an op name.

    A dtype cast to the dtype it already has is free (given the graph and node).
    """
    name = op.lower().rstrip("_") if op not in ("_softmax", "_log_softmax") else op
    if name in _MATMUL:
        return "matmul"
    if name in _ATTENTION or "attention" in name:
        return "attention"
    if name in _NORMALIZATION:
        return "normalization"
    if name in _FREE:
        return "free"
    if name in _TYPE_CASTS and node is not None and opgraph is not None:
        sources = [opgraph.nodes[i].dtype for i in node.inputs if i in opgraph.nodes]
        if sources and all(d == node.dtype for d in sources):
            return "free"
    return "elementwise"


class Roofline:
    """Per-op forward/backward times (ms) on ``device`` for ``opgraph``'s nodes.

    ``float8``: the linears run in Float8 (module docstring; the device needs an
    ``fp8`` peak).
    """

    def __init__(self, opgraph: Any, device: Device, *, tf32: bool = False,
                 float8: bool = False) -> None:
        self.g = opgraph
        self.device = device
        self.tf32 = tf32
        self.float8 = float8
        self.input_bytes = _model_input_bytes(opgraph)
        # the Float8 linears, and those that cast their input (the first to read it)
        self.fp8: set[str] = set()
        self.casts_input: set[str] = set()
        if float8:
            device.peak("fp8")  # a DeviceError that says to add the peak
            heads = set(opgraph.outputs)
            cast: set[str] = set()
            for node in opgraph.nodes.values():
                if (node.op.lower() == "linear" and node.params and node.inputs
                        and node.name not in heads):
                    self.fp8.add(node.name)
                    if node.inputs[0] not in cast:
                        cast.add(node.inputs[0])
                        self.casts_input.add(node.name)

    def mode(self, dtype: str | None) -> str:
        mode = _MODES.get(dtype or "float32", "fp32")
        return "tf32" if mode == "fp32" and self.tf32 else mode

    def traffic(self, node: Any) -> int:
        """Bytes an op reads and writes: its tensor inputs, its parameters, its output."""
        inputs = sum(self.g.nodes[i].nbytes if i in self.g.nodes else self.input_bytes.get(i, 0)
                     for i in node.inputs)
        return int(inputs + node.param_bytes + node.nbytes)

    def grad_inputs(self, node: Any) -> int:
        """How many of the op's activation inputs need a gradient."""
        return sum(1 for i in node.inputs if i in self.g.nodes and self.g.nodes[i].requires_grad)

    def times(self, node: Any) -> tuple[float, float, float, int]:
        """``(fwd, bwd, wgrad, kernels)`` of one op: ms, ms, ms and kernels launched."""
        cls = op_class(node.op, self.g, node)
        if cls == "free" or not node.is_tensor and node.nbytes == 0:
            return 0.0, 0.0, 0.0, 0
        dev = self.device
        bw = dev.memory_gbs * 1e9
        traffic = self.traffic(node)
        trains = node.requires_grad and node.grad_enabled
        if node.name in self.fp8:
            return self.float8_times(node, trains)
        if cls in ("matmul", "attention"):
            mode = self.mode(node.dtype)
            eff = dev.efficiency[cls]
            if cls == "matmul" and mode == "fp32":
                eff = FP32_MATMUL_EFFICIENCY
            fwd = max(node.flops / (dev.peak(mode) * eff),
                      traffic / (bw * dev.efficiency["elementwise"])) * 1000
            if not trains:
                return fwd, 0.0, 0.0, 1
            if cls == "attention":
                return fwd, 2.5 * fwd, 0.0, 1
            weight = fwd if node.params else 0.0
            return fwd, min(2, self.grad_inputs(node)) * fwd + weight, weight, 1
        fwd = traffic / (bw * dev.efficiency[cls]) * 1000
        if not trains:
            return fwd, 0.0, 0.0, 1
        weight = fwd if node.params else 0.0
        return fwd, 2 * fwd + weight, weight, 1


    def float8_times(self, node: Any, trains: bool) -> tuple[float, float, float, int]:
        """:meth:`times` of a Float8 linear: FP8 GEMMs plus the casts (module docstring)."""
        dev = self.device
        rate = dev.memory_gbs * 1e9 * dev.efficiency["elementwise"]
        size = _ITEMSIZE.get(node.dtype or "float32", 2)
        x = node.inputs[0]
        x_bytes = (self.g.nodes[x].nbytes if x in self.g.nodes else self.input_bytes.get(x, 0))
        x_bytes = x_bytes if node.name in self.casts_input else 0
        w_bytes, y_bytes = node.param_bytes, node.nbytes
        operands = (self.traffic(node) - y_bytes) / size  # FP8: a byte per element
        gemm = max(node.flops / (dev.peak("fp8") * dev.efficiency["matmul"]),
                   (operands + y_bytes) / rate) * 1000
        casts = 1 + (x_bytes > 0)
        fwd = gemm + (2 + 1 / size) * (w_bytes + x_bytes) / rate * 1000
        if not trains:
            return fwd, 0.0, 0.0, 1 + 2 * casts
        # the output gradient's amax and cast, and transposed copies of W, dy and x
        cast_back = ((2 + 1 / size) * y_bytes + 2 / size * (w_bytes + y_bytes + x_bytes)
                     ) / rate * 1000
        weight = gemm
        bwd = min(2, self.grad_inputs(node)) * gemm + weight + cast_back
        return fwd, bwd, weight, 1 + 2 * casts


def estimate_costs(opgraph: Any, device: Device, *, blocks: int = 32, tf32: bool = False,
                   rows: int | None = None, loss: bool = True,
                   blockgraph: Any = None, float8: bool = False) -> BlockCosts:
    """The block cost table of one micro-batch of ``opgraph`` on ``device`` (module docstring).

    ``blocks``: how many blocks to coarsen into (or pass ``blockgraph``);
    ``tf32``: fp32 matmuls run on TF32 tensor cores (``torch.backends.cuda.
    matmul.allow_tf32``, off by default in PyTorch); ``rows``: the micro-batch's
    rows, recorded for ``--batch`` scaling; ``loss``: charge a cross-entropy
    over the model's outputs to the block that makes them; ``float8``: the linears
    but the head run in Float8 (module docstring; the device needs an ``fp8`` peak).
    """
    from orgel.costs.tied import tied_groups
    from orgel.graph import coarsen
    from orgel.profile.cache import graph_hash
    from orgel.profile.recompute import block_facts

    bg = blockgraph if blockgraph is not None else coarsen(opgraph, blocks)
    roof = Roofline(opgraph, device, tf32=tf32, float8=float8)
    launch = device.launch_us / 1000
    node_block = bg.node_block
    cols: dict[str, list[Any]] = {k: [] for k in ("fwd", "bwd", "wgrad", "params", "acts",
                                                  "temp", "kept", "opt")}
    outputs = set(opgraph.outputs)
    readers: dict[str, set[int]] = {}
    for node in opgraph.nodes.values():
        for i in node.inputs:
            readers.setdefault(i, set()).add(node_block[node.name])
    out_bytes = []
    for block in bg.blocks:
        fwd = bwd = wgrad = 0.0
        kernels = 0
        params: dict[str, int] = {}
        acts = temp = kept = 0
        out = 0
        for name in block.nodes:
            node = opgraph.nodes[name]
            f, b, w, k = roof.times(node)
            fwd, bwd, wgrad, kernels = fwd + f, bwd + b, wgrad + w, kernels + k
            for p in node.params:
                if p in opgraph.params:
                    params[p] = opgraph.tensor_bytes(p)
            acts += node.saved_bytes
            temp = max(temp, 2 * node.nbytes)
            if w > 0 and op_class(node.op) == "matmul":
                kept += node.nbytes  # W needs the output's gradient
            if readers.get(name, set()) - {block.index} or name in outputs:
                out += node.nbytes
        if loss and block.produces_output:
            logits = sum(opgraph.nodes[n].nbytes for n in outputs if n in opgraph.nodes)
            rate = device.memory_gbs * 1e9 * device.efficiency["normalization"]
            fwd += LOSS_FORWARD_PASSES * logits / rate * 1000
            bwd += LOSS_BACKWARD_PASSES * logits / rate * 1000
            acts += logits
            kernels += 3
        # The host issues the kernels ahead of the GPU; a block of tiny ops waits on it.
        fwd = max(fwd, kernels * launch)
        bwd = max(bwd, 2 * kernels * launch) if bwd > 0 else 0.0
        nparams = sum(params.values())
        cols["fwd"].append(fwd)
        cols["bwd"].append(bwd)
        cols["wgrad"].append(min(wgrad, bwd))
        cols["params"].append(nparams)
        cols["acts"].append(acts)
        cols["temp"].append(temp)
        cols["kept"].append(kept)
        cols["opt"].append(ADAM_PASSES * nparams / (device.memory_gbs * 1e9
                                                   * device.efficiency["elementwise"]) * 1000)
        out_bytes.append(out)
    edges = sorted({(e.src, e.dst) for e in bg.edges if e.src != e.dst})
    # a mask or a position table: read but sending no gradient back; a block's output a
    # consumer does not read, not sent to it (split_model sends a stage what it reads)
    sent, grads = bg.edge_bytes(out_bytes)
    return BlockCosts(
        fwd=cols["fwd"], bwd=cols["bwd"], wgrad=cols["wgrad"], params=cols["params"],
        activations=cols["acts"], output=out_bytes, temporary=cols["temp"], edges=edges,
        link=device.intra_node.link(), memory_per_rank=device.memory_bytes,
        optimizer_factor=4.0, optimizer_temporary=1.0, weight_kept=cols["kept"],
        names=[b.name for b in bg.blocks], nodes=[list(b.nodes) for b in bg.blocks],
        rows=rows, tied=tied_groups(opgraph, bg), optimizer_ms=cols["opt"],
        node_ranks=device.gpus_per_node, node_link=device.inter_node.link(), edge_grads=grads,
        edge_bytes=sent,
        tp_split=_fit_splits(tp_splits(opgraph, roof, node_block, len(bg.blocks)),
                             cols["fwd"], cols["bwd"], cols["wgrad"], cols["params"],
                             cols["acts"]),
        recompute=block_facts(opgraph, [b.nodes for b in bg.blocks], cols["fwd"], roof),
        meta={"device": device.name, "estimated": "roofline", "tf32": tf32, "float8": float8,
              "target_blocks": blocks, "num_blocks": len(bg.blocks),
              "graph_hash": graph_hash(opgraph)})


def tp_splits(opgraph: Any, roof: Roofline, node_block: dict[str, int], blocks: int
              ) -> list[TPSplit]:
    """Each block's :class:`TPSplit` from the graph's column/row regions.

    :func:`orgel.graph.tensor_parallel.tp_regions` finds the regions (the
    runtime shards the same ones); a region's nodes split their times and
    saved bytes in the blocks they fall in, its column and row weights their
    bytes. Its row output is all-reduced forward in the row's block and its
    input's gradient (the same bytes) backward in its first column's block: a
    block counts half a region per end it holds (``regions = ends / 2``,
    ``allreduce`` half their bytes), so a region a block boundary cuts is
    priced once each way over the pipeline.
    """
    from orgel.graph.tensor_parallel import tp_regions

    fwd = [0.0] * blocks
    bwd = [0.0] * blocks
    wgrad = [0.0] * blocks
    params = [0] * blocks
    acts = [0] * blocks
    ends = [0] * blocks
    end_bytes = [0] * blocks
    column = [0.0] * blocks  # forward ms of the column and row linears (AsyncTP's overlap)
    row = [0.0] * blocks
    column_ends = [0] * blocks
    for region in tp_regions(opgraph.graph_module):
        for name in region.nodes:
            node = opgraph.nodes.get(name)
            if node is None:
                continue
            b = node_block[name]
            f, bw, w, _ = roof.times(node)
            fwd[b], bwd[b], wgrad[b] = fwd[b] + f, bwd[b] + bw, wgrad[b] + w
            acts[b] += node.saved_bytes
        row_bias = opgraph.attr_of.get(region.row_bias or "", None)
        for name in (*region.columns, region.row):  # its linears' weights, in their blocks
            params[node_block[name]] += sum(opgraph.tensor_bytes(p)
                                            for p in opgraph.nodes[name].params
                                            if p != row_bias)  # the row bias stays whole
        for name in region.columns:
            column[node_block[name]] += roof.times(opgraph.nodes[name])[0]
        row[node_block[region.row]] += roof.times(opgraph.nodes[region.row])[0]
        column_ends[node_block[region.columns[0]]] += 1
        nbytes = opgraph.nodes[region.row].nbytes
        for at in (region.columns[0], region.row):
            ends[node_block[at]] += 1
            end_bytes[node_block[at]] += nbytes
    return [TPSplit(fwd[b], bwd[b], wgrad[b], params[b], acts[b], end_bytes[b] // 2,
                    ends[b] / 2, column[b], row[b], column_ends[b]) for b in range(blocks)]


def measured_tp_splits(opgraph: Any, bg: Any, device: Device, fwd: list[float],
                       bwd: list[float], wgrad: list[float], params: list[int],
                       acts: list[int]) -> list[TPSplit]:
    """Each block's :class:`TPSplit` for a table measured on real ranks (the profiler's).

    The regions are :func:`tp_splits`'s (one rule: the runtime's
    :func:`~orgel.graph.tensor_parallel.tp_regions` on the captured graph),
    so a block's split parameters, its all-reduce bytes and its region count
    are exact. The measurements have no per-op times, so the approximation:
    a block's measured forward, backward and weight-gradient milliseconds (and
    its regions' linears' forward, AsyncTP's overlap, by the forward's share) and
    its measured saved activations are apportioned by the share the regions'
    ops take of the block's ops in the roofline estimate on ``device`` (see
    :func:`reference_device`: only the shares are used, not the device's
    absolute times). The TP all-reduces are priced on the table's own link,
    the one measured between the profiled ranks (:func:`orgel.costs.mesh.tp_link`).
    """
    roof = Roofline(opgraph, device)
    est = tp_splits(opgraph, roof, bg.node_block, len(bg.blocks))
    out = []
    for b, block in enumerate(bg.blocks):
        ops = [roof.times(opgraph.nodes[n]) for n in block.nodes]
        tf, tb, tw = (sum(t[i] for t in ops) for i in range(3))
        ta = sum(opgraph.nodes[n].saved_bytes for n in block.nodes)
        s = est[b]
        share = fwd[b] / tf if tf else 0.0
        out.append(TPSplit(
            fwd[b] * (s.fwd / tf if tf else 0.0), bwd[b] * (s.bwd / tb if tb else 0.0),
            wgrad[b] * (s.wgrad / tw if tw else 0.0), s.params,
            int(acts[b] * (s.activations / ta if ta else 0.0)), s.allreduce, s.regions,
            s.column * share, s.row * share, s.column_ends))
    return _fit_splits(out, fwd, bwd, wgrad, params, acts)


def reference_device(dev: Any) -> Device:
    """The device model whose roofline shares apportion a measured block (``dev``: torch).

    A CUDA device whose name matches a built-in model (``H100`` with 80 GB:
    ``h100-80gb``) gets it; any other device, the CPU included, gets
    ``h100-80gb``, whose fp32 balance (67 TFLOP/s over 3.35 TB/s: 20 flops
    per byte) is near a server CPU's (a few TFLOP/s over 100-300 GB/s): which
    ops are compute- and which memory-bound comes out alike, and only the
    shares are used.
    """
    from orgel.costs.devices import DEVICES

    if getattr(dev, "type", None) == "cuda":
        import torch

        name = torch.cuda.get_device_name(dev).lower().replace(" ", "")
        chips = [m for key, m in DEVICES.items() if key.split("-")[0] in name]
        sized = [m for m in chips if m.name.split("-")[1] in name]
        if chips:
            return (sized or chips)[0]
    return DEVICES["h100-80gb"]


def _fit_splits(splits: list[TPSplit], fwd: list[float], bwd: list[float], wgrad: list[float],
                params: list[int], acts: list[int]) -> list[TPSplit]:
    """Each split within its block's totals (a block's times have a launch-bound floor)."""
    return [TPSplit(min(s.fwd, f), min(s.bwd, b), min(s.wgrad, w, s.bwd), min(s.params, p),
                    min(s.activations, a), s.allreduce, s.regions,
                    min(s.column, f), min(s.row, f), s.column_ends)
            for s, f, b, w, p, a in zip(splits, fwd, bwd, wgrad, params, acts, strict=True)]


def _model_input_bytes(opgraph: Any) -> dict[str, int]:
    """Bytes of each model input, read off the graph's placeholders."""
    out: dict[str, int] = {}
    for node in opgraph.graph_module.graph.nodes:
        if node.op == "placeholder" and node.name in opgraph.model_inputs:
            value = node.meta.get("example_value", node.meta.get("val"))
            if value is not None and hasattr(value, "numel"):  # the example's size, unguarded
                out[node.name] = guarding_hint_or_throw(value.numel()) * value.element_size()
    return out
