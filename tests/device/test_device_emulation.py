"""The emulated accelerator itself, in this process (torch only, no megatron): what it refuses,
what it allows because CUDA does, how tags travel, and that it leaves nothing behind."""

from __future__ import annotations

import inspect
import os
from datetime import timedelta

import device_emulation as emulation
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from device_emulation import DeviceMixError, on_device
from launch import free_port

from gspo_megatron import device as device_module

HERE = os.path.basename(__file__)


@pytest.fixture
def emulated():
    with emulation.emulate():
        yield


@pytest.fixture
def one_rank():
    """A one-process gloo default group (NCCL on a GPU), with a gloo and an NCCL-like subgroup."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(60))
    try:
        with emulation.emulate():
            groups = {
                "gloo": dist.new_group([0], backend="gloo"),
                "nccl": dist.new_group([0]),
                "default": None,
            }
            yield groups
    finally:
        dist.destroy_process_group()


def dev(*shape, **kwargs) -> torch.Tensor:
    return torch.ones(*shape, device="cuda", **kwargs)


# -- refused ------------------------------------------------------------------------------------


def test_mixed_op_names_the_op_and_the_call_site(emulated):
    line = inspect.currentframe().f_lineno + 2
    with pytest.raises(DeviceMixError) as err:
        dev(3) + torch.ones(3)
    message = str(err.value)
    assert "aten.add.Tensor" in message and "host: other [3] float32" in message
    assert message.endswith(f"at tests/device/{HERE}:{line}")


@pytest.mark.parametrize(
    "op",
    [
        pytest.param(lambda d, h: F.embedding(h.long(), d), id="embedding-host-indices"),
        pytest.param(lambda d, h: d.index_select(0, h.long()), id="index_select-host-index"),
        pytest.param(lambda d, h: torch.cat([d, h]), id="cat"),
        pytest.param(lambda d, h: h[d.long()], id="host-self-device-index"),
        pytest.param(lambda d, h: h.add_(d), id="host-output"),
        pytest.param(lambda d, h: torch.tensor(1.0).add_(d[0]), id="host-scalar-output"),
        pytest.param(lambda d, h: d @ h.view(3, 1), id="matmul"),
    ],
)
def test_mixes_cuda_refuses(emulated, op):
    with pytest.raises(DeviceMixError):
        op(dev(3, dtype=torch.float32), torch.zeros(3))


def test_collective_on_would_be_nccl_group_refuses_host_tensors(one_rank):
    for name in ("default", "nccl"):
        with pytest.raises(DeviceMixError, match="allreduce_.*NCCL on a GPU.*host tensor"):
            dist.all_reduce(torch.ones(2), group=one_rank[name])
        with pytest.raises(DeviceMixError, match="allgather"):
            dist.all_gather([dev(2)], torch.ones(2), group=one_rank[name])
        dist.all_reduce(dev(2), group=one_rank[name])
    with pytest.raises(DeviceMixError, match="dtype torch.int16 \\(not an NCCL type\\)"):
        dist.all_reduce(dev(2, dtype=torch.int16), group=one_rank["nccl"])
    dist.all_reduce(torch.ones(2), group=one_rank["gloo"])  # gloo groups take host tensors
    dist.barrier()
    assert emulation.would_be_nccl(None) and emulation.would_be_nccl(one_rank["nccl"])
    assert not emulation.would_be_nccl(one_rank["gloo"])


def test_numpy_of_a_device_tensor_fails(emulated):
    d = dev(3)
    with pytest.raises(TypeError, match="can't convert cuda:0 device type tensor to numpy"):
        d.numpy()
    with pytest.raises(TypeError, match="to numpy"):
        np.asarray(d)
    assert d.sum().item() == 3.0 and d.tolist() == [1.0, 1.0, 1.0]
    assert d.cpu().numpy().tolist() == [1.0, 1.0, 1.0]


# -- allowed, as on CUDA ------------------------------------------------------------------------


def test_mixes_cuda_allows(emulated):
    d = dev(3)
    assert on_device(d * torch.tensor(2.0))  # a 0-dim host tensor is a scalar
    assert on_device(torch.where(d > 0, d, torch.tensor(0.0)))
    assert on_device(d.masked_fill(d > 1, torch.tensor(5.0)))
    index = torch.tensor([0, 2])
    assert on_device(d[index]) and on_device(d[torch.tensor([True, False, True])])
    d[index] = torch.tensor(7.0)
    d[index] = dev(2)
    d.copy_(torch.arange(3.0))
    host = torch.zeros(3)
    host.copy_(d)
    assert on_device(d) and not on_device(host) and host.tolist() == [0.0, 1.0, 2.0]


def test_object_collectives_use_device_byte_tensors_on_nccl_groups(one_rank):
    for group in one_rank.values():
        out = [None]
        dist.all_gather_object(out, {"a": [1, 2]}, group=group)
        box = [("b", 3)]
        dist.broadcast_object_list(box, src=0, group=group)
        assert out == [{"a": [1, 2]}] and box == [("b", 3)]
    assert torch.distributed.distributed_c10d._get_object_coll_device(one_rank["nccl"]) == "cuda"
    assert torch.distributed.distributed_c10d._get_object_coll_device(one_rank["gloo"]) == "cpu"


# -- how tags travel ------------------------------------------------------------------------------


def test_device_arguments_create_device_tensors(emulated):
    assert device_module.accelerator() == torch.device("cuda", 0)
    for t in (
        torch.zeros(2, device="cuda"),
        torch.empty(2, device=torch.device("cuda", 0)),
        torch.arange(3, device=0),  # torch.cuda.current_device() is an index
        torch.tensor([1, 2], device=device_module.accelerator()),
        torch.zeros_like(torch.ones(2), device="cuda"),
        torch.ones(2).new_zeros(3, device="cuda"),
    ):
        assert on_device(t) and t.device == torch.device("cuda", 0) and t.is_cuda
    assert dev(2).type() == "torch.cuda.FloatTensor" and dev(2).get_device() == 0
    host = torch.zeros(2, device="cpu")
    assert not on_device(host) and host.device.type == "cpu" and not host.is_cuda


def test_moves_copy_so_the_source_keeps_its_place(emulated):
    host = torch.ones(3)
    for moved in (
        host.to("cuda"),
        host.cuda(),
        host.to(device="cuda", dtype=torch.float64),
        host.to(dev(1)),
        torch.as_tensor(host, device="cuda"),
        device_module.to_accelerator(host),
    ):
        assert on_device(moved) and not on_device(host)
        moved.add_(1)
        assert host.tolist() == [1.0, 1.0, 1.0]
    d = dev(3)
    for back in (d.cpu(), d.to("cpu"), d.to(torch.zeros(1)), torch.as_tensor(d, device="cpu")):
        assert not on_device(back) and on_device(d)
    assert d.to("cuda") is d and device_module.to_accelerator(d) is d
    assert on_device(torch.as_tensor(np.ones(2), device="cuda"))
    assert on_device(d.float()) and on_device(d.to(torch.float16))


def test_modules_move_to_the_device(emulated):
    module = torch.nn.Linear(3, 2)
    assert not on_device(module.weight)
    module.to(device_module.accelerator())
    assert all(on_device(p) for p in module.parameters())
    module.cpu()
    assert not any(on_device(p) for p in module.parameters())


def test_tags_follow_views_and_in_place_ops(emulated):
    d = dev(4, 2)
    for view in (d[1:], d.view(8), d.t(), d[:, 0], d.unsqueeze(0).expand(3, 4, 2)):
        assert on_device(view)
    host = torch.zeros(4, 2)
    host.add_(torch.tensor(1.0))
    host[0] = 5.0
    assert not on_device(host)
    d.mul_(2).add_(torch.tensor(1.0))
    assert on_device(d)


def test_pinned_host_memory(emulated):
    pinned = torch.ones(2).pin_memory()
    assert pinned.is_pinned() and not on_device(pinned)
    assert torch.empty(2, pin_memory=True).is_pinned()
    assert not torch.ones(2).is_pinned()
    assert on_device(device_module.to_accelerator(pinned))


class _Scale(torch.autograd.Function):
    """A backward written in Python that allocates by device, as megatron's mappings do."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty(grad.shape, device=grad.device)
        return out.copy_(grad * 2) + torch.zeros(grad.shape, device=torch.cuda.current_device())


