"""The precision graph: which format every tensor edge of every op uses, per phase.

Nodes are ops named by canonical module FQN; edges are tensors into them, annotated with
(dtype, granularity, scale rule, quantizer id, GEMM backend, block alignment, padding).
The graph is built from a *live* model (the trainer's converted modules, or what a rollout
engine actually instantiated), never from a config alone, and it is plain data so an
engine can build it in its own process and ship it back as a dict.

`check_subgraph(rollout, train_fwd)` proves the Jet-RL property: every op the rollout runs
exists in the training forward with identical quantization on every edge, and every FP8 op of
the training forward is in the rollout with its input and weight edges (a graph that omits
them proves nothing).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence

import torch
from torch import nn

from .batch_invariant import InvariantLinear, numerics_of
from .formats import Granularity
from .kv_cache import KV_AUTO, kv_cache_label
from .linear import Fp8Linear
from .recipe import BackwardSpec, DType, FpropSpec, PrecisionRecipe, TensorSpec, get_recipe

__all__ = [
    "Phase",
    "EdgeAttrs",
    "Edge",
    "Node",
    "PrecisionGraph",
    "Violation",
    "build_precision_graph",
    "check_subgraph",
    "compare_graphs",
    "canonical_name",
    "FUSED_PROJECTIONS",
    "add_linear",
    "first_unaligned_part",
]

logger = logging.getLogger(__name__)

Phase = Literal["train_fwd", "train_bwd", "rollout"]
PHASES: tuple[str, ...] = ("train_fwd", "train_bwd", "rollout")

# Fused projections in inference engines (vLLM) -> the training model's separate parts.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
BLOCK = 128


def first_unaligned_part(part_sizes: Sequence[int], rows: int) -> int | None:
    """The row at which a part of a fused projection starts off a `rows`-row block, else None (every block then
    lies within one part, so quantizing the fused matrix and quantizing each part give the same blocks)."""
    return next((r for r in itertools.accumulate(part_sizes[:-1]) if r % rows), None)


def canonical_name(fqn: str) -> str:
    """Strip wrapper prefixes (DeepSpeed/DDP `module.`, torch.compile `_orig_mod.`)."""
    changed = True
    while changed:
        changed = False
        for p in _WRAPPER_PREFIXES:
            if fqn.startswith(p):
                fqn, changed = fqn[len(p) :], True
        fqn = fqn.replace("._orig_mod.", ".").replace("._checkpoint_wrapped_module.", ".")
    return fqn


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16", torch.float8_e4m3fn: "e4m3"}.get(dtype, str(dtype))


@dataclass(frozen=True)
class EdgeAttrs:
    dtype: str
    granularity: str | None = None
    scale_rule: str | None = None
    quantizer_id: str = ""
    backend: str | None = None
    block_origin: str = "aligned"  # "aligned", "transpose", or "fused@<row offset>" when blocks straddle parts
    padding: str = ""  # e.g. "K 576->640": the last block is partial (zero-padded semantics)
    kernel: str | None = None  # which quantization implementation produced the bytes

    @classmethod
    def from_spec(cls, spec: TensorSpec, hp_dtype: str, backend: str | None, padding: str = "", kernel: str | None = None, block_origin: str = "aligned") -> "EdgeAttrs":
        if not spec.is_fp8:
            # High-precision operands: report the real tensor dtype (an fp32 CPU model is fp32).
            return cls(dtype=hp_dtype, quantizer_id=f"{hp_dtype}/none", backend=backend)
        return cls(
            dtype=spec.dtype.value,
            granularity=spec.granularity.value,
            scale_rule=spec.scale_rule.value,
            quantizer_id=spec.quantizer_id,
            backend=backend,
            block_origin=block_origin,
            padding=padding,
            kernel=kernel,
        )

    def short(self) -> str:
        s = self.dtype if self.granularity is None else f"{self.dtype}[{self.granularity}]"
        if self.block_origin not in ("aligned", "transpose"):
            s += f"({self.block_origin})"
        return s


# Fields that must agree between rollout and training for the flows to be the same numerics.
NUMERIC_FIELDS = ("dtype", "granularity", "scale_rule", "quantizer_id", "block_origin", "padding")


@dataclass(frozen=True)
class Edge:
    dst: str
    role: str
    attrs: EdgeAttrs

    @property
    def src(self) -> str:
        return f"{self.role}:{self.dst}"


@dataclass
class Node:
    name: str
    op: str
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Violation:
    node: str
    edge: str
    field: str
    expected: str
    found: str
    kind: str = "mismatch"  # mismatch | missing_node | missing_edge | extra_edge | dangling_edge | empty_graph | shape | backend | numerics | kv_cache
    severity: str = "error"

    def __str__(self) -> str:
        where = self.node if not self.edge else f"{self.node} [{self.edge}]"
        return f"{where}: {self.field} expected {self.expected!s}, found {self.found!s} ({self.kind})"


@dataclass
class PrecisionGraph:
    phase: str
    recipe: str = ""
    nodes: dict[str, Node] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    # ---- construction helpers ----------------------------------------------------------
    def add_node(self, name: str, op: str, **attrs: Any) -> Node:
        node = Node(name, op, dict(attrs))
        self.nodes[name] = node
        return node

    def add_edge(self, dst: str, role: str, attrs: EdgeAttrs) -> None:
        self.edges.append(Edge(dst, role, attrs))

    def edges_into(self, node: str) -> dict[str, Edge]:
        return {e.role: e for e in self.edges if e.dst == node}

    # ---- serialization -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "recipe": self.recipe,
            "meta": self.meta,
            "nodes": [dataclasses.asdict(n) for n in self.nodes.values()],
            "edges": [{"dst": e.dst, "role": e.role, "attrs": dataclasses.asdict(e.attrs)} for e in self.edges],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PrecisionGraph":
        g = cls(d["phase"], d.get("recipe", ""), meta=dict(d.get("meta", {})))
        for n in d["nodes"]:
            g.nodes[n["name"]] = Node(n["name"], n["op"], dict(n.get("attrs", {})))
        g.edges = [Edge(e["dst"], e["role"], EdgeAttrs(**e["attrs"])) for e in d["edges"]]
        return g

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    # ---- views ------------------------------------------------------------------------
    def summary(self) -> dict[str, int]:
        ops: dict[str, int] = {}
        for n in self.nodes.values():
            ops[n.op] = ops.get(n.op, 0) + 1
        fp8_edges = sum(1 for e in self.edges if e.attrs.dtype == "e4m3")
        return {"nodes": len(self.nodes), "edges": len(self.edges), "fp8_edges": fp8_edges, **{f"op:{k}": v for k, v in ops.items()}}

    def report(self, max_rows: int | None = None) -> str:
        """A readable table: one row per op, its edges' formats and backend."""
        backends = sorted({e.attrs.backend for e in self.edges if e.attrs.backend})
        kernels = sorted({e.attrs.kernel for e in self.edges if e.attrs.kernel})
        lines = [
            f"precision graph [{self.phase}] recipe={self.recipe or '?'} nodes={len(self.nodes)} edges={len(self.edges)} "
            f"fp8_edges={self.summary()['fp8_edges']} gemm_backend={','.join(backends) or '-'} quant_kernel={','.join(kernels) or '-'}"
        ]
        for k, v in sorted(self.meta.items()):
            lines.append(f"  {k}: {v}")
        rows = list(self.nodes.values())
        shown = rows if max_rows is None else rows[:max_rows]
        width = max((len(n.name) for n in shown), default=10)
        for n in shown:
            edges = self.edges_into(n.name)
            desc = "  ".join(f"{role}={e.attrs.short()}{' pad(' + e.attrs.padding + ')' if e.attrs.padding else ''}" for role, e in edges.items())
            impl = f"  impl={n.attrs['impl']}" if "impl" in n.attrs else ""
            lines.append(f"  {n.name:<{width}}  {n.op:<11} {desc}{impl}")
        if max_rows is not None and len(rows) > max_rows:
            lines.append(f"  ... {len(rows) - max_rows} more ops")
        return "\n".join(lines)

    def to_dot(self, violations: Sequence[Violation] = ()) -> str:
        bad = {v.node for v in violations}
        color = {"e4m3": "palegreen", "bf16": "lightblue", "fp32": "lightyellow"}
        out = [f'digraph "{self.phase}" {{', "  rankdir=LR;", '  node [shape=box, style=filled, fontname="monospace"];']
        for i, n in enumerate(self.nodes.values()):
            ins = self.edges_into(n.name)
            fill = "salmon" if n.name in bad else color.get(ins["input"].attrs.dtype if "input" in ins else "bf16", "white")
            out.append(f'  n{i} [label="{n.name}\\n{n.op}", fillcolor="{fill}"];')
            for role, e in ins.items():
                out.append(f'  "{role}:{n.name}" [shape=plaintext, style="", label="{role}"];')
                out.append(f'  "{role}:{n.name}" -> n{i} [label="{e.attrs.short()}"];')
        out.append("}")
        return "\n".join(out)

    def render(self, path: str | Path, violations: Sequence[Violation] = ()) -> Path:
        """Write DOT next to `path` and a PNG: graphviz's `dot` if installed, else matplotlib."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        dot_path = path.with_suffix(".dot")
        dot_path.write_text(self.to_dot(violations))
        png = path.with_suffix(".png")
        if shutil.which("dot"):
            subprocess.run(["dot", "-Tpng", str(dot_path), "-o", str(png)], check=True, timeout=120)
            return png
        try:
            _render_matplotlib(self, png, violations)
        except ImportError:
            logger.warning("neither graphviz nor matplotlib is installed: wrote %s only", dot_path)
            return dot_path
        return png


def _render_matplotlib(g: PrecisionGraph, png: Path, violations: Sequence[Violation]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bad = {v.node for v in violations}
    nodes = list(g.nodes.values())
    roles = sorted({e.role for e in g.edges})
    colors = {"e4m3": "#8fd18f", "bf16": "#9cc3e6", "fp32": "#f3e6a0", "fp16": "#d9b3ff"}
    fig_h = max(2.5, 0.28 * len(nodes) + 1.2)
    fig, ax = plt.subplots(figsize=(3.2 + 2.0 * len(roles), fig_h))
    for r, n in enumerate(nodes):
        y = len(nodes) - r
        ax.text(0, y, n.name, ha="left", va="center", fontsize=7, family="monospace", color="red" if n.name in bad else "black")
        ins = g.edges_into(n.name)
        for c, role in enumerate(roles):
            e = ins.get(role)
            if e is None:
                continue
            x = 3.0 + 2.0 * c
            ax.add_patch(plt.Rectangle((x - 0.9, y - 0.4), 1.8, 0.8, color=colors.get(e.attrs.dtype, "#dddddd")))
            ax.text(x, y, e.attrs.short(), ha="center", va="center", fontsize=6, family="monospace")
    for c, role in enumerate(roles):
        ax.text(3.0 + 2.0 * c, len(nodes) + 1, role, ha="center", fontsize=8, weight="bold")
    ax.set_xlim(-0.2, 3.0 + 2.0 * len(roles))
    ax.set_ylim(0, len(nodes) + 1.6)
    ax.axis("off")
    ax.set_title(f"precision graph: {g.phase} ({g.recipe})  green=e4m3 blue=bf16 yellow=fp32  red name=violation", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ---- building from live models --------------------------------------------------------------
def _padding(n: int, k: int, spec: TensorSpec, operand: str) -> str:
    """Describe partial edge blocks for this operand (they behave as zero padding)."""
    if not spec.is_fp8 or spec.granularity in (Granularity.ROW, Granularity.TENSOR):
        return ""
    b0, b1 = spec.granularity.block((n, k))
    parts = []
    if operand == "weight" and b0 > 1 and n % b0:
        parts.append(f"N {n}->{n + (-n) % b0}")
    if b1 > 1 and k % b1:
        parts.append(f"K {k}->{k + (-k) % b1}")
    return ",".join(parts)


def add_linear(
    g: PrecisionGraph,
    fqn: str,
    in_features: int,
    out_features: int,
    fprop: FpropSpec,
    backward: BackwardSpec | None,
    *,
    hp_dtype: str,
    backend: str | None,
    kernel: str | None = None,
    part_sizes: Sequence[int] | None = None,
    weight_quant_scope: Literal["per_part", "fused"] = "per_part",
    op: str | None = None,
    input_kernel: str | None = None,
) -> None:
    """Add one linear op (or, for a fused projection, one node per part) with its edges for g.phase.

    Engines call this for what they instantiated. `part_sizes` are the output sizes of a fused
    projection's parts. With `weight_quant_scope="fused"` the 128x128 blocks were computed over
    the fused matrix: a part whose rows do not start on a block boundary (or share a block
    with a neighbour) then gets different scales than in training, which is recorded. `input_kernel` names
    what quantizes the forward's activation where that is not `kernel` (an engine's CUDA activation quantizer).
    """
    name = canonical_name(fqn)
    leaf = name.rsplit(".", 1)[-1]
    parts: list[tuple[str, int, int]]  # (name, out_features, row offset in the fused matrix)
    if leaf in FUSED_PROJECTIONS and part_sizes is not None:
        part_names = FUSED_PROJECTIONS[leaf]
        if len(part_sizes) != len(part_names):
            raise ValueError(f"{fqn}: {len(part_sizes)} part sizes for parts {part_names}")
        prefix = name[: -len(leaf)]
        offsets = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
        parts = [(prefix + pn, ps, off) for pn, ps, off in zip(part_names, part_sizes, offsets)]
    else:
        parts = [(name, out_features, 0)]
    op = op or ("linear_fp8" if fprop.is_fp8 else "linear")
    for idx, (pname, n, offset) in enumerate(parts):
        origin = "aligned"
        if weight_quant_scope == "fused" and fprop.weight.is_fp8 and len(parts) > 1:
            b0 = fprop.weight.granularity.block((n, in_features))[0]
            straddles_end = n % b0 != 0 and idx < len(parts) - 1
            if offset % b0 != 0 or straddles_end:
                origin = f"fused@{offset}"
        g.add_node(pname, op, in_features=in_features, out_features=n, fused_from=name if len(parts) > 1 else None)
        k = in_features
        if g.phase in ("train_fwd", "rollout"):
            g.add_edge(pname, "input", EdgeAttrs.from_spec(fprop.input, hp_dtype, backend, _padding(n, k, fprop.input, "input"), input_kernel or kernel))
            g.add_edge(pname, "weight", EdgeAttrs.from_spec(fprop.weight, hp_dtype, backend, _padding(n, k, fprop.weight, "weight"), kernel, origin))
        else:
            bw = backward or BackwardSpec()
            wt = fprop.weight if bw.dgrad_grad_output.is_fp8 else TensorSpec()
            g.add_edge(pname, "dgrad.grad_output", EdgeAttrs.from_spec(bw.dgrad_grad_output, hp_dtype, backend, _padding(k, n, bw.dgrad_grad_output, "input"), kernel))
            g.add_edge(pname, "dgrad.weight_t", EdgeAttrs.from_spec(wt, hp_dtype, backend, _padding(k, n, wt, "weight"), kernel, "transpose"))
            g.add_edge(pname, "wgrad.grad_output", EdgeAttrs.from_spec(bw.wgrad_grad_output, hp_dtype, backend, "", kernel))
            g.add_edge(pname, "wgrad.input", EdgeAttrs.from_spec(bw.wgrad_input, hp_dtype, backend, "", kernel))
            g.add_edge(pname, "saved.input", EdgeAttrs.from_spec(bw.saved_input, hp_dtype, None, _padding(n, k, bw.saved_input, "input"), kernel))
            g.add_edge(pname, "grad_between_ops", EdgeAttrs(dtype=bw.grad_dtype.value if bw.is_fp8 else hp_dtype))


def _own_linear_weight(m: nn.Module) -> torch.Tensor | None:
    """The 2-D `weight` Parameter of a module that is neither nn.Linear nor nn.Embedding, else None."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        return None
    w = m._parameters.get("weight")
    return w if w is not None and w.dim() == 2 else None


