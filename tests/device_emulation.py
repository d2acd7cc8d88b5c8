"""Test-only: an emulated accelerator on CPU that tells "device" tensors apart from host tensors.

On a GPU, megatron-core puts parameters on the current CUDA device and NCCL takes device tensors
only; on CPU/gloo every tensor is on the host, so a micro-batch that is never moved to the device
or a host tensor given to a collective goes unnoticed. Under this emulation every tensor still
lives in CPU memory, but tensors meant for the accelerator carry a tag, and

  * an aten op that mixes tagged and untagged tensors raises `DeviceMixError` naming the op and
    the call site, except the mixes CUDA permits: 0-dim host tensors as inputs of TensorIterator
    (pointwise) ops, host index tensors of `index` / `index_put_`, and cross-device `copy_`;
  * a collective given a host tensor, or a dtype NCCL lacks (int16, ...), on a process group
    that would be NCCL on a GPU (the default group and every `new_group` without
    backend="gloo") raises the same way;
  * `.numpy()` of a device tensor raises, as on CUDA (`.item()` and `.tolist()` are allowed);
  * `.device` of a device tensor reports `cuda:0`, `.is_cuda` is true, and object collectives
    on would-be-NCCL groups move their byte tensors to the device, as torch does with NCCL.

Usage, in a worker process, before megatron is imported:

    import device_emulation
    device_emulation.enable()
    import megatron.core  # or anything that imports it

or, for torch-only code in a test process, `with device_emulation.emulate(): ...`.

`enable()` switches the CPU shims to their emulated form (`torch.cuda.current_device()` is 0 and
megatron's hard-coded `device="cuda"` tensors become device tensors instead of host ones) and
enters `emulate()` for the rest of the process. `emulate()` makes
`gspo_megatron.device.accelerator()` name `cuda:0`, records which process groups would be NCCL,
and installs two torch modes: a `TorchFunctionMode` that rewrites CUDA device arguments to the
CPU and tags what they create (a move between host and device always copies, so a tag never
leaks onto the source), and a `TorchDispatchMode` that propagates tags through every aten op
(views, in-place ops, autograd backward) and checks the mixes. Tags are kept per storage, so
views share them.

Limits: tensors created by pickling (`torch.load`, object collectives of tensors) come back as
host tensors; autograd formulas that allocate without a tensor input allocate on the device when
the backward was started from device tensors. Every op pays some Python overhead: fine for the
tiny test models, not for benchmarks.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.autograd
import torch.distributed as dist
import typing_extensions
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from gspo_megatron import device as device_module

DEVICE = torch.device("cuda", 0)
_CPU = torch.device("cpu")
_DEVICE_KIND = 1
_PINNED_KIND = 2


class DeviceMixError(RuntimeError):
    """An op mixed accelerator and host tensors in a way CUDA or NCCL would refuse."""


# --------------------------------------------------------------------------------------------
# Tags and call sites


class _Tags:
    """Storage -> kind (device or pinned host memory).

    torch keeps one Python object per storage for the storage's lifetime, so entries are keyed
    by that object's id and dropped by a weak-reference callback when the storage dies (before
    its id can be reused).
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, int]] = {}

    def kind(self, tensor: torch.Tensor) -> int:
        try:
            entry = self._entries.get(id(tensor.untyped_storage()))
        except (RuntimeError, NotImplementedError):  # no storage (sparse, nested, ...)
            return 0
        return 0 if entry is None else entry[1]

    def set(self, tensor: torch.Tensor, kind: int) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if kind == 0:
            self._entries.pop(key, None)
        else:
            entry = self._entries.get(key)
            if entry is None or entry[1] != kind:
                self._entries[key] = (weakref.ref(storage, self._forget(key)), kind)

    def _forget(self, key: int):
        return lambda ref: self._entries.pop(key, None)


_TAGS = _Tags()
_REPO = Path(__file__).resolve().parents[1]
_PROJECT_DIRS = (str(_REPO / "gspo_megatron") + os.sep, str(_REPO / "tests") + os.sep)
# Frames skipped when naming a call site: torch, the standard library (contextlib, functools,
# ...) and typing_extensions' decorator wrappers.
_LIBRARY_PATHS = (
    str(Path(torch.__file__).parent) + os.sep,
    str(Path(os.__file__).parent) + os.sep,
    str(Path(typing_extensions.__file__)),
)


