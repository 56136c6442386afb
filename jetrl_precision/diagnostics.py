"""Per-layer FP8 error on a real model: how much each linear loses to the recipe's quantization.

`diagnose_linears(model, recipe, run)` hooks every nn.Linear the recipe would convert, runs
`run()` (a forward of the high-precision model on the user's data), and for each layer's actual
input measures, against a float64 reference:

- the quantization SQNR of the input (1x128) and the weight (128x128) on their own,
- the SQNR of the FP8 forward output y = Q(x) . Q(W)^T,
- with the recipe's FP8 backward, the SQNR of dX and dW for a random upstream gradient
  (the data's own gradient would need a loss; a random dY exercises the same quantizers),
- the input's peak-to-RMS ratio and the fraction of its nonzero values that land below e4m3's
  smallest normal (2^-6) after scaling: an outlier channel sets its groups' scales, and e4m3's
  range absorbs ratios of a few hundred, but beyond that the small values of those groups go
  subnormal (fewer significant bits) or to zero. SQNR alone hides this, since it is dominated
  by the outlier's energy.

Only local errors are measured: each layer sees the high-precision model's input, so errors do
not compound through depth (the end-to-end effect is what the rollout-train mismatch measures).
The model is not modified; gradients go to private copies of the weights.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
from torch import nn

from . import ops
from .convert import default_module_filter
from .formats import E4M3_MIN_NORMAL
from .linear import Fp8Linear
from .recipe import PrecisionRecipe, get_recipe

__all__ = [
    "LinearDiagnostics",
    "diagnose_linears",
    "sqnr_db",
    "format_diagnostics",
    "E4M3_MIN_NORMAL",
    "DEFAULT_MIN_SQNR_DB",
    "DEFAULT_MAX_SUBNORMAL_FRAC",
]

DEFAULT_MIN_SQNR_DB = 20.0
DEFAULT_MAX_SUBNORMAL_FRAC = 0.01


def sqnr_db(approx: torch.Tensor, ref: torch.Tensor) -> float:
    """10 log10(|ref|^2 / |approx - ref|^2) in float64; inf when exact."""
    ref64 = ref.double()
    noise = (approx.double() - ref64).square().sum().item()
    signal = ref64.square().sum().item()
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


@dataclass(frozen=True)
class LinearDiagnostics:
    fqn: str
    out_features: int
    in_features: int
    tokens: int
    x_peak_to_rms: float
    x_subnormal_frac: float
    sqnr_x_db: float
    sqnr_w_db: float
    sqnr_y_db: float
    sqnr_dx_db: float | None
    sqnr_dw_db: float | None

    def worst_db(self) -> float:
        return min(v for v in (self.sqnr_y_db, self.sqnr_dx_db, self.sqnr_dw_db) if v is not None)

    def problems(self, min_sqnr_db: float = DEFAULT_MIN_SQNR_DB, max_subnormal_frac: float = DEFAULT_MAX_SUBNORMAL_FRAC) -> list[str]:
        """Why this layer is a poor FP8 candidate (empty when it is fine)."""
        out = []
        if self.worst_db() < min_sqnr_db:
            out.append(f"SQNR {self.worst_db():.1f} dB < {min_sqnr_db:.0f}")
        if self.x_subnormal_frac > max_subnormal_frac:
            out.append(f"{100 * self.x_subnormal_frac:.1f}% of inputs subnormal")
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fresh_linear(weight: torch.Tensor) -> nn.Linear:
    """An nn.Linear over a private copy of `weight`, so backward never touches the model's .grad."""
    with torch.device("meta"):
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    lin.weight = nn.Parameter(weight.detach().clone())
    return lin


def _diagnose_one(fqn: str, module: nn.Linear, x: torch.Tensor, recipe: PrecisionRecipe, gemm_backend: str, backward: bool, seed: int) -> LinearDiagnostics:
    fprop = recipe.train_fprop if recipe.train_fprop.is_fp8 else recipe.rollout
    bw = recipe.train_backward if (backward and recipe.train_fprop.is_fp8 and recipe.train_backward.is_fp8) else None
    w = module.weight.detach()
    x = x.detach()
    x64, w64 = x.double(), w.double()
    rms = x64.square().mean().sqrt().item()
    peak = x64.abs().max().item()
    if fprop.input.is_fp8:
        xq = ops.quantize(x, fprop.input)
        sqnr_x = sqnr_db(xq.dequantize(torch.float64), x64)
        nonzero = x != 0
        small = xq.data.float().abs() < E4M3_MIN_NORMAL
        subnormal = (small & nonzero).sum().item() / max(nonzero.sum().item(), 1)
    else:
        sqnr_x, subnormal = math.inf, 0.0
    sqnr_w = sqnr_db(ops.quantize(w, fprop.weight).dequantize(torch.float64), w64) if fprop.weight.is_fp8 else math.inf
    y_ref = x64 @ w64.t()
    layer = Fp8Linear.from_linear(_fresh_linear(w), fprop, bw, gemm_backend=gemm_backend, fqn=fqn)
    sqnr_dx = sqnr_dw = None
    if bw is None:
        with torch.no_grad():
            sqnr_y = sqnr_db(layer(x), y_ref)
    else:
        g = torch.Generator(device="cpu").manual_seed(seed)
        dy = torch.randn(x.shape[0], w.shape[0], generator=g).to(device=x.device, dtype=x.dtype)
        xx = x.clone().requires_grad_(True)
        with torch.enable_grad():
            y = layer(xx)
            y.backward(dy)
        sqnr_y = sqnr_db(y.detach(), y_ref)
        dy64 = dy.double()
        sqnr_dx = sqnr_db(xx.grad, dy64 @ w64)
        sqnr_dw = sqnr_db(layer.weight.grad, dy64.t() @ x64)
    return LinearDiagnostics(
        fqn=fqn, out_features=w.shape[0], in_features=w.shape[1], tokens=x.shape[0],
        x_peak_to_rms=peak / rms if rms > 0 else math.inf, x_subnormal_frac=subnormal,
        sqnr_x_db=sqnr_x, sqnr_w_db=sqnr_w, sqnr_y_db=sqnr_y, sqnr_dx_db=sqnr_dx, sqnr_dw_db=sqnr_dw,
    )


