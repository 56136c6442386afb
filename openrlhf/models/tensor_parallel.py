"""FP8 linears under DeepSpeed AutoTP: DeepSpeed shards first, then each shard gets the FP8 flow.

`deepspeed.initialize` with `tensor_parallel.autotp_size` replaces a model's nn.Linear layers with its
column-parallel `LinearLayer` (q/k/v/gate/up: rank r holds a block of output rows) and row-parallel
`LinearAllreduce` (o/down: a block of input columns; the partial outputs are all-reduced).
`convert_autotp_to_fp8` then swaps those for FP8 layers that adopt the same shard Parameters and keep
DeepSpeed's collectives around an `Fp8Linear` GEMM.

Why the numerics stay those of the unsharded layer: with every shard a multiple of 128 along the split,
  - column parallel: the 128x128 weight blocks of a shard are blocks of the whole weight, and the input is
    whole, so its 1x128 groups are the unsharded ones: each rank computes exactly its rows of the output;
  - row parallel: a rank sees its 128-aligned slice of the input, so every 1x128 group and every 128x128
    block lies within one rank and quantizes to the unsharded bytes; the all-reduce sums the partial GEMMs
    in another order than one GEMM's K loop (equal up to fp32 accumulation rounding).
`gather_quantized_weight` reassembles the whole FP8 weight (bytes and scales) from the shards, which
is what a weight sync would send to an unsharded rollout engine.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from jetrl_precision import Fp8Linear, PrecisionRecipe, QuantizedTensor, get_recipe

__all__ = ["Fp8ColumnParallelLinear", "Fp8RowParallelLinear", "convert_autotp_to_fp8", "gather_quantized_weight"]

BLOCK = 128


class _Fp8ShardLinear(Fp8Linear):
    """An Fp8Linear over one tensor-parallel shard, remembering how the whole weight was split."""

    split_dim: int  # 0: output rows (column parallel), 1: input columns (row parallel)

    @classmethod
    def from_autotp(cls, layer: nn.Module, recipe: PrecisionRecipe, fqn: str) -> "_Fp8ShardLinear":
        weight = layer.weight
        sizes = tuple(layer._partition_sizes)
        if len(set(sizes)) != 1 or sizes[0] % BLOCK:
            raise ValueError(
                f"{fqn}: AutoTP split {tuple(layer._orig_weight_shape)} into shards of {sizes} along dim {cls.split_dim}; "
                f"FP8 needs equal shards that are multiples of {BLOCK}, or 128x128 blocks and 1x128 groups would straddle ranks"
            )
        with torch.device("meta"):
            new = cls(weight.shape[1], weight.shape[0], bias=False)
        new.weight = weight
        new.bias = layer.bias
        new.fprop, new.backward_spec, new.gemm_backend, new.fqn = recipe.train_fprop, recipe.train_backward, recipe.gemm_backend, fqn
        new.mp_group, new.tp_world_size, new.tp_index = layer.mp_group, layer.tp_world_size, layer.tp_index
        new.full_shape = tuple(layer._orig_weight_shape)
        return new


class Fp8ColumnParallelLinear(_Fp8ShardLinear):
    """DeepSpeed's LinearLayer in FP8: the whole input, this rank's output rows (gradients all-reduced in backward)."""

    split_dim = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepspeed.module_inject.layers import ColumnParallel

        if self.mp_group is not None:
            x = ColumnParallel.apply(self.mp_group, x)  # identity forward; all-reduces the input gradient
        return super().forward(x)


class Fp8RowParallelLinear(_Fp8ShardLinear):
    """DeepSpeed's LinearAllreduce in FP8: this rank's input columns, partial outputs all-reduced."""

    split_dim = 1

    @classmethod
    def from_autotp(cls, layer: nn.Module, recipe: PrecisionRecipe, fqn: str) -> "Fp8RowParallelLinear":
        if layer.bias is not None:
            # The bias is added once, after the all-reduce; an Fp8Linear would add it on every rank.
            raise ValueError(f"{fqn}: a row-parallel layer with a bias is not supported in FP8 (Llama/Qwen/Mistral have none)")
        return super().from_autotp(layer, recipe, fqn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from deepspeed.module_inject.layers import RowParallel

        y = super().forward(x)
        return RowParallel.apply(self.mp_group, y, False) if self.mp_group is not None else y


def convert_autotp_to_fp8(model: nn.Module, recipe: PrecisionRecipe | str) -> nn.Module:
    """Swap the AutoTP layers of a sharded model (after `deepspeed.initialize`) for FP8 ones, in place, keeping
    the shard Parameters; layers the recipe keeps in high precision stay DeepSpeed's. Returns the model."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer

    recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
    if not recipe.train_fprop.is_fp8:
        return model
    swaps = {LinearLayer: Fp8ColumnParallelLinear, LinearAllreduce: Fp8RowParallelLinear}
    for fqn, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            child_fqn = f"{fqn}.{name}" if fqn else name
            cls = swaps.get(type(child))
            if cls is not None and not recipe.keeps_high_precision(child_fqn):
                setattr(module, name, cls.from_autotp(child, recipe, child_fqn))
    return model


@torch.no_grad()
def gather_quantized_weight(layer: _Fp8ShardLinear) -> QuantizedTensor:
    """The whole layer's FP8 weight, reassembled from every rank's shard (bytes and scales, in rank order);
    a collective over the layer's tensor-parallel group."""
    wq = layer.quantized_weight()
    if layer.mp_group is None or layer.tp_world_size == 1:
        return wq
    data = wq.data.view(torch.uint8).contiguous()
    scale = wq.scale.contiguous()
    parts = [torch.empty_like(data) for _ in range(layer.tp_world_size)]
    scales = [torch.empty_like(scale) for _ in range(layer.tp_world_size)]
    dist.all_gather(parts, data, group=layer.mp_group)
    dist.all_gather(scales, scale, group=layer.mp_group)
    d = layer.split_dim
    return QuantizedTensor(torch.cat(parts, dim=d).view(wq.data.dtype), torch.cat(scales, dim=d), wq.block)
