"""The ddp baseline's gradient allreduce: bf16 exactly for a bf16 job over NCCL, and the mean either way."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

from baselines.ddp import allreduce_hook, allreduce_mean


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_bf16_hook_only_for_bf16_over_nccl(backend: str, precision: str) -> None:
    hook = allreduce_hook(backend, precision)
    assert hook is (bf16_compress_hook if (backend, precision) == ("nccl", "bf16") else None)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_hook_reduces_in_bf16_into_the_fp32_gradients(one_rank_group: None) -> None:
    """The hook is called with the flat gradients as a one-tensor bucket: it must write the mean,
    rounded to bf16, back into that fp32 tensor (what torch.optim then reads)."""
    grads = torch.tensor([1.0, 1 / 3, 1e-3 + 1e-7, -2.5e5 - 7])
    exact = grads.clone()
    out = allreduce_mean(grads, 1, hook=bf16_compress_hook)
    assert out is grads and out.dtype == torch.float32
    assert torch.equal(out, exact.to(torch.bfloat16).float())
    assert not torch.equal(out, exact), "the values were chosen to lose bits in bf16"
    plain = exact.clone()
    assert torch.equal(allreduce_mean(plain, 1), exact)  # no hook: the fp32 sum, untouched