def test_autograd_backward_runs_on_the_device(emulated, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # as cpu_compat emulates it
    weight = dev(3, 2).requires_grad_()
    x = torch.randn(4, 3).to("cuda").requires_grad_()
    loss = _Scale.apply(F.linear(x, weight.t())).pow(2).sum()
    loss.backward()
    assert on_device(weight.grad) and on_device(x.grad)
    (grad,) = torch.autograd.grad(_Scale.apply(x).sum(), [x])
    assert on_device(grad)
    torch.autograd.backward([(x * 3).sum()])
    assert on_device(x.grad)
    host = torch.ones(3, requires_grad=True)
    (host * 2).sum().backward()
    assert not on_device(host.grad)


# -- record mode and leaving the emulation -------------------------------------------------------


def test_record_mode_collects_instead_of_raising():
    emulation.findings.clear()
    with emulation.emulate(record=True):
        dev(2) + torch.ones(2)
        dev(2).numpy()
    assert len(emulation.findings) == 2
    assert "aten.add.Tensor" in emulation.findings[0] and "numpy" in emulation.findings[1]
    emulation.findings.clear()


def test_emulation_leaves_nothing_behind():
    backward = torch.autograd.backward
    with emulation.emulate():
        assert torch.autograd.backward is not backward
    assert torch.autograd.backward is backward
    assert device_module.accelerator() == torch.device("cpu")
    with pytest.raises((RuntimeError, AssertionError)):  # torch has no CUDA here
        torch.zeros(1, device="cuda")
    torch.ones(2) + torch.ones(2)
