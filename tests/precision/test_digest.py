"""The weight-sync digest: a device-side checksum of raw bytes (trainer and engine compare it after every sync)."""

from __future__ import annotations

import pytest
import torch

from jetrl_precision.digests import _DIGEST_A, _DIGEST_CHUNK, _DIGEST_P, digest


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


# ---- digests of pieces (a tensor-parallel engine's shards) ---------------------------------------------
def _tp_pieces(x: torch.Tensor, tp: int, dim: int) -> list[tuple[torch.Tensor, tuple[int, int]]]:
    """x split into tp contiguous windows along dim, as tensor-parallel ranks hold them (views, not copies)."""
    size = x.shape[dim] // tp
    return [(x.narrow(dim, r * size, size), (r * size, 0) if dim == 0 else (0, r * size)) for r in range(tp)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("dim", [0, 1])
def test_shards_combine_into_the_whole_tensors_digest(dtype, dim):
    from jetrl_precision.digests import combine_digest_parts, digest_part

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(96, 160, generator=g) * torch.exp(2 * torch.randn(96, 1, generator=g))).to(dtype)
    whole = digest(x)
    for tp in (1, 2, 4, 8):
        parts = [digest_part(p, x.shape, off) for p, off in _tp_pieces(x, tp, dim)]
        assert combine_digest_parts(parts) == whole, (tp, dim)
        # the order the ranks answer in does not matter
        assert combine_digest_parts(parts[::-1]) == whole
    # replicas (every rank holding the same window, e.g. a norm) count once
    full = digest_part(x)
    assert combine_digest_parts([full, full, full]) == whole


def test_piece_sums_cover_long_rows_and_one_dimensional_tensors(monkeypatch):
    """Rows longer than a chunk are cut into segments: shrink the chunk so that the test's rows cross it."""
    from jetrl_precision import digests

    monkeypatch.setattr(digests, "_DIGEST_CHUNK", 64)
    monkeypatch.setattr(digests, "_digest_base", {})
    x = torch.randn(12, 50)  # 200-byte rows: four segments each
    parts = [digests.digest_part(p, x.shape, off) for p, off in _tp_pieces(x, 2, 1)]
    assert digests.combine_digest_parts(parts) == _reference(bytes(x.reshape(-1).view(torch.uint8).tolist()))
    b = torch.randn(40)  # a bias, sharded by rows
    parts = [digests.digest_part(b[r * 10 : (r + 1) * 10], (40, 1), (r * 10, 0)) for r in range(4)]
    assert digests.combine_digest_parts(parts) == _reference(bytes(b.view(torch.uint8).tolist()))


def test_pieces_that_do_not_make_one_tensor_are_refused():
    from jetrl_precision.digests import DigestPartsError, combine_digest_parts, digest_part

    x = torch.randn(8, 256)
    left, right = x[:, :128], x[:, 128:]
    with pytest.raises(DigestPartsError, match="cover 4096 of the tensor's 8192 bytes"):
        combine_digest_parts([digest_part(left, x.shape, (0, 0))])  # a rank's answer missing
    with pytest.raises(DigestPartsError, match="overlap"):
        combine_digest_parts([digest_part(x[:, :192], x.shape, (0, 0)), digest_part(right, x.shape, (0, 128))])
    bad = right.clone()
    bad[0, 0] += 1
    with pytest.raises(DigestPartsError, match="replicas of the window"):
        combine_digest_parts([digest_part(left, x.shape, (0, 0)), digest_part(right, x.shape, (0, 128)),
                              digest_part(bad, x.shape, (0, 128))])
    with pytest.raises(DigestPartsError, match="different tensors"):
        combine_digest_parts([digest_part(left, x.shape, (0, 0)), digest_part(right.double(), x.shape, (0, 128))])
    with pytest.raises(DigestPartsError, match="does not fit"):
        digest_part(left, x.shape, (0, 200))
    # a one-byte change on one rank changes the combined digest
    moved = right.clone()
    moved.view(torch.uint8)[3, 5] ^= 1
    assert combine_digest_parts([digest_part(left, x.shape, (0, 0)), digest_part(moved, x.shape, (0, 128))]) != digest(x)
