"""Sibling FP8 projections that read one input, run as one GEMM: q/k/v, and gate/up.

An eager FP8 linear step costs several times `nn.Linear`'s host time (quantizer launches, the blockwise GEMM's
wrapper, a Python autograd node), and a Llama block calls seven of them, three on the very same normed input.
`fuse_projections(model)` ties each such set of sibling `Fp8Linear` layers into an `Fp8LinearGroup`:

- forward: the first member called with an input x runs Q(x) . [Q(W_1); ...; Q(W_n)]^T for the whole group and
  keeps the other members' columns; each sibling then called with that very tensor (the same object, unmodified,
  in the same grad mode) gets its columns back without a GEMM. K/V's narrow GEMMs (N = 1024 at 8B) disappear into
  one wide one. Every member is still called (its module hooks run); its output aliases the stacked buffer
  without being a view of it, so a model may write it in place.
- backward: one autograd node covers the group, so it quantizes the stacked dY once, runs one DGrad (the members'
  input gradients summed in the GEMM's fp32 accumulator instead of by autograd in bf16) and one WGrad, whose row
  blocks are the members' weight gradients. The fused SwiGLU backward writes d(gate) and d(up) side by side, so
  gate/up's dY needs no copy; q/k/v's gradients arrive apart and are concatenated.

The bytes do not move: every member but the last has a multiple of 128 rows, so the stacked weight's 128x128
blocks are the members' own, Q(W_i) is a row slice of Q(W_stacked), and the members' cached weights (what the
weight sync sends) are views into the group's buffer. Each output element is the dot product it was; only the
GEMM kernel choice for the wider N and the DGrad summation differ from separate calls.

The group runs its members separately (the plain path) under ZeRO-3 (DeepSpeed gathers each member's weight in
that member's own hooks), with FP8 weights installed by a rollout engine, during CUDA graph capture and for
inference tensors (no version counter to prove an input unmodified). If members turn out to read different inputs
(computed columns never asked for), or its first stacked GEMM disagrees with the members' own GEMMs (checked once per
group), the group turns itself off with one warning. `unfuse_projections` undoes it
(batch-invariant mode does: its proofs are per layer shape).

    fuse_projections(model)      # after convert_to_fp8, which calls it unless fuse_projections=False
"""

from __future__ import annotations

import itertools
import logging
import weakref
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from . import ops
from .formats import Granularity, QuantizedTensor
from .kernels.layout import column_blocks_of_one
from .linear import (
    Fp8Linear,
    _fprop,
    _input_and_weight_grads,
    _is_zero3_param,
    _StepPlan,
    _weights_updated_hooks,
    dgrad_operands,
)

__all__ = ["PROJECTION_GROUPS", "Fp8LinearGroup", "adopt_projection_groups", "fuse_projections", "unfuse_projections",
           "projection_groups"]

logger = logging.getLogger(__name__)

# Child names of one parent module that read one input in the transformers models (attention, SwiGLU MLP).
PROJECTION_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_OWNED = "_fp8_linear_groups"  # the attribute of the members' parent that holds its groups
_ROWS = 128  # the weight's block rows: members before the last must end on a block boundary
_MAX_MISSES = 2  # stashes left unread in a row before a group concludes its members read different inputs
# The first stacked GEMM of each group is checked against its members' own GEMMs on this many rows. Only the GEMM's
# algorithm for the wider N may differ (a relative difference far below 1e-2); a misread stacked weight is ~1.
_CHECK_ROWS = 256
_CHECK_TOL = 1e-2
_CHECK_TRIES = 3  # calls whose outputs overflow before the check gives up (the group stays on)
_HAS_CUDA = torch.cuda.is_available()
_groups: "weakref.WeakSet[Fp8LinearGroup]" = weakref.WeakSet()
_warned: set[tuple[str, str]] = set()


def _capturing() -> bool:
    return _HAS_CUDA and torch.cuda.is_current_stream_capturing()