def _is_norm(m: nn.Module) -> bool:
    return "norm" in type(m).__name__.lower() and not any(True for _ in m.children())


def build_precision_graph(model: nn.Module, recipe: PrecisionRecipe | str, phase: Phase) -> PrecisionGraph:
    """Build the graph of `phase` from the modules the live `model` holds.

    For "train_fwd"/"train_bwd" pass the trainer's model; for "rollout" pass the rollout
    engine's model (the transformers engine's converted copy; vLLM engines build theirs
    in-engine with `add_linear`). Fp8Linear layers contribute their actual specs and resolved
    backend; plain nn.Linear, embeddings and norms contribute their real dtypes.
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    if not isinstance(recipe, PrecisionRecipe):
        raise TypeError(f"build_precision_graph needs a PrecisionRecipe or a recipe name (get_recipe), got {recipe!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"build_precision_graph reads a live nn.Module, got {type(model).__name__}")
    from .ops import kernel_name

    numerics = numerics_of(model)
    g = PrecisionGraph(phase, recipe.name, meta={
        "recipe_unified": recipe.unified, "source": type(model).__name__,
        "numerics": numerics.mode, "numerics_detail": numerics.detail(), "kv_cache": kv_cache_label(model),
    })
    for fqn, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            hp = _dtype_name(m.weight.dtype)
            dev = m.weight_device if m.weight_device.type != "meta" else torch.device("cpu")
            add_linear(
                g, fqn, m.in_features, m.out_features, m.fprop, m.backward_spec if phase == "train_bwd" else None,
                hp_dtype=hp, backend=m.resolved_backend, kernel=kernel_name(dev),
            )
        elif isinstance(m, nn.Linear):
            hp = _dtype_name(m.weight.dtype)
            backend = m.backend if isinstance(m, InvariantLinear) else None  # batch-invariant: fp64 or triton_invariant
            add_linear(g, fqn, m.in_features, m.out_features, FpropSpec(), None, hp_dtype=hp, backend=backend)
        elif (w := _own_linear_weight(m)) is not None:
            # A module multiplying by its own [out, in] weight (an MoE router that calls F.linear): an engine
            # builds it as a linear, kept in high precision on both sides.
            add_linear(g, fqn, w.shape[1], w.shape[0], FpropSpec(), None, hp_dtype=_dtype_name(w.dtype), backend=None)
        elif isinstance(m, nn.Embedding):
            name = canonical_name(fqn)
            g.add_node(name, "embedding", num_embeddings=m.num_embeddings, dim=m.embedding_dim)
            if phase != "train_bwd":
                g.add_edge(name, "weight", EdgeAttrs(dtype=_dtype_name(m.weight.dtype), quantizer_id=f"{_dtype_name(m.weight.dtype)}/none"))
        elif _is_norm(m):
            name = canonical_name(fqn)
            w = getattr(m, "weight", None)
            dt = _dtype_name(w.dtype) if isinstance(w, torch.Tensor) else "fp32"
            impl = m._get_name()  # a module whose forward another library replaced names that one (Liger's do)
            g.add_node(name, "norm", **({"impl": impl} if impl != type(m).__name__ else {}))
            if phase != "train_bwd":
                g.add_edge(name, "weight", EdgeAttrs(dtype=dt, quantizer_id=f"{dt}/none"))
    torch_devices = {m.weight_device for m in model.modules() if isinstance(m, Fp8Linear) and m.resolved_backend == "torch"}
    cuda = sorted({d for d in torch_devices if d.type == "cuda"}, key=str)
    if cuda:
        from .gemm import cublaslt

        g.meta["gemm_call"] = cublaslt.call_status(cuda[0])
    impls = sorted({n.attrs["impl"] for n in g.nodes.values() if n.op == "norm" and "impl" in n.attrs})
    if impls:
        g.meta["norm_impl"] = ",".join(impls)
    _mark_fused_swiglu(g, model)
    _mark_fused_norms(g, model)
    _mark_fused_projections(g, model)
    if phase == "train_bwd":
        _mark_wgrad_requantizer(g, model)
    return g


def _mark_wgrad_requantizer(g: PrecisionGraph, model: nn.Module) -> None:
    """Record which kernel re-quantizes the saved FP8 input for WGrad (CUDA cast-transpose, or Triton and why)."""
    from .kernels import cast_transpose, padding_probe
    from .ops import kernel_name

    for fqn, m in model.named_modules():
        if not isinstance(m, Fp8Linear):
            continue
        bw = m.backward_spec
        dev = m.weight_device
        requantizes = (
            bw is not None and bw.saved_input.is_fp8 and bw.wgrad_input.is_fp8
            and bw.saved_input.granularity is Granularity.BLOCK_1x128 and bw.wgrad_input.granularity is Granularity.BLOCK_128x1
        )
        if not requantizes or kernel_name(dev) != "triton":
            continue  # WGrad quantizes the bf16 input itself, another block pair, or no GPU kernels run here
        name = canonical_name(fqn)
        if cast_transpose.usable(dev):
            _set_edge_kernel(g, name, "wgrad.input", cast_transpose.GRAPH_KERNEL)
        elif name in g.nodes:
            g.nodes[name].attrs["requantizer_fallback"] = cast_transpose.status(dev)[1]
        # Known once a backward ran on the device: its WGrad operands are padded by a copy, not by the quantizers.
        if (why := padding_probe.failure(dev)) is not None and name in g.nodes:
            g.nodes[name].attrs["wgrad_padding_fallback"] = why


def _set_edge_kernel(g: PrecisionGraph, dst: str, role: str, kernel: str) -> None:
    """Name the quantization kernel on the edge (dst, role); edges are frozen, so the edge is replaced."""
    for i, e in enumerate(g.edges):
        if e.dst == dst and e.role == role:
            g.edges[i] = Edge(e.dst, e.role, dataclasses.replace(e.attrs, kernel=kernel))


def _mark_fused_swiglu(g: PrecisionGraph, model: nn.Module) -> None:
    """Record which down projections get their FP8 input from the fused SwiGLU kernel (same bytes, other kernel)."""
    from .ops import kernel_name
    from .swiglu import SwiGLUMLP

    for fqn, m in model.named_modules():
        if not isinstance(m, SwiGLUMLP) or not m.fused_quantization:
            continue
        down = canonical_name(f"{fqn}.down_proj" if fqn else "down_proj")
        if down not in g.nodes or kernel_name(m.down_proj.weight_device) != "triton":
            continue  # the fused kernel runs only where the Triton implementation does
        g.nodes[down].attrs["input_producer"] = "silu_mul_quantize"
        _set_edge_kernel(g, down, "input", "triton:silu_mul_quantize")
        if m.fused_dy_quantization:  # the stacked gate/up GEMM's DGrad reads Q(dY) from the SwiGLU backward
            for proj in ("gate_proj", "up_proj"):
                _set_edge_kernel(g, canonical_name(f"{fqn}.{proj}" if fqn else proj), "dgrad.grad_output",
                                 "triton:silu_mul_backward_quantize")


def _mark_fused_norms(g: PrecisionGraph, model: nn.Module) -> None:
    """Record which projections get their FP8 input from the RMSNorm kernel that feeds them (`rmsnorm`: the norm's
    output within an ulp of the eager formula, quantized by the reference rules), and mark that norm."""
    from .ops import kernel_name
    from .rmsnorm import NORM_CONSUMERS, FusedRMSNorm

    for fqn, m in model.named_modules():
        for norm_attr, block_attr, projections in NORM_CONSUMERS:
            norm = m._modules.get(norm_attr)
            if not isinstance(norm, FusedRMSNorm) or kernel_name(norm.weight.device) != "triton":
                continue  # the fused kernel runs only where the Triton implementation does
            prefix = f"{fqn}." if fqn else ""
            norm_name = canonical_name(prefix + norm_attr)
            if norm_name in g.nodes:
                g.nodes[norm_name].attrs["fused_quantization"] = "rmsnorm_quantize"
            for proj in projections:
                name = canonical_name(f"{prefix}{block_attr}.{proj}")
                if name in g.nodes:
                    g.nodes[name].attrs["input_producer"] = "rmsnorm_quantize"
                    _set_edge_kernel(g, name, "input", "triton:rmsnorm_quantize")


def _mark_fused_projections(g: PrecisionGraph, model: nn.Module) -> None:
    """Record which projections run in one stacked GEMM with their siblings (`grouped`: same bytes, fewer kernels),
    and, where a group could not be formed or turned itself off, why."""
    for fqn, m in model.named_modules():
        name = canonical_name(fqn)
        if not isinstance(m, Fp8Linear) or name not in g.nodes:
            continue
        group = m._group
        if group is not None and group.off is None:
            g.nodes[name].attrs["fused_gemm"] = group.label
        elif group is not None:
            g.nodes[name].attrs["fused_gemm_off"] = group.off
        elif m._group_skipped is not None:
            g.nodes[name].attrs["fused_gemm_off"] = m._group_skipped


# ---- checking ---------------------------------------------------------------------------------
# Edge roles an op of each kind must carry in a forward graph (train_fwd or rollout).
_FORWARD_ROLES: dict[str, tuple[str, ...]] = {
    "linear": ("input", "weight"),
    "linear_fp8": ("input", "weight"),
    "linear_foreign": ("input", "weight"),
    "embedding": ("weight",),
    "norm": ("weight",),
}


def _is_fp8_op(g: PrecisionGraph, name: str) -> bool:
    return any(e.attrs.dtype == "e4m3" for e in g.edges_into(name).values())


def _merge_fused_parts(sub: PrecisionGraph, sup: PrecisionGraph) -> PrecisionGraph:
    """`sub` with an engine's fused projection merged back into one op wherever `sup` holds it whole: a checkpoint
    that stores qkv_proj / gate_up_proj fused (Phi-3) gives the trainer one linear, which quantizes its weight as
    one matrix. That equals the engine's per-part quantization only when every part starts on a block row; a part
    that does not gets `block_origin` "parts@<row>" on the merged weight edge, which the comparison reports."""
    groups: dict[str, list[str]] = {}
    for name, node in sub.nodes.items():
        whole = node.attrs.get("fused_from")
        if whole and whole in sup.nodes and whole not in sub.nodes and name not in sup.nodes:
            groups.setdefault(whole, []).append(name)
    if not groups:
        return sub
    part_of = {p: whole for whole, parts in groups.items() for p in parts}
    merged = PrecisionGraph(sub.phase, sub.recipe, meta=dict(sub.meta))
    for name, node in sub.nodes.items():
        whole = part_of.get(name)
        if whole is None:
            merged.nodes[name] = node
        elif whole not in merged.nodes:
            sizes = [sub.nodes[p].attrs.get("out_features") or 0 for p in groups[whole]]
            merged.add_node(whole, node.op, in_features=node.attrs.get("in_features"), out_features=sum(sizes))
    for e in sub.edges:
        whole = part_of.get(e.dst)
        if whole is None:
            merged.edges.append(e)
        elif e.dst == groups[whole][0]:  # one edge per role: the first part's, adjusted for the whole matrix
            parts = groups[whole]
            attrs = e.attrs
            if e.role == "weight" and attrs.dtype == "e4m3":
                rows = int(attrs.granularity.split("x")[0]) if re.fullmatch(r"\d+x\d+", attrs.granularity or "") else BLOCK
                n = merged.nodes[whole].attrs["out_features"]  # the whole matrix's partial last block row
                pad = [f"N {n}->{n + (-n) % rows}"] if n % rows else []
                attrs = dataclasses.replace(attrs, padding=",".join(pad + [p for p in attrs.padding.split(",") if p.startswith("K ")]))
                off = first_unaligned_part([sub.nodes[p].attrs.get("out_features") or 0 for p in parts], rows)
                if off is not None:
                    attrs = dataclasses.replace(attrs, block_origin=f"parts@{off}")
            merged.edges.append(Edge(whole, e.role, attrs))
    return merged


def compare_graphs(sub: PrecisionGraph, sup: PrecisionGraph) -> list[Violation]:
    """Every difference that breaks `sub` being a subgraph of `sup`; backend differences have severity 'warning'.

    Beyond comparing what `sub` holds, `sub` must hold enough to prove something: it is not
    empty, every FP8 op of `sup` is in it (an op the recipe keeps in high precision is a plain
    linear in `sup`, so it is not required), every op carries the edges its kind needs, and no
    edge points at an op the graph does not have.
    """
    for what, g in (("sub", sub), ("sup", sup)):
        if not isinstance(g, PrecisionGraph):
            raise TypeError(f"check_subgraph: {what} must be a PrecisionGraph (PrecisionGraph.from_dict for a dict), got {type(g).__name__}")
    if "train_bwd" in (sub.phase, sup.phase):
        raise ValueError(
            f"check_subgraph compares forward graphs (rollout against train_fwd); got {sub.phase} against {sup.phase}: "
            "build the training side with phase='train_fwd'"
        )
    sub = _merge_fused_parts(sub, sup)
    out: list[Violation] = []
    # Batch-invariant numerics on one side only cannot give identical bits ("numerics" in meta; absent = ordinary).
    modes = sub.meta.get("numerics", "ordinary"), sup.meta.get("numerics", "ordinary")
    if modes[0] != modes[1]:
        out.append(Violation(
            "<graph>", "", "numerics", f"{modes[1]} ({sup.meta.get('numerics_detail', '?')})",
            f"{modes[0]} ({sub.meta.get('numerics_detail', '?')})", "numerics",
        ))
    # The keys and values attention reads (absent = as computed: graphs from before the KV cache had a format).
    kv = sub.meta.get("kv_cache", KV_AUTO), sup.meta.get("kv_cache", KV_AUTO)
    if kv[0] != kv[1]:
        out.append(Violation("<graph>", "", "kv_cache", kv[1], kv[0], "kv_cache"))
    if not sub.nodes:
        out.append(Violation("<graph>", "", "nodes", f"the ops the {sub.phase} engine runs", "an empty graph", "empty_graph"))
    sup_edges: dict[tuple[str, str], Edge] = {(e.dst, e.role): e for e in sup.edges}
    for name, node in sup.nodes.items():
        if name not in sub.nodes and _is_fp8_op(sup, name):
            out.append(Violation(name, "", "node", f"the FP8 op {name} of {sup.phase}", f"absent from {sub.phase}", "missing_node"))
    for name, node in sub.nodes.items():
        other = sup.nodes.get(name)
        if other is None:
            out.append(Violation(name, "", "node", f"an op named {name} in {sup.phase}", "absent", "missing_node"))
            continue
        if node.op != other.op:
            out.append(Violation(name, "", "op", other.op, node.op))
        for dim in ("in_features", "out_features"):
            if node.attrs.get(dim) is not None and other.attrs.get(dim) is not None and node.attrs[dim] != other.attrs[dim]:
                out.append(Violation(name, "", dim, other.attrs[dim], node.attrs[dim], "shape"))
        have = sub.edges_into(name)
        needed = set(_FORWARD_ROLES.get(node.op, ())) | {role for (dst, role) in sup_edges if dst == name}
        for role in sorted(needed - set(have)):
            out.append(Violation(name, role, "edge", f"a {role} edge", "absent", "missing_edge"))
    for e in sub.edges:
        if e.dst not in sub.nodes:
            out.append(Violation(e.dst, e.role, "edge", f"an edge into an op of {sub.phase}", "an edge into no op", "dangling_edge"))
            continue
        if e.dst not in sup.nodes:
            continue
        ref = sup_edges.get((e.dst, e.role))
        if ref is None:
            out.append(Violation(e.dst, e.role, "edge", f"no {e.role} edge (as in {sup.phase})", f"a {e.role} edge", "extra_edge"))
            continue
        for f in NUMERIC_FIELDS:
            a, b = getattr(ref.attrs, f), getattr(e.attrs, f)
            if a != b:
                out.append(Violation(e.dst, e.role, f, a, b))
        # Backends only matter where both sides run an FP8 GEMM (a dtype mismatch is already reported).
        if ref.attrs.backend != e.attrs.backend and ref.attrs.dtype == "e4m3" and e.attrs.dtype == "e4m3":
            out.append(Violation(e.dst, e.role, "backend", ref.attrs.backend, e.attrs.backend, "backend", "warning"))
    return out


def check_subgraph(sub: PrecisionGraph, sup: PrecisionGraph, *, strict: bool = False) -> list[Violation]:
    """Violations of "`sub` (rollout) is a subgraph of `sup` (train_fwd) with identical quantization".

    Empty means OK. `sub` must contain every FP8 op of `sup` with its input and weight edges
    (an empty or partial rollout graph proves nothing and is reported). A GEMM backend that
    differs between the two is logged, and is a violation only under `strict` (different
    backends may round the fp32 accumulation differently).
    """
    found = compare_graphs(sub, sup)
    errors = [v for v in found if v.severity == "error" or strict]
    for v in found:
        if v.severity == "warning" and not strict:
            logger.warning("precision check (not strict): %s", v)
    return errors


def format_violations(violations: Iterable[Violation], limit: int = 40) -> str:
    vs = list(violations)
    if not vs:
        return "precision check: OK (rollout graph is a subgraph of train_fwd with identical quantization)"
    lines = [f"precision check: {len(vs)} violation(s)  [expected = training forward, found = rollout]"]
    lines += [f"  - {v}" for v in vs[:limit]]
    if len(vs) > limit:
        lines.append(f"  ... and {len(vs) - limit} more")
    return "\n".join(lines)


__all__ += ["format_violations", "NUMERIC_FIELDS", "PHASES"]
