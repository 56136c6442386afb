"""DeepSpeed sleep (--ds.enable_sleep) on real DeepSpeed engines (gloo, CPU): the state is parked
in host memory (its device storages freed) and restored so exactly that training continues bit
for bit as if it had never slept."""

from __future__ import annotations

import pytest
import torch

from jetrl_precision import convert_to_fp8, get_recipe, mark_weights_updated
from openrlhf.utils.deepspeed import DeepspeedStrategy, StrategyConfig
from openrlhf.utils.deepspeed.sleep import EngineSleeper, _engine_tensors

pytestmark = pytest.mark.integration


def _engine(stage: int):
    st = DeepspeedStrategy(StrategyConfig(zero_stage=stage, param_dtype="fp32", micro_batch_size=2, train_batch_size=2))
    st.setup_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 384), torch.nn.GELU(), torch.nn.Linear(384, 128))
    convert_to_fp8(model, get_recipe("jet_fp8"), side="train")
    opt = st.make_optimizer(model, 1e-3, (0.9, 0.95), 1e-8, 0.01)
    return st.prepare(model, opt)


def _step(engine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 256, generator=g)
    engine.backward(engine(x).square().mean())
    engine.step()
    mark_weights_updated()


def _state(engine) -> dict[str, torch.Tensor]:
    out = {n: p.detach().clone() for n, p in engine.module.named_parameters() if p.numel()}
    for i, p in enumerate(engine.optimizer.optimizer.param_groups[0]["params"]):
        out[f"master{i}"] = p.detach().clone()
        out.update({f"opt{i}.{k}": v.clone() for k, v in engine.optimizer.optimizer.state[p].items() if torch.is_tensor(v)})
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_sleep_frees_state_and_training_resumes_bit_exact(stage, single_thread):
    slept, plain = _engine(stage), _engine(stage)
    _step(slept, 1)
    _step(plain, 1)
    sleeper = EngineSleeper(slept)
    freed = sleeper.sleep()
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in slept.module.parameters())
    # fp32 weights + fp32 master + two Adam moments, at least (one rank holds every partition).
    assert freed >= 4 * n_params * 4, (freed, n_params)
    # Every parameter, master weight and optimizer state now holds zero bytes on the device.
    assert sleeper.asleep and all(t.untyped_storage().nbytes() == 0 for t in _engine_tensors(slept))
    sleeper.wake()
    assert not sleeper.asleep and sleeper.parked_bytes() == 0
    _step(slept, 2)
    _step(plain, 2)
    a, b = _state(slept), _state(plain)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