def diagnose_linears(
    model: nn.Module,
    recipe: PrecisionRecipe | str,
    run: Callable[[], Any],
    *,
    module_filter: Callable[[nn.Module, str], bool] | None = None,
    gemm_backend: str = "auto",
    backward: bool = True,
    max_tokens: int = 2048,
    seed: int = 0,
) -> list[LinearDiagnostics]:
    """Run `run()` once with hooks on the recipe's linears; one LinearDiagnostics per layer, model order.

    `model` must be the unconverted (high-precision) model. Each layer keeps the first
    `max_tokens` rows of its input from the first call (later calls, e.g. decoding steps, are
    ignored). Raises ValueError if the recipe has no FP8 GEMM or no layer matches.
    """
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    if not (recipe.train_fprop.is_fp8 or recipe.rollout.is_fp8):
        raise ValueError(f"recipe {recipe.name!r} has no FP8 GEMM: nothing to diagnose (try jet_fp8)")
    if any(isinstance(m, Fp8Linear) for m in model.modules()):
        raise ValueError("diagnose_linears needs the high-precision model: it already holds Fp8Linear layers")
    keep = module_filter or default_module_filter(recipe)
    targets = [(fqn, m) for fqn, m in model.named_modules() if type(m) is nn.Linear and keep(m, fqn)]
    if not targets:
        raise ValueError(f"no nn.Linear in the model matches recipe {recipe.name!r}'s filter")
    results: dict[str, LinearDiagnostics] = {}

    def hook(fqn: str):
        def fn(module: nn.Module, args: tuple, _out: Any) -> None:
            if fqn in results:
                return
            x = args[0].detach()
            x2 = x.reshape(-1, x.shape[-1])[:max_tokens]
            results[fqn] = _diagnose_one(fqn, module, x2, recipe, gemm_backend, backward, seed)

        return fn

    handles = [m.register_forward_hook(hook(fqn)) for fqn, m in targets]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return [results[fqn] for fqn, _ in targets if fqn in results]


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return "inf" if math.isinf(v) else f"{v:.1f}"


def format_diagnostics(
    diags: list[LinearDiagnostics],
    min_sqnr_db: float = DEFAULT_MIN_SQNR_DB,
    max_subnormal_frac: float = DEFAULT_MAX_SUBNORMAL_FRAC,
    limit: int = 20,
) -> str:
    """A table, flagged layers first then the lowest SQNR, and a one-line summary."""
    flagged = {d.fqn: d.problems(min_sqnr_db, max_subnormal_frac) for d in diags}
    rows = sorted(diags, key=lambda d: (not flagged[d.fqn], d.worst_db()))
    head = (f"{'layer':48s} {'shape':>12s} {'peak/rms':>8s} {'x subn.':>7s} {'x dB':>6s} {'W dB':>6s} {'y dB':>6s}"
            f" {'dX dB':>6s} {'dW dB':>6s}")
    lines = [head]
    for d in rows[:limit]:
        flag = f"  <-- {'; '.join(flagged[d.fqn])}" if flagged[d.fqn] else ""
        lines.append(
            f"{d.fqn[-48:]:48s} {f'{d.out_features}x{d.in_features}':>12s} {d.x_peak_to_rms:8.1f} {100 * d.x_subnormal_frac:6.2f}% "
            f"{_fmt(d.sqnr_x_db):>6s} {_fmt(d.sqnr_w_db):>6s} {_fmt(d.sqnr_y_db):>6s} {_fmt(d.sqnr_dx_db):>6s} {_fmt(d.sqnr_dw_db):>6s}{flag}"
        )
    if len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more layers")
    ys = sorted(d.sqnr_y_db for d in diags)
    n_bad = sum(1 for v in flagged.values() if v)
    lines.append(
        f"{len(diags)} FP8 linears; output SQNR median {ys[len(ys) // 2]:.1f} dB, worst {ys[0]:.1f} dB; "
        + (f"{n_bad} layer(s) flagged" if n_bad else f"none flagged (SQNR >= {min_sqnr_db:.0f} dB, subnormal inputs <= {100 * max_subnormal_frac:.0f}%)")
    )
    return "\n".join(lines)
