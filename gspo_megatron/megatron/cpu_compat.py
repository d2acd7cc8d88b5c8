"""Run megatron-core 0.19.2 on machines without CUDA (CPU tensors, gloo collectives).

megatron-core assumes CUDA throughout: `torch.cuda.current_device()` as a device, CUDA streams
and events in the MoE dispatcher, CUDA RNG state in the tensor-parallel RNG tracker, hard-coded
`device="cuda"` tensors, and a few collectives gloo does not offer. `apply()` installs one
narrow replacement for each, only when CUDA is unavailable (every replaced entry point would
raise on such a machine), and does nothing when CUDA is present. It must run before
`megatron.core` is imported; `gspo_megatron.megatron` calls it on import.

The shims touch private megatron functions, so the exact megatron-core version is checked.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import logging
import sys
import types

import torch
import torch.distributed as dist

from gspo_megatron.device import accelerator

MEGATRON_CORE_VERSION = "0.19.2"

_applied = False
_emulating = False  # the device emulation's form of the shims (see apply)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def check_megatron_version() -> None:
    try:
        found = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError as err:
        raise ImportError(
            f"megatron-core {MEGATRON_CORE_VERSION} is not installed: run `bash tools/install.sh`"
        ) from err
    if found != MEGATRON_CORE_VERSION:
        raise ImportError(
            f"gspo-megatron needs megatron-core=={MEGATRON_CORE_VERSION} (its CPU shims touch "
            f"private functions of that release), found {found}: run `bash tools/install.sh`"
        )


def apply(*, emulate_device: bool = False) -> bool:
    """Install the CPU shims if CUDA is unavailable. Idempotent. Returns whether they are active.

    The torch-level shims are installed at once; the megatron-level ones run right after
    `megatron.core` is first imported (by whichever module imports it), so importing the
    config-only modules of this package does not load megatron.

    emulate_device: the form the test-only device emulation needs
    (tests/device_emulation.py: `enable()` passes it): megatron's CUDA tensors
    become emulated device tensors instead of host tensors. A process may switch to it after a
    plain `apply()` as long as megatron.core is not imported yet.
    """
    global _applied, _emulating
    check_megatron_version()
    if _applied and (_emulating or not emulate_device):
        return not cuda_available()
    if "megatron.core" in sys.modules:
        raise RuntimeError(
            "gspo_megatron.megatron.cpu_compat.apply() must run before megatron.core is imported"
        )
    if cuda_available():
        if emulate_device:
            raise RuntimeError("device emulation is for machines without CUDA")
        _applied = True
        _after_import("megatron.core", _fix_optimizer_fallback_path)
        return False
    if not _applied:
        _stub_triton_only_modules()
        _after_import(
            "megatron.core",
            lambda: (_patch_megatron(), _fix_optimizer_fallback_path()),
            before=_compile_nothing_during_import,
        )
    _applied = True
    _emulating = emulate_device
    _redirect_torch_cuda()
    return True


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a callback once a given module has finished executing on its first import, and
    optionally a context manager around that execution."""

    def __init__(self, name: str, callback, before=contextlib.nullcontext) -> None:
        self.name = name
        self.callback = callback
        self.before = before

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        original = spec.loader.exec_module
        callback, before = self.callback, self.before

        def exec_module(module):
            with before():
                original(module)
            callback()

        spec.loader.exec_module = exec_module
        return spec


def _after_import(name: str, callback, before=contextlib.nullcontext) -> None:
    sys.meta_path.insert(0, _AfterImport(name, callback, before))