def on_device(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is an (emulated) accelerator tensor."""
    return _TAGS.kind(tensor) == _DEVICE_KIND


def call_site() -> str:
    """The first frame in gspo_megatron/ or tests/ (and the innermost frame outside torch and
    the standard library, when it is elsewhere, e.g. in megatron)."""
    frame = sys._getframe(1)
    innermost = None
    while frame is not None:
        path = frame.f_code.co_filename
        if path != __file__ and not path.startswith(_LIBRARY_PATHS):
            site = f"{_short(path)}:{frame.f_lineno}"
            innermost = innermost or site
            if path.startswith(_PROJECT_DIRS):
                return site if site == innermost else f"{site} (via {innermost})"
        frame = frame.f_back
    return innermost or "<unknown>"


# enable(record=True): what would have failed, in order, each message once (else it raises).
findings: list[str] = []
_recording = False


def _refuse(error: type[Exception], message: str) -> None:
    if not _recording:
        raise error(message)
    if message not in findings:
        findings.append(message)


def _short(path: str) -> str:
    marker = "site-packages" + os.sep
    if marker in path:
        return path.split(marker, 1)[1]
    return os.path.relpath(path, _REPO) if path.startswith(str(_REPO)) else path


def _describe(tensor: torch.Tensor) -> str:
    return f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


# --------------------------------------------------------------------------------------------
# Collectives


class _Groups:
    """Names of the process groups that would use NCCL on a GPU machine."""

    def __init__(self) -> None:
        self.nccl: set[str] = set()

    def record(self, group, backend) -> None:
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            return
        if backend is None or "nccl" in str(backend).lower():
            self.nccl.add(group.group_name)

    def would_be_nccl(self, group) -> bool:
        if group is None:
            group = dist.distributed_c10d._get_default_group()
        return group.group_name in self.nccl or group is dist.distributed_c10d._world.default_pg


_GROUPS = _Groups()


def would_be_nccl(group=None) -> bool:
    """Whether `group` (None: the default group) would be an NCCL group on a GPU machine."""
    return _GROUPS.would_be_nccl(group)


# The dtypes ProcessGroupNCCL maps to NCCL types (anything else fails there, int16 included).
_NCCL_DTYPES = frozenset(
    {
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
    }
)


def _check_collective(func, args) -> None:
    if func.__name__.startswith(("barrier", "monitored_barrier")):
        return
    group = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
    if group is None:
        return
    group = dist.ProcessGroup.unbox(group)
    if not _GROUPS.would_be_nccl(group):
        return
    tensors = list(_tensors(args))
    host = [t for t in tensors if _TAGS.kind(t) != _DEVICE_KIND]
    dtypes = sorted({str(t.dtype) for t in tensors if t.dtype not in _NCCL_DTYPES})
    if host or dtypes:
        name = group.group_name if group.group_desc == "undefined" else group.group_desc
        problem = f"host tensor(s) {', '.join(_describe(t) for t in host)}" if host else ""
        if dtypes:
            problem += f"{' and ' if host else ''}dtype {', '.join(dtypes)} (not an NCCL type)"
        _refuse(
            DeviceMixError,
            f"{func} on process group {name} (NCCL on a GPU) was given {problem} at {call_site()}",
        )


def _tensors(values):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


# --------------------------------------------------------------------------------------------
# aten level: propagate tags and check mixes


@functools.cache
def _op_rules(func) -> tuple[bool, frozenset[str], bool]:
    """(host 0-dim inputs allowed, names of mutated arguments, host indices allowed)."""
    packet = func.overloadpacket
    # TensorIterator ops treat a 0-dim CPU tensor as a scalar on any device (and fill_ /
    # masked_fill take one as the value); other CUDA kernels check that every tensor argument
    # is on the common device.
    scalars = torch.Tag.pointwise in func.tags or packet in (
        torch.ops.aten.fill_,
        torch.ops.aten.masked_fill,
        torch.ops.aten.masked_fill_,
        torch.ops.aten.index_put_,
        torch.ops.aten.index_put,
        torch.ops.aten._index_put_impl_,
    )
    mutated = frozenset(
        a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write
    )
    # Advanced indexing accepts CPU index tensors for a CUDA tensor (they are copied over).
    indices = packet in (
        torch.ops.aten.index,
        torch.ops.aten._unsafe_index,
        torch.ops.aten.index_put_,
        torch.ops.aten.index_put,
        torch.ops.aten._index_put_impl_,
        torch.ops.aten._unsafe_index_put,
    )
    return scalars, mutated, indices


_COPIES = frozenset(
    {
        torch.ops.aten.copy_.default,
        torch.ops.aten._copy_from.default,
        torch.ops.aten._copy_from_and_resize.default,
    }
)


def _check_mix(func, args, kwargs, host: list[torch.Tensor]) -> None:
    scalars, mutated, indices = _op_rules(func)
    names = [a.name for a in func._schema.arguments]
    named = dict(zip(names, args, strict=False))
    named.update(kwargs)
    outputs = {id(t) for name in mutated for t in _tensors([named.get(name)])}
    index_args = {id(t) for t in _tensors([named.get("indices")])} if indices else set()
    refused = []
    for t in host:
        if id(t) in outputs:
            refused.append(t)
        elif id(t) in index_args:
            continue
        elif not (scalars and t.dim() == 0):
            refused.append(t)
    if refused:
        refused_ids = {id(t) for t in refused}
        where = {
            id(t): name
            for name, value in named.items()
            for t in _tensors([value])
            if id(t) in refused_ids
        }
        parts = ", ".join(f"{where.get(id(t), '?')} {_describe(t)}" for t in refused)
        _refuse(
            DeviceMixError,
            f"{func} mixes accelerator and host tensors (host: {parts}) at {call_site()}",
        )


def _split(values, device: list, host: list) -> None:
    """Sort the tensors among `values` (and in lists among them) into device and host."""
    for value in values:
        if isinstance(value, torch.Tensor):
            (device if _TAGS.kind(value) == _DEVICE_KIND else host).append(value)
        elif isinstance(value, (list, tuple)):
            _split(value, device, host)


class _DispatchMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            _check_collective(func, args)
            return func(*args, **kwargs)
        if func in _COPIES:
            return func(*args, **kwargs)
        device: list[torch.Tensor] = []
        host: list[torch.Tensor] = []
        _split(args, device, host)
        if kwargs:
            _split(kwargs.values(), device, host)
        if device and host:
            _check_mix(func, args, kwargs, host)
        out = func(*args, **kwargs)
        if func is _TO_COPY and "device" in kwargs:
            return out  # an explicit move: the function mode places the result
        if device or (not host and _STATE.ambient_device()):
            if isinstance(out, torch.Tensor):
                _TAGS.set(out, _DEVICE_KIND)
            elif isinstance(out, (list, tuple)):
                for t in _tensors(out):
                    _TAGS.set(t, _DEVICE_KIND)
        return out


# torch wraps every mode's handler so that dynamo does not trace it; nothing here is compiled,
# and the wrapper would double the cost of each op.
_DispatchMode.__torch_dispatch__ = _DispatchMode.__dict__["__torch_dispatch__"].__wrapped__
_TO_COPY = torch.ops.aten._to_copy.default


# --------------------------------------------------------------------------------------------
# Python level: device arguments, moves, device queries


class _State:
    """Where tensor-less allocations go: the device of the torch call being handled, else the
    device of the running backward pass."""

    def __init__(self) -> None:
        self.call: tuple | None = None  # (args, kwargs, target device or None)
        self.backward_on_device = False

    def ambient_device(self) -> bool:
        if self.call is None:
            return self.backward_on_device
        args, kwargs, target = self.call
        if target is not None:
            return target
        return any(on_device(t) for t in _tensors(args)) or any(
            on_device(t) for t in _tensors(kwargs.values())
        )


_STATE = _State()


def _names_accelerator(device) -> bool | None:
    """True for a CUDA device (a bare int is a CUDA index), False for another, None if unset."""
    if device is None:
        return None
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _place(out, target: bool, sources) -> object:
    """Tag the tensors in `out` for `target`; copy any that share memory with a source of the
    other kind, so that a move never retags its source."""
    if isinstance(out, (list, tuple)):
        return type(out)(_place(o, target, sources) for o in out)
    if not isinstance(out, torch.Tensor):
        return out
    key = out.untyped_storage()._cdata
    for src in sources:
        if isinstance(src, np.ndarray) and target:
            out = out.clone()
            break
        if isinstance(src, torch.Tensor) and src.untyped_storage()._cdata == key:
            if on_device(src) != target:
                out = out.clone()
            break
    _TAGS.set(out, _DEVICE_KIND if target else 0)
    return out


def _move(tensor: torch.Tensor, target: bool, call):
    """`call()` converts `tensor` (dtype, copy, ...) on the CPU; place the result."""
    return _place(call(), target, [tensor])


def _to(func, args, kwargs):
    self, rest = args[0], args[1:]
    target = _names_accelerator(kwargs.get("device"))
    new_args = []
    for a in rest:
        if isinstance(a, torch.Tensor):
            target = on_device(a)
        elif isinstance(a, (str, torch.device)) or (
            isinstance(a, int) and not isinstance(a, bool) and not new_args
        ):
            target = _names_accelerator(a)
            a = _CPU
        new_args.append(a)
    if "device" in kwargs:
        kwargs = dict(kwargs, device=_CPU)
    if target is None:
        return func(self, *new_args, **kwargs)
    return _move(self, target, lambda: func(self, *new_args, **kwargs))


def _cpu(func, args, kwargs):
    return _move(args[0], False, lambda: func(*args, **kwargs))


def _numpy(func, args, kwargs):
    if on_device(args[0]):
        _refuse(
            TypeError,
            f"can't convert {DEVICE} device type tensor to numpy (use Tensor.cpu() to copy the "
            f"tensor to host memory first) at {call_site()}",
        )
    return func(*args, **kwargs)


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}


def _type(func, args, kwargs):
    name = func(*args, **kwargs)
    if isinstance(name, str) and on_device(args[0]):
        return _CUDA_TYPE_NAMES.get(name, name)
    return name


def _pin_memory(func, args, kwargs):
    out = args[0].clone()
    _TAGS.set(out, _PINNED_KIND)
    return out


def _tensor_backward(func, args, kwargs):
    # Tensor.backward hands over to torch.autograd.backward; calling it from here, with the
    # function mode active again, keeps the mode on while the backward pass runs.
    self, rest = args[0], args[1:]
    options = dict(zip(("gradient", "retain_graph", "create_graph", "inputs"), rest, strict=False))
    options.update(kwargs)
    with _FunctionMode():
        torch.autograd.backward(
            self,
            options.get("gradient"),
            options.get("retain_graph"),
            options.get("create_graph", False),
            inputs=options.get("inputs"),
        )


_T = torch.Tensor
_SPECIAL = {
    _T.device.__get__: lambda f, a, k: DEVICE if on_device(a[0]) else f(*a, **k),
    _T.is_cuda.__get__: lambda f, a, k: on_device(a[0]) or f(*a, **k),
    _T.is_cpu.__get__: lambda f, a, k: not on_device(a[0]) and f(*a, **k),
    _T.get_device: lambda f, a, k: DEVICE.index if on_device(a[0]) else f(*a, **k),
    _T.to: _to,
    _T.cpu: _cpu,
    _T.numpy: _numpy,
    _T.__array__: _numpy,
    _T.type: _type,
    _T.pin_memory: _pin_memory,
    _T.is_pinned: lambda f, a, k: _TAGS.kind(a[0]) == _PINNED_KIND,
    _T.backward: _tensor_backward,
}


class _FunctionMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        special = _SPECIAL.get(func)
        if special is not None:
            return special(func, args, kwargs)
        target = None
        pinned = False
        if kwargs:
            target = _names_accelerator(kwargs.get("device"))
            if target:
                kwargs = dict(kwargs, device=_CPU)
            if kwargs.get("pin_memory"):
                kwargs = dict(kwargs, pin_memory=False)
                pinned = True
        outer = _STATE.call
        _STATE.call = (args, kwargs, target)
        try:
            out = func(*args, **kwargs)
        finally:
            _STATE.call = outer
        if target is not None:
            return _place(out, target, list(args) + list(kwargs.values()))
        if pinned:
            for t in _tensors([out]):
                _TAGS.set(t, _PINNED_KIND)
        return out


# --------------------------------------------------------------------------------------------
# Patches of torch entry points


def _backward_entry(original):
    """torch.autograd.backward / grad, with tensor-less allocations of the backward pass placed
    on the device of the tensors it starts from."""

    @functools.wraps(original)
    def run(tensors, *args, **kwargs):
        outer = (_STATE.call, _STATE.backward_on_device)
        items = tensors if isinstance(tensors, (list, tuple)) else [tensors]
        _STATE.call = None
        _STATE.backward_on_device = any(isinstance(t, torch.Tensor) and on_device(t) for t in items)
        try:
            return original(tensors, *args, **kwargs)
        finally:
            _STATE.call, _STATE.backward_on_device = outer

    return run


def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self.to("cuda", non_blocking=non_blocking, memory_format=memory_format)


def _module_cuda(self, device=None):
    return self._apply(lambda t: t.cuda(device))


def _recording_new_group(original):
    @functools.wraps(original)
    def new_group(*args, **kwargs):
        group = original(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        _GROUPS.record(group, backend)
        return group

    return new_group


def _object_device(original, device):
    @functools.wraps(original)
    def get(group=None):
        return device if _GROUPS.would_be_nccl(group) else original(group)

    return get


def _patches() -> list[tuple[object, str, object]]:
    """(owner, attribute, replacement) for the torch entry points the emulation changes."""
    c10d = dist.distributed_c10d
    new_group = _recording_new_group(c10d.new_group)
    return [
        # Which groups would be NCCL: the default one, and those created without backend="gloo".
        (c10d, "new_group", new_group),
        (dist, "new_group", new_group),
        # Object collectives put their byte tensors on the group's device (CUDA for NCCL).
        (c10d, "_get_object_coll_device", _object_device(c10d._get_object_coll_device, "cuda")),
        (c10d, "_get_pg_default_device", _object_device(c10d._get_pg_default_device, DEVICE)),
        # torch.autograd.backward/grad defer to __torch_function__ whenever a mode is active, and
        # a mode is switched off while it handles a call: the backward pass would run without
        # it. Not deferring keeps the function mode on through every backward pass.
        (torch.autograd, "has_torch_function", lambda args: False),
        (torch.autograd, "backward", _backward_entry(torch.autograd.backward)),
        (torch.autograd, "grad", _backward_entry(torch.autograd.grad)),
        # `.cuda()` moves to the emulated device (the CPU shims make it a no-op otherwise).
        (torch.Tensor, "cuda", _tensor_cuda),
        (torch.nn.Module, "cuda", _module_cuda),
    ]


@contextlib.contextmanager
def emulate(*, record: bool = False) -> Iterator[None]:
    """The emulation inside a block, without megatron's shims (in-process unit tests).

    record: instead of raising, collect each refused op's message in `findings` and carry on
    (everything is in CPU memory, so the op itself works): a survey of a code path in one run.
    """
    global _recording
    if torch.cuda.is_available():
        raise RuntimeError("device emulation is for machines without CUDA")
    saved = []
    for owner, name, replacement in _patches():
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)
    outer = (_recording, device_module.accelerator())
    _recording = record
    device_module.set_emulated_accelerator(DEVICE)
    try:
        with _FunctionMode(), _DispatchMode():
            yield
    finally:
        _recording = outer[0]
        device_module.set_emulated_accelerator(outer[1] if outer[1].type == "cuda" else None)
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


_process_emulation: contextlib.ExitStack | None = None  # held open by enable()


def enable(*, record: bool = False) -> None:
    """Emulate a CUDA device for the rest of this process, megatron included (call before
    megatron.core is imported). `record` as for `emulate`."""
    global _process_emulation
    if _process_emulation is not None:
        return
    from gspo_megatron.megatron import cpu_compat

    cpu_compat.apply(emulate_device=True)
    _process_emulation = contextlib.ExitStack()
    _process_emulation.enter_context(emulate(record=record))


def enabled() -> bool:
    """Whether `enable()` has run in this process."""
    return _process_emulation is not None