class _Stash:
    """The columns one stacked GEMM computed for members not yet called, valid for one input tensor."""

    __slots__ = ("x", "version", "grad", "outputs", "left")

    def __init__(self, x: torch.Tensor, grad: bool, outputs: list, left: int) -> None:
        self.x, self.version, self.grad, self.outputs, self.left = weakref.ref(x), x._version, grad, outputs, left

    def take(self, i: int, x: torch.Tensor, grad: bool) -> torch.Tensor | None:
        out = self.outputs[i]
        if out is None or self.x() is not x or self.version != x._version or self.grad != grad:
            return None
        self.outputs[i] = None
        self.left -= 1
        return out


class _Fp8GroupFunction(torch.autograd.Function):
    """y_1, ..., y_n = the column blocks of Q(x) . Q([W_1; ...; W_n])^T (+ biases): one node for the group.

    The outputs alias one buffer without being views of it (`torch.unsafe_split_with_sizes`): autograd lets a model
    write them in place, as it may an nn.Linear's output (views made inside a custom Function it refuses), and hands
    backward one gradient per member, None for a member whose output took no part in the loss.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: "Fp8LinearGroup", plan: _StepPlan, *params: torch.Tensor):
        n = len(group.members)
        x2 = x.reshape(-1, x.shape[-1])
        y, xq, wq = _fprop(group, plan, x2, None, group.stacked_bias(), x.dtype)
        ctx.group, ctx.plan, ctx.x_shape, ctx.x_dtype, ctx.wq = group, plan, x.shape, x.dtype, wq
        ctx.set_materialize_grads(False)
        ctx.saved_fp8 = plan.save_fp8 and xq is not None
        if ctx.saved_fp8:
            ctx.x_block = xq.block
            ctx.save_for_backward(xq.data, xq.scale, *params[:n])
        else:
            ctx.save_for_backward(x2, *params[:n])
        return group.split(y, x.shape)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None):
        group: Fp8LinearGroup = ctx.group
        plan: _StepPlan = ctx.plan
        n = len(group.members)
        if ctx.saved_fp8:
            xdata, xscale, *weights = ctx.saved_tensors
            xq, x_hp = QuantizedTensor.trusted(xdata, xscale, ctx.x_block), None
        else:
            x_hp, *weights = ctx.saved_tensors
            xq = None
        gy = group.stacked_grad(grads)
        need_w = ctx.needs_input_grad[3:3 + n]
        need_b = ctx.needs_input_grad[3 + n:]
        # The FP8 GEMMs read the stacked Q(W) from the group; only a high-precision DGrad/WGrad needs the BF16 stack.
        weight = weights[0] if plan.fp8_dgrad and plan.fp8_wgrad else torch.cat(weights)
        grad_x, grad_w = _input_and_weight_grads(group, plan, ctx.wq, weight, xq, x_hp, gy, ctx.needs_input_grad[0],
                                                 any(need_w), ctx.x_dtype)
        if grad_x is not None:
            grad_x = grad_x.reshape(ctx.x_shape)
        # A member whose output took no part in the loss gets no gradient, as it would on its own (not zeros).
        grad_ws = [None] * n if grad_w is None else [
            g if need and dy is not None else None for g, need, dy in zip(grad_w.split(group.sizes), need_w, grads)]
        grad_bs: list = []
        if need_b:
            sums = gy.sum(0).split(group.sizes)
            grad_bs = [s.to(m.bias.dtype) if need and dy is not None else None
                       for s, m, need, dy in zip(sums, group.members, need_b, grads)]
        return (grad_x, None, None, *grad_ws, *grad_bs)


class Fp8LinearGroup:
    """Sibling `Fp8Linear` layers whose GEMMs run as one (see the module docstring). Not a module: it owns no
    parameters; each member points to it (`Fp8Linear._group`) and the members keep their names and weights.

    `owner` (the members' parent module) keeps the group alive; the members refer to it weakly, so a deleted model
    is freed at once, GPU memory included, instead of waiting for Python's cycle collector."""

    def __init__(self, members: Sequence[Fp8Linear], names: Sequence[str], owner: nn.Module, fqn: str = "") -> None:
        self.members = tuple(members)
        self.label = "+".join(names)
        self.fqn = fqn
        self.sizes = tuple(m.out_features for m in self.members)
        self.total = sum(self.sizes)
        self.has_bias = self.members[0].bias is not None
        self.off: str | None = None  # why the group runs its members separately from now on
        self._checked = False  # its first stacked GEMM was compared with the members' own (once: it syncs the host)
        self._tries = 0
        self.release()
        self.dissolved = False
        owned = [g for g in owner.__dict__.get(_OWNED, ()) if not g.dissolved]  # groups undone earlier go
        owner.__dict__[_OWNED] = [*owned, self]
        self._attach()
        _groups.add(self)

    def _attach(self) -> None:
        ref = weakref.ref(self)
        for m in self.members:
            m._group_ref, m._group_skipped = ref, None

    def release(self) -> None:
        """Drop the stacked FP8 weights and any kept columns (the weights changed, or the group is undone)."""
        self._stash: _Stash | None = None
        self._misses = 0
        # (member cache keys or None, Q(W_stacked), {backend: prepared}, the members' row views); the transpose's
        # entry is keyed by that Q(W_stacked) itself.
        self._wq_cache: tuple | None = None
        self._wq_t_cache: tuple | None = None

    def dissolve(self, why: str | None = None) -> None:
        """Return the members to their own GEMMs for good (`why`: recorded on them, for the precision graph)."""
        self.release()
        self.dissolved = True
        for m in self.members:
            m._group_ref, m._group_skipped = None, why

    def __getstate__(self) -> dict:  # pickling / deepcopy: no stash (weak references) and no derived FP8 weights
        state = dict(self.__dict__)
        state.update(_stash=None, _misses=0, _wq_cache=None, _wq_t_cache=None, _checked=False)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if not self.__dict__.setdefault("dissolved", False):
            self._attach()  # the copies of its members: their weak references are not copied
        _groups.add(self)

    # ---- the forward seam ----------------------------------------------------------------------------------
    def output_for(self, member: Fp8Linear, x: torch.Tensor) -> torch.Tensor | None:
        """`member(x)`: its columns of the group's GEMM for x, or None to run the member on its own."""
        if self.off is not None or x.is_inference() or _capturing():
            return None
        i = 0
        for m in self.members:
            if m is member:
                break
            i += 1
        grad = torch.is_grad_enabled()
        stash = self._stash
        if stash is not None:
            out = stash.take(i, x, grad)
            if out is not None:
                if stash.left == 0:
                    self._stash, self._misses = None, 0
                return out
            # Columns computed for siblings that never asked for them (or asked with another input).
            self._stash = None
            self._misses += 1
            if self._misses >= _MAX_MISSES:
                self._turn_off(f"{self.label} did not read one input (columns computed for a sibling were never "
                               "asked for); they run separately", "inputs")
                return None
        if not self._weights_usable():
            return None
        outs = self._run(x)
        if not self._checked:
            self._check(x, outs)
            if self.off is not None:
                return None
        self._stash = _Stash(x, grad, [None if j == i else o for j, o in enumerate(outs)], len(outs) - 1)
        return outs[i]

    def _check(self, x: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        """Compare the group's first stacked GEMM with its members' own GEMMs on the first rows (once per group; a
        device probe of the stacked path as the backends run it). A difference turns the group off, warned once."""
        rows = x.detach().reshape(-1, x.shape[-1])[:_CHECK_ROWS]
        worst = 0.0
        with torch.no_grad():
            for m, out in zip(self.members, outs):
                want = _fprop(m, m._plan(x.device), rows, m.weight, m.bias, x.dtype)[0].float()
                if not torch.isfinite(want).all():
                    # Inputs this GEMM overflows on prove nothing: check a later call (a few, each syncs the host).
                    self._tries += 1
                    self._checked = self._tries >= _CHECK_TRIES
                    return
                got = out.detach().reshape(-1, out.shape[-1])[: rows.shape[0]].float()
                worst = max(worst, float((got - want).norm() / want.norm().clamp_min(1e-30)))
        self._checked = True
        if not worst <= _CHECK_TOL:  # NaN included
            backend = self.members[0].backend_for(x.device)
            self._turn_off(f"the stacked GEMM of {self.label} differs from their own GEMMs by {worst:.3g} (relative) "
                           f"on {x.device.type} ({backend}); they run separately", "check")

    def _weights_usable(self) -> bool:
        """False under ZeRO-3 (each member's weight is gathered by its own hooks) and for installed engine weights."""
        for m in self.members:
            if m._installed is not None or _is_zero3_param(m._parameters.get("weight")):
                return False
        return True

    def _turn_off(self, why: str, kind: str) -> None:
        self.off = why
        self.release()
        if (self.label, kind) not in _warned:  # once per kind of failure, not once per layer
            _warned.add((self.label, kind))
            logger.warning("jetrl_precision: %s (%s; first seen at %s)", why, "fused projections off for this group", self.fqn or "<root>")

    def _run(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        plan = self.members[0]._plan(x.device)
        params = [m._parameters["weight"] for m in self.members]
        if self.has_bias:
            params += [m._parameters["bias"] for m in self.members]
        if torch.is_grad_enabled() and (x.requires_grad or any([p.requires_grad for p in params])):
            return _Fp8GroupFunction.apply(x, self, plan, *params)
        y = _fprop(self, plan, x.reshape(-1, x.shape[-1]), None, self.stacked_bias(), x.dtype)[0]
        return self.split(y, x.shape)

    def split(self, y: torch.Tensor, x_shape: torch.Size) -> tuple[torch.Tensor, ...]:
        """The members' outputs, shaped like x: column blocks of the stacked [M, sum(N_i)] result that alias it
        without being views (a model may write them in place)."""
        return tuple(torch.unsafe_split_with_sizes(y.view(*x_shape[:-1], self.total), list(self.sizes), dim=-1))

    def stacked_bias(self) -> torch.Tensor | None:
        return torch.cat([m.bias for m in self.members]) if self.has_bias else None

    def stacked_grad(self, grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """dY of the stacked GEMM, [M, sum(N_i)]: the members' output gradients side by side, without a copy when
        they already are (the fused SwiGLU backward writes d(gate) and d(up) so for stacked gate and up); a member
        whose output took no part in the loss contributes zeros."""
        ref = next(g for g in grads if g is not None)
        rows = ref.numel() // ref.shape[-1]
        parts = [g.reshape(rows, n) if g is not None else ref.new_zeros(rows, n) for g, n in zip(grads, self.sizes)]
        if column_blocks_of_one(parts):
            first = parts[0]
            return first.as_strided((rows, self.total), (self.total, 1), first.storage_offset())
        return torch.cat(parts, dim=1)

    # ---- weights: the duck type `linear._fprop` and `linear._input_and_weight_grads` read --------------------
    def _stacked_entry(self) -> tuple:
        members = self.members
        keys = tuple([m._cache_key(m._parameters["weight"]) for m in members])
        cached = self._wq_cache
        if cached is not None and cached[0] == keys:
            valid = True
            for m, view in zip(members, cached[3]):  # a member re-quantized on its own (invalidate_cache) voids it
                own = m._wq_cache
                if own is None or own[1] is not view:
                    valid = False
                    break
            if valid:
                return cached
        with torch.no_grad():
            wq = ops.quantize(torch.cat([m.weight.detach() for m in members]), members[0].fprop.weight)
        if None in keys:  # weights not kept between calls (requantize_weights, or no cache): nothing to share
            return (None, wq, {}, ())
        views = []
        for m, key, (start, stop) in zip(members, keys, _bounds(self.sizes)):
            view = QuantizedTensor.trusted(wq.data[start:stop], wq.scale[start // _ROWS:-(-stop // _ROWS)], wq.block)
            # Each member's cached Q(W) is its rows of the stacked one: the weight sync reads the same bytes, and
            # they cost no memory of their own.
            m._wq_cache, m._wq_t_cache = (key, view, {}), None
            views.append(view)
        self._wq_cache, self._wq_t_cache = (keys, wq, {}, tuple(views)), None
        return self._wq_cache

    def _weight_operands(self, weight: Any, plan: _StepPlan) -> tuple[QuantizedTensor, object, bool]:
        keys, wq, prepared, _ = self._stacked_entry()
        name = plan.backend
        if name not in prepared:
            prepared[name] = plan.gemm.weight(wq)
        return wq, prepared[name], keys is not None

    def _dgrad_operands(self, wq: QuantizedTensor | None, weight: Any, plan: _StepPlan) -> tuple[QuantizedTensor, object]:
        return dgrad_operands(self, wq if wq is not None else self._stacked_entry()[1], plan)

    def __repr__(self) -> str:
        state = "off: " + self.off if self.off else "on"
        return f"Fp8LinearGroup({self.fqn or '<root>'}: {self.label}, N={'+'.join(map(str, self.sizes))}, {state})"


def _bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """(first row, end row) of each member in the stacked weight."""
    ends = list(itertools.accumulate(sizes))
    return [(end - n, end) for end, n in zip(ends, sizes)]


def _why_not(members: Sequence[Fp8Linear], names: Sequence[str]) -> str | None:
    """Why these siblings cannot run as one GEMM with unchanged bytes, or None."""
    first = members[0]
    if any(m.frozen for m in members):
        return "they are frozen (their FP8 weights are kept apart, not as one stacked weight)"
    if not (first.fprop.input.is_fp8 and first.fprop.weight.is_fp8):
        return "the recipe runs their forward GEMM in high precision"
    if first.fprop.weight.granularity is not Granularity.BLOCK_128x128:
        return f"their weights are scaled per {first.fprop.weight.granularity.value}, not per 128x128 block"
    same = ("in_features", "fprop", "backward_spec", "gemm_backend", "backward_gemm_backend", "cache_weights")
    for attr in same:
        if any(getattr(m, attr) != getattr(first, attr) for m in members[1:]):
            return f"their {attr} differ"
    if any(m.weight.dtype != first.weight.dtype or m.weight.device != first.weight.device for m in members[1:]):
        return "their weights differ in dtype or device"
    if any((m.bias is None) != (first.bias is None) for m in members[1:]):
        return "only some of them have a bias"
    for name, m in zip(names[:-1], members[:-1]):
        if m.out_features % _ROWS:
            return (f"{name} has {m.out_features} rows, not a multiple of {_ROWS}: the stacked weight's 128x128 "
                    "blocks would straddle two layers")
    return None


def fuse_projections(model: nn.Module, groups: Iterable[Sequence[str]] = PROJECTION_GROUPS) -> int:
    """Tie every set of sibling FP8 projections named in `groups` (children of one module) into an
    `Fp8LinearGroup`; returns how many groups were formed. Sets that cannot be fused with unchanged bytes keep
    running separately, logged once per reason and recorded on their members (`build_precision_graph` shows it)."""
    formed: dict[str, int] = {}
    skipped: dict[str, tuple[str, int]] = {}
    for fqn, parent in model.named_modules():
        for names in groups:
            members = [parent._modules.get(n) for n in names]
            if not all(isinstance(m, Fp8Linear) for m in members) or any(m._group is not None for m in members):
                continue
            label = "+".join(names)
            why = _why_not(members, names)
            if why is not None:
                for m in members:
                    m._group_skipped = why
                first, count = skipped.get(label + why, (f"{fqn}: {why}", 0))
                skipped[label + why] = (first, count + 1)
                continue
            Fp8LinearGroup(members, names, parent, fqn)
            formed[label] = formed.get(label, 0) + 1
    if formed:
        logger.info("fuse_projections: %s run as one FP8 GEMM each",
                    ", ".join(f"{n} {label}" for label, n in formed.items()))
    for first, count in skipped.values():
        logger.warning("fuse_projections: %d group(s) run separately, e.g. %s", count, first)
    return sum(formed.values())


def unfuse_projections(model: nn.Module) -> int:
    """Return every grouped projection of `model` to its own GEMM; returns how many groups were undone."""
    groups = projection_groups(model)
    for group in groups:
        group.dissolve()
    return len(groups)


def adopt_projection_groups(old: nn.Module, new: nn.Module) -> None:
    """Hand the groups `old` holds to `new`, a module that takes over old's children (a parent replaced by module
    surgery); without it the groups go with `old` and their members run separately from then on."""
    groups = old.__dict__.pop(_OWNED, None)
    if groups:
        new.__dict__[_OWNED] = [*new.__dict__.get(_OWNED, ()), *groups]


def projection_groups(model: nn.Module) -> list[Fp8LinearGroup]:
    """The model's groups, in module order."""
    seen: dict[int, Fp8LinearGroup] = {}
    for m in model.modules():
        if isinstance(m, Fp8Linear) and m._group is not None:
            seen.setdefault(id(m._group), m._group)
    return list(seen.values())


def _release_all() -> None:
    for group in list(_groups):
        group.release()


_weights_updated_hooks.append(_release_all)