class _RefuseBeforeApply(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == "megatron.core" and not _applied:
            raise ImportError(
                "megatron.core is imported before gspo_megatron.megatron.cpu_compat.apply(): the "
                "code that starts megatron (entry point, benchmark, test worker) calls it first"
            )
        return None


def refuse_import_before_apply() -> None:
    """Make `import megatron.core` before `apply()` an error naming the fix. Idempotent."""
    if not any(isinstance(finder, _RefuseBeforeApply) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RefuseBeforeApply())


# --------------------------------------------------------------------------------------------
# Before megatron is imported


def _stub_triton_only_modules() -> None:
    # `megatron.core.transformer.moe.ops.paged_stash` imports triton unconditionally and is
    # reached from `import megatron.core`; its kernels are used only by the CUDA paged-stash path.
    if importlib.util.find_spec("triton") is not None:
        return
    name = "megatron.core.transformer.moe.ops.paged_stash"
    stub = types.ModuleType(name)
    stub.__doc__ = "Stand-in installed by gspo_megatron: triton kernels are unavailable on CPU."
    stub.GLOBAL_BLOCK_SIZE = 1024

    def _unavailable(*args, **kwargs):
        raise RuntimeError("MoE paged stash needs triton and CUDA")

    stub.paged_stash_copy_kernel = _unavailable
    stub.paged_stash_pop_kernel = _unavailable
    stub.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    sys.modules[name] = stub


@contextlib.contextmanager
def _compile_nothing_during_import():
    # megatron applies torch.compile at import time (its fused bias/activation kernels, the
    # inference router), which imports dynamo and inductor: 2.7 s of every process's start on
    # these machines, for functions that run eagerly on CPU (compiling them would also need a C
    # compiler at the first call). Only the decorations made while megatron.core imports are
    # affected.
    def run_eagerly(model=None, **options):
        return model if model is not None else (lambda function: function)

    compile_ = torch.compile
    torch.compile = run_eagerly
    try:
        yield
    finally:
        torch.compile = compile_


class _NullStream:
    """Stands in for torch.cuda.Stream: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullEvent:
    """Stands in for torch.cuda.Event."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


def _redirect_torch_cuda() -> None:
    """Point the torch.cuda entry points megatron calls at their CPU equivalents.

    Each of these raises on a machine without CUDA, so nothing that worked before changes.
    """
    cuda = torch.cuda
    # ~200 call sites use `torch.cuda.current_device()` as the device for new tensors: the CPU,
    # or under the device emulation CUDA device 0, which the emulation places on the CPU.
    cuda.current_device = (lambda: 0) if _emulating else (lambda: "cpu")
    cuda.set_device = lambda device: None
    cuda.device_count = lambda: 0
    # MoE dispatchers, schedules and the optimizer overlap work on side streams.
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.default_stream = lambda device=None: _NullStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    cuda.nvtx.range_push = lambda msg: None
    cuda.nvtx.range_pop = lambda: None
    cuda.nvtx.range = lambda *args, **kwargs: contextlib.nullcontext()
    # The tensor-parallel RNG tracker saves and restores "CUDA" generator states; on CPU the
    # generator that samples dropout masks and initial weights is the CPU one.
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    # (torch.manual_seed itself calls torch.cuda.manual_seed_all, which stays torch's own.)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(seed)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.memory_allocated = lambda device=None: 0
    cuda.memory_reserved = lambda device=None: 0
    # `.cuda()` on a tensor or module is a placement request; on CPU it stays where it is
    # (the device emulation moves it to the emulated device instead).
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self
    if _emulating:
        # Emulated device tensors take megatron's CUDA paths, which tell the caching allocator
        # about side streams; torch's method would refuse the null streams.
        torch.Tensor.record_stream = lambda self, stream: None


# --------------------------------------------------------------------------------------------
# After megatron is imported


class _CpuDeviceTorch(types.ModuleType):
    """`torch` as seen by one megatron module: tensor factories asked for device "cuda" (or pinned
    memory) get plain CPU memory.

    Installed as the module-global `torch` of the few megatron modules that hard-code
    `device="cuda"`; every other attribute is torch's own, bound here when it is made (hot
    paths such as the MoE dispatcher look names up thousands of times a step), the rest
    (submodules torch imports lazily) looked up on use.
    """

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like")

    def __init__(self) -> None:
        super().__init__("torch")
        self.__dict__.update(
            {k: v for k, v in vars(torch).items() if not k.startswith("__")}
            | {name: _cpu_factory(getattr(torch, name)) for name in self._FACTORIES}
        )

    def __getattr__(self, name: str):
        attr = getattr(torch, name)
        if name in self._FACTORIES:
            return _cpu_factory(attr)
        return attr


@functools.cache
def _cpu_factory(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        # Pinned host memory needs an accelerator.
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return wrapper


_MODULES_WITH_CUDA_FACTORIES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.rerun_state_machine",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.utils",
    "megatron.core.models.common.embeddings.rope_utils",
)


def _patch_megatron() -> None:
    # Under the device emulation, CUDA factories and `.type()` are the emulation's business: a
    # host tensor reaching the optimizer must fail there as it would on a GPU.
    if not _emulating:
        cpu_torch = _CpuDeviceTorch()
        for name in _MODULES_WITH_CUDA_FACTORIES:
            module = importlib.import_module(name)
            module.torch = cpu_torch

        # The optimizers and gradient clipping accept only tensors whose `.type()` names a CUDA
        # type; while they run, CPU tensors report the CUDA name of their dtype.
        distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
        optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
        clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
        for owner, name in (
            (distrib.DistributedOptimizer, "__init__"),
            (optimizer.Float16OptimizerWithFloat16Params, "__init__"),
            (clip_grads, "clip_grad_by_total_norm_fp32"),
            (optimizer, "clip_grad_by_total_norm_fp32"),
        ):
            setattr(owner, name, _with_cuda_type_names(getattr(owner, name)))

    # gloo's all_to_all_single takes split sizes as lists; the alltoall MoE dispatcher keeps them
    # as tensors unless they were on a GPU (then it copies them to host numpy arrays, which it
    # still does for emulated device tensors).
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    dispatcher.maybe_move_tensor_to_cpu = _host_split_sizes(dispatcher.maybe_move_tensor_to_cpu)

    # Expert tensor parallelism gathers and reduce-scatters uneven token counts per rank; gloo
    # has neither an uneven all_gather nor a list reduce_scatter.
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    mappings._gather_along_first_dim = _uneven_gather(mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = _uneven_reduce_scatter(
        mappings._reduce_scatter_along_first_dim
    )

    # Pipeline shape exchange (variable sequence lengths) batches sends and receives in one
    # group; gloo matches messages between two ranks by order, and with two pipeline stages the
    # previous and next stage are the same peer, so the two (3,)-shaped shape messages can swap.
    p2p = importlib.import_module("megatron.core.pipeline_parallel.p2p_communication")
    p2p.P2PCommunicator._communicate_shapes = _communicate_shapes_in_order

    # Every megatron linear layer runs through a custom autograd Function that exists for
    # tensor-parallel communication and fused gradient accumulation. Without either (no TP, or a
    # row-parallel layer, no SP) it computes the same matmul: under plain autograd that gives
    # bitwise the same outputs and gradients, without its Python forward and backward.
    layers = importlib.import_module("megatron.core.tensor_parallel.layers")
    layers.linear_with_grad_accumulation_and_async_allreduce = _plain_linear_when_local(
        layers.linear_with_grad_accumulation_and_async_allreduce
    )

    # Unfused RoPE for packed sequences applies each sequence separately: four kernels per
    # sequence, layer and q/k, which on CPU costs more than the attention itself. Gathering each
    # token's frequencies at once is the same elementwise arithmetic.
    rope = importlib.import_module("megatron.core.models.common.embeddings.rope_utils")
    rope._apply_rotary_pos_emb_thd = _rope_thd_gathered(rope)

    # The RNG tracker switches generator states through private helpers that reach
    # `torch.cuda.default_generators` via `_lazy_call`, which without CUDA queues the call and
    # never runs it: forks would silently keep the caller's state.
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(
        new_state
    )
    # With these, the "CUDA" generator is the CPU one, so the tracker's warning that a fork
    # changed the CPU generator fires on every fork (each weight of the accelerator init path).
    logging.getLogger(random.__name__).addFilter(
        lambda record: "CPU RNG state changed" not in record.getMessage()
    )


def _plain_linear_when_local(linear):
    @functools.wraps(linear)
    def run(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
            sequence_parallel, grad_output_buffer=None, wgrad_deferral_limit=0, tp_group=None,
            gtp_remat_size=1):  # fmt: skip
        if (
            gradient_accumulation_fusion
            or allreduce_dgrad
            or sequence_parallel
            or grad_output_buffer is not None
            or wgrad_deferral_limit
            or gtp_remat_size != 1
        ):
            return linear(
                input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                sequence_parallel, grad_output_buffer, wgrad_deferral_limit, tp_group,
                gtp_remat_size,
            )  # fmt: skip
        # megatron's forward, exactly
        output = torch.matmul(input, weight.t())
        return output + bias if bias is not None else output

    return run


def _rope_thd_gathered(rope):
    per_sequence = rope._apply_rotary_pos_emb_thd

    @functools.wraps(per_sequence)
    def apply(t, cu_seqlens, freqs, rotary_interleaved=False, mla_rotary_interleaved=False,
              mscale=1.0, cp_group=None, multi_latent_attention=None):  # fmt: skip
        if (
            cp_group is None
            or multi_latent_attention is not None
            or (freqs.dim() >= 1 and freqs.size(0) == int(cu_seqlens[-1]))
        ):
            return per_sequence(
                t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale, cp_group=cp_group,
                multi_latent_attention=multi_latent_attention,
            )  # fmt: skip
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        # Every local token's position in its sequence, from the boundaries alone.
        local = (cu_seqlens[1:] - cu_seqlens[:-1]) // cp_size
        starts = torch.cumsum(local, 0) - local
        offset = torch.arange(t.shape[0], device=local.device) - torch.repeat_interleave(
            starts, local, output_size=t.shape[0]
        )
        if cp_size > 1:
            # This rank's chunks r and 2*cp-1-r of each sequence (megatron's THD CP layout).
            chunk = torch.repeat_interleave(local // 2, local, output_size=t.shape[0])
            offset = torch.where(
                offset < chunk,
                offset + cp_rank * chunk,
                offset - chunk + (2 * cp_size - 1 - cp_rank) * chunk,
            )
        index = offset.to(freqs.device)
        return rope._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), freqs[index], rotary_interleaved=rotary_interleaved,
            mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale,
        ).squeeze(1)  # fmt: skip

    return apply


def _fix_optimizer_fallback_path() -> None:
    """Distributed-optimizer checkpoint loading without apex/transformer-engine.

    On that path torch's Adam keeps a `step` tensor in each parameter's state, which the
    checkpoint's per-parameter tensors do not include; `_set_main_param_and_optimizer_states`
    then fails with KeyError 'step'. Missing keys are passed as None, which it skips (the step
    count itself is restored from the optimizer's param groups). Applies on GPUs without TE too.
    """
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    if distrib.HAVE_APEX_OR_TE or getattr(distrib.DistributedOptimizer, "_gspo_fixed", False):
        return
    original = distrib.DistributedOptimizer._set_main_param_and_optimizer_states

    @functools.wraps(original)
    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        completed = dict(tensors)
        for key in self.optimizer.state[main_param]:
            completed.setdefault(key, None)
        return original(self, model_param, completed)

    distrib.DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    distrib.DistributedOptimizer._gspo_fixed = True


def _communicate_shapes_in_order(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
    """Exchange activation shapes with sends posted next-then-prev and receives prev-then-next,
    so that with a single peer each message meets the receive meant for it."""
    group = self.pp_group
    device = accelerator()  # megatron's own exchange uses the device (the group is NCCL on GPUs)
    requests = []
    for tensor, peer in ((tensor_send_next, self.next_rank), (tensor_send_prev, self.prev_rank)):
        if tensor is not None:
            shape = torch.tensor(tensor.size(), dtype=torch.int64, device=device)
            requests.append(dist.isend(shape, peer, group=group))
    received = {}
    for wanted, name, peer in (
        (recv_prev, "prev", self.prev_rank),
        (recv_next, "next", self.next_rank),
    ):
        if wanted:
            received[name] = torch.empty(3, dtype=torch.int64, device=device)
            requests.append(dist.irecv(received[name], peer, group=group))
    for request in requests:
        request.wait()
    return (
        received["prev"].tolist() if "prev" in received else [0, 0, 0],
        received["next"].tolist() if "next" in received else [0, 0, 0],
    )


def _uneven_gather(original):
    """All-gather along dim 0 with per-rank sizes: pad to the largest, gather, cut."""

    @functools.wraps(original)
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros((longest,) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((longest * len(sizes),) + tuple(input_.shape[1:]))
        dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
        return torch.cat([out[r * longest : r * longest + n] for r, n in enumerate(sizes)])

    return gather


def _uneven_reduce_scatter(original):
    """Reduce-scatter along dim 0 with per-rank sizes: all-reduce, keep this rank's rows."""

    @functools.wraps(original)
    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        sizes = [int(n) for n in input_split_sizes]
        start = sum(sizes[: group.rank()])
        return total[start : start + sizes[group.rank()]].contiguous()

    return reduce_scatter


def _host_split_sizes(original):
    @functools.wraps(original)
    def move(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return move


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        original = torch.Tensor.type

        def type_(self, dtype=None, non_blocking=False, **kw):
            if dtype is None and not kw:
                name = original(self)
                return _CUDA_TYPE_NAMES.get(name, name)
            return original(self, dtype, non_blocking, **kw)

        torch.Tensor.type = type_
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.type = original

    return wrapper
