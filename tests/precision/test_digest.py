"""The weight-sync digest: a device-side checksum of raw bytes (trainer and engine compare it after every sync)."""

from __future__ import annotations

import pytest
import torch

from jetrl_precision.weight_sync import _DIGEST_A, _DIGEST_CHUNK, _DIGEST_P, digest


def _reference(raw: bytes) -> str:
    """The definition, in plain Python integers."""
    m = _DIGEST_P - 1
    sums = [sum(b * ((i % m) * a % m + 1) for i, b in enumerate(raw)) % _DIGEST_P for a in _DIGEST_A]
    return f"{sums[0]:08x}{sums[1]:08x}-{len(raw)}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint8])
def test_digest_equals_its_definition(dtype):
    x = (torch.randn(37, 53) * 3).to(dtype) if dtype != torch.uint8 else torch.randint(0, 256, (37, 53), dtype=torch.uint8)
    raw = x.contiguous().view(torch.uint8).reshape(-1).tolist() if x.element_size() == 1 else x.reshape(-1).view(torch.uint8).tolist()
    assert digest(x) == _reference(bytes(raw))


def test_digest_across_chunks_and_every_single_byte_flip():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (_DIGEST_CHUNK + 1000,), dtype=torch.uint8, generator=g)
    d = digest(x)
    assert d.endswith(f"-{x.numel()}") and digest(x.clone()) == d
    for pos in (0, 1, _DIGEST_CHUNK - 1, _DIGEST_CHUNK, x.numel() - 1):  # chunk edges included
        for delta in (1, 128, 255):
            y = x.clone()
            y[pos] = (int(y[pos]) + delta) % 256
            assert digest(y) != d, (pos, delta)
    # Layout does not matter, bytes do: a non-contiguous view digests as its contiguous copy.
    m = torch.randn(64, 48)
    assert digest(m.t()) == digest(m.t().contiguous()) != digest(m)


def test_digest_of_empty_tensor():
    assert digest(torch.empty(0)) == "0000000000000000-0"
