"""Meta-device construction that initialises every shard exactly as the eager model would be.

``record_build(factory)`` runs the model factory once with every new tensor on the ``meta`` device
(no memory is allocated) while it records the program of tensor operations the construction runs
(allocations, ``normal_``/``uniform_`` inits, copies, the rotary tables a model computes...). The
strategy then shards or prunes the meta model; ``InitProgram.materialize`` allocates only this
rank's shards (``to_empty``) and replays the program on the CPU, one tensor at a time, copying each
finished tensor's slice into the shard that holds it.

Why a recorded program instead of an ``init_weights`` method per model (torchtitan's way): the
replay draws from the global CPU generator exactly what the eager construction draws, in the same
order, on tensors of the same shapes, so a fixed seed gives bit-identical weights whether a model
is built eagerly on one process or on meta and sharded over many -- for the built-in GPT, for
Hugging Face models (their own ``_init_weights``) and for a user's factory alike, with nothing to
write per model. ``verify`` and exact resume rely on that equality.

Memory: a tensor's value is computed only if it survives into the model (liveness analysis over
the program); an initialisation that a later one overwrites (``nn.Linear``'s kaiming init under
GPT's ``reset_parameters``, or under Hugging Face's ``_init_weights``) is replayed only for its
random draws, into a scratch buffer that is freed at once. The replay therefore holds about one
full tensor at a time (the largest one bounds it), never the model.

A factory that cannot run on meta (it reads values, e.g. ``.item()`` or numpy) raises
``MetaInitUnsupported``; the caller then builds eagerly and says why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from shardwise.models.gpt2_qkv import fused_sources

__all__ = ["InitProgram", "MetaInitUnsupported", "is_meta_module", "local_region", "record_build"]

META = torch.device("meta")
_aten = torch.ops.aten

# In-place ops that overwrite every element of ``self`` without reading it: a full-coverage call
# makes the storage's earlier value dead.
_OVERWRITE_OPS = {
    "normal_", "uniform_", "fill_", "zero_", "random_", "exponential_", "geometric_", "log_normal_",
    "cauchy_", "bernoulli_", "copy_",
}


class MetaInitUnsupported(RuntimeError):
    """The factory cannot be recorded on the meta device (it reads tensor values while building)."""


@dataclass(frozen=True)
class _Ref:
    """A recorded meta tensor: which storage it views, and how."""

    key: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    outputs: list[Any]  # _Ref per tensor output (flattened), None for non-tensors
    reads: frozenset[int]
    writes: frozenset[int]
    kills: frozenset[int]  # storages fully overwritten without being read
    creates: frozenset[int]  # storages this op allocates
    rng: bool


def _is_rng(func: Any) -> bool:
    return any("Generator" in str(a.type) for a in func._schema.arguments)


def _written_args(func: Any) -> set[str]:
    return {a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write}


def _is_factory(func: Any, args: tuple, kwargs: dict) -> bool:
    """An op that makes a tensor from no tensor input (empty, zeros, arange, randn, full...)."""
    if not any(a.name == "device" for a in func._schema.arguments):
        return False
    flat, _ = tree_flatten((args, kwargs))
    return not any(isinstance(x, torch.Tensor) for x in flat)


def _covers_storage(t: torch.Tensor) -> bool:
    """Whether writing every element of ``t`` overwrites its whole storage."""
    if t.storage_offset() != 0 or not t.is_contiguous():
        return False
    return t.numel() * t.element_size() == t.untyped_storage().nbytes()


class _Recorder(TorchDispatchMode):
    """Sends every new tensor to the meta device and records the ops that touch meta tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.keys: dict[StorageWeakRef, int] = {}
        self.nbytes: dict[int, int] = {}
        # Strong references: a freed meta storage's address could be reused by a new one, which
        # would then be mistaken for it.
        self._storages: list[Any] = []

    def key_of(self, t: torch.Tensor) -> tuple[int, bool]:
        storage = t.untyped_storage()
        ref = StorageWeakRef(storage)
        if ref in self.keys:
            return self.keys[ref], False
        key = len(self.keys)
        self.keys[ref] = key
        self.nbytes[key] = storage.nbytes()
        self._storages.append(storage)
        return key, True

    def ref(self, t: torch.Tensor) -> _Ref:
        key, _ = self.key_of(t)
        return _Ref(key, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is _aten.lift_fresh.default:
            return func(*args, **kwargs)  # torch.tensor(data): a real constant, kept as such
        factory = _is_factory(func, args, kwargs)
        if factory:
            kwargs["device"] = META
        flat, _ = tree_flatten((args, kwargs))
        touches_meta = factory or any(
            (isinstance(x, torch.Tensor) and x.is_meta) or (isinstance(x, torch.device) and x.type == "meta")
            for x in flat)
        if not touches_meta:
            if _is_rng(func):
                raise MetaInitUnsupported(f"{func} draws random numbers into a real tensor while the model is built")
            return func(*args, **kwargs)  # arithmetic on real constants: its result is a constant too
        # Real tensors next to meta ones are constants of the program (kept for the replay); the meta
        # execution itself needs them on meta.
        meta_args, meta_kwargs = tree_map(_to_meta_if_real, (args, kwargs)) if not factory else (args, kwargs)
        try:
            out = func(*meta_args, **meta_kwargs)
        except Exception as e:  # noqa: BLE001 - any kernel that cannot run on meta ends the recording
            raise MetaInitUnsupported(f"{func} cannot run on the meta device ({type(e).__name__}: {e})") from e
        self._record(func, args, kwargs, out)
        return out

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        schema_args = func._schema.arguments
        written_names = _written_args(func)
        named: dict[str, Any] = {}
        for i, value in enumerate(args):
            if i < len(schema_args):
                named[schema_args[i].name] = value
        named.update(kwargs)
        reads: set[int] = set()
        writes: set[int] = set()
        kills: set[int] = set()
        overwrite = func.__name__.split(".")[0] in _OVERWRITE_OPS
        for name, value in named.items():
            for t in (value if isinstance(value, (list, tuple)) else [value]):
                if not (isinstance(t, torch.Tensor) and t.is_meta):
                    continue
                key, _ = self.key_of(t)
                if name in written_names:
                    writes.add(key)
                    if overwrite and name == schema_args[0].name and _covers_storage(t):
                        kills.add(key)
                        continue
                reads.add(key)
        outputs: list[Any] = []
        creates: set[int] = set()
        flat_out, _ = tree_flatten(out)
        for t in flat_out:
            if isinstance(t, torch.Tensor) and t.is_meta:
                key, new = self.key_of(t)
                if new:
                    creates.add(key)
                outputs.append(self.ref(t))
            else:
                outputs.append(None)
        rng = _is_rng(func)
        if not (writes or creates or rng):
            return  # a view or a metadata query: nothing to replay
        # Tensor arguments become references; real tensors are copied so that later in-place
        # changes to them cannot alter the recorded program.
        rec_args, rec_kwargs = tree_map(self._freeze, (args, kwargs))
        self.ops.append(_Op(func, rec_args, rec_kwargs, outputs, frozenset(reads - kills), frozenset(writes),
                            frozenset(kills), frozenset(creates), rng))

    def _freeze(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return self.ref(x) if x.is_meta else x.detach().clone()
        return x


def _to_meta_if_real(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and not x.is_meta and x.dim() > 0:
        return x.to(META)
    return x


@dataclass
class InitProgram:
    """The recorded construction of one model: ops, and which storage each tensor of the model views."""

    ops: list[_Op]
    nbytes: dict[int, int]
    # FQN (as named_parameters/named_buffers/attributes of the built model) -> its storage view.
    targets: dict[str, _Ref]
    # FQNs that shared one Parameter at build time (tied weights), first name first.
    tied: list[list[str]] = field(default_factory=list)
    # Set by the last materialize(): the most bytes of CPU storage the replay held at once.
    peak_replay_bytes: int = 0
    # The CPU generator's state when the build started. Every replay starts from it, so a model
    # materialised in parts (a rank's pipeline stages, one FSDP root each, materialised one after
    # the other) gets the eager values in every part, not the draws after the previous part's
    # replay; each replay leaves the generator where the eager build leaves it.
    rng_state: torch.Tensor | None = None

    def materialize(self, model: nn.Module, device: torch.device, *, skip: set[str] | None = None,
                    name_of: Callable[[str], str] | None = None) -> None:
        """Allocate ``model``'s tensors on ``device`` and fill them with their recorded values.

        ``model`` is the built model after the strategy sharded, wrapped or pruned it: each of its
        parameters and buffers that is still on meta is allocated (only the local shard of a
        DTensor) and receives its slice of the replayed value. ``skip``: FQNs whose values come from
        elsewhere (pretrained weights); their computation is left out. ``name_of`` maps the
        wrapped model's names back to the built model's (wrapper prefixes removed).
        """
        name_of = name_of or (lambda n: n)
        skip = skip or set()
        if any(t.is_meta for t in _tensors(model)):
            model.to_empty(device=device)
        self._retie(model, name_of)
        destinations: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        # A tensor the strategy cut out of a recorded one (GPT-2's c_attn split into q/k/v for TP,
        # parallel/tensor/gpt2.py) takes its slice of the recorded value along its output features.
        parts = fused_sources(model)
        for name, tensor in _named_tensors(model):
            fqn = name_of(name)
            part = None
            if fqn not in self.targets and name in parts:
                source, start, length, dim = parts[name]
                fqn, part = name_of(source), (dim, start, length)
            ref = self.targets.get(fqn)
            if ref is None or fqn in skip:
                continue
            destinations.setdefault(ref.key, []).append((tensor, part))
        # Plain tensor attributes that are still meta (e.g. a rotary module's ``original_inv_freq``)
        # become real tensors holding their recorded value.
        attributes: dict[int, list[tuple[nn.Module, str, _Ref]]] = {}
        for mod_name, module in model.named_modules():
            for attr, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.is_meta:
                    ref = self.targets.get(name_of(f"{mod_name}.{attr}" if mod_name else attr))
                    if ref is not None:
                        attributes.setdefault(ref.key, []).append((module, attr, ref))
        wanted = set(destinations) | set(attributes)
        views: dict[int, list[_Ref]] = {}
        for ref in self.targets.values():
            views.setdefault(ref.key, []).append(ref)
        with torch.no_grad():
            for key, storage in self._replay(wanted):
                for dest, part in destinations.get(key, []):
                    if part is None:
                        _copy_into(dest, _view(storage, _matching_view(views[key], dest)))
                        continue
                    whole = _view(storage, _matching_view(views[key], dest, cut=part[0]))
                    _copy_into(dest, whole.narrow(*part))
                for module, attr, ref in attributes.get(key, []):
                    setattr(module, attr, _view(storage, ref).clone().to(device))

    def _retie(self, model: nn.Module, name_of: Callable[[str], str]) -> None:
        """Make tied weights one Parameter again if allocating them separately untied them."""
        by_name = {name_of(n): (n, p) for n, p in model.named_parameters(remove_duplicate=False)}
        for group in self.tied:
            present = [by_name[n] for n in group if n in by_name]
            if len(present) < 2:
                continue
            first = present[0][1]
            for full_name, param in present[1:]:
                if param is not first:
                    owner, _, attr = full_name.rpartition(".")
                    setattr(model.get_submodule(owner) if owner else model, attr, first)

    # ------------------------------------------------------------------ the replay
    def _plan(self, wanted: set[int]) -> tuple[list[bool], list[bool], dict[int, int]]:
        """(needed ops, ops replayed only for their random draws, last op index using each storage)."""
        n = len(self.ops)
        needed = [False] * n
        live = set(wanted)
        for i in range(n - 1, -1, -1):
            op = self.ops[i]
            if (op.writes | op.creates) & live:
                needed[i] = True
                live -= op.kills | op.creates
                live |= op.reads
        rng_only = [op.rng and not needed[i] for i, op in enumerate(self.ops)]
        last_use: dict[int, int] = {}
        for i, op in enumerate(self.ops):
            if needed[i]:
                for key in op.reads | op.writes | op.creates:
                    last_use[key] = i
                for out in op.outputs:
                    if out is not None:
                        last_use[out.key] = i
        return needed, rng_only, last_use

    def _replay(self, wanted: set[int]) -> Iterator[tuple[int, torch.UntypedStorage]]:
        """Run the program on the CPU; yield (storage key, storage) for each wanted storage when final."""
        needed, rng_only, last_use = self._plan(wanted)
        storages: dict[int, torch.UntypedStorage] = {}
        cpu = torch.device("cpu")
        self.peak_replay_bytes = 0
        if self.rng_state is not None:
            torch.set_rng_state(self.rng_state)

        def real(x: Any, scratch: bool) -> Any:
            if isinstance(x, _Ref):
                if scratch or x.key not in storages:
                    # A storage first written by this op (or a throw-away one for an op replayed
                    # only for its random draws): allocate it.
                    storage = torch.UntypedStorage(self.nbytes[x.key], device=cpu)
                    if not scratch:
                        storages[x.key] = storage
                else:
                    storage = storages[x.key]
                return torch.empty(0, dtype=x.dtype, device=cpu).set_(storage, x.offset, x.size, x.stride)
            if isinstance(x, torch.device) and x.type == "meta":
                return cpu
            if isinstance(x, torch.Tensor):
                return x.clone()  # a constant: the op may modify it
            return x

        for i, op in enumerate(self.ops):
            if not (needed[i] or rng_only[i]):
                continue
            scratch = rng_only[i]
            args, kwargs = tree_map(lambda x, s=scratch: real(x, s), (op.args, op.kwargs))
            out = op.func(*args, **kwargs)
            held = sum(st.nbytes() for st in storages.values())
            if scratch:
                held += sum(self.nbytes[x.key] for x in tree_flatten((op.args, op.kwargs))[0] if isinstance(x, _Ref))
                self.peak_replay_bytes = max(self.peak_replay_bytes, held)
                continue
            self._register_outputs(op, out, storages)
            held += sum(st.nbytes() for k, st in storages.items() if k in op.creates)
            self.peak_replay_bytes = max(self.peak_replay_bytes, held)
            for key in list(storages):
                if last_use.get(key, -1) <= i:
                    storage = storages.pop(key)
                    if key in wanted:
                        yield key, storage
        for key in list(storages):
            if key in wanted:
                yield key, storages.pop(key)

    def _register_outputs(self, op: _Op, out: Any, storages: dict[int, torch.UntypedStorage]) -> None:
        flat_out, _ = tree_flatten(out)
        for ref, t in zip(op.outputs, flat_out):
            if ref is None or not isinstance(t, torch.Tensor):
                continue
            if ref.key in op.creates:
                if (tuple(t.shape), tuple(t.stride()), t.storage_offset()) != (ref.size, ref.stride, ref.offset):
                    raise RuntimeError(f"replaying {op.func}: the CPU result's layout differs from the meta one")
                storages[ref.key] = t.untyped_storage()


def _matching_view(refs: list[_Ref], dest: torch.Tensor, cut: int | None = None) -> _Ref:
    """The recorded view of a storage whose shape is ``dest``'s (tied names share one storage);
    ``cut``: ``dest`` is a slice of it along that dim, so only the other dims must match."""
    shape = tuple(dest.shape)
    for ref in refs:
        if ref.size == shape:
            return ref
        if cut is not None and len(ref.size) == len(shape):
            keep = [i for i in range(len(shape)) if i != cut % len(shape)]
            if all(ref.size[i] == shape[i] for i in keep):
                return ref
    raise RuntimeError(f"no recorded tensor of shape {shape} in this storage")


def _view(storage: torch.UntypedStorage, ref: _Ref) -> torch.Tensor:
    return torch.empty(0, dtype=ref.dtype, device=storage.device).set_(storage, ref.offset, ref.size, ref.stride)


def local_region(dest: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(the tensor this rank holds of ``dest``, where it lies in the full value): all of a plain
    tensor, a DTensor's local shard and its slices of the global tensor."""
    if isinstance(dest, DTensor):
        shape, offset = compute_local_shape_and_global_offset(dest.shape, dest.device_mesh, dest.placements)
        return dest.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return dest, tuple(slice(0, s) for s in dest.shape)


def _copy_into(dest: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of the full value ``full`` into ``dest`` (a DTensor holds a slice)."""
    local, region = local_region(dest)
    local.copy_(full[region])


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    for _, t in _named_tensors(model):
        yield t


def is_meta_module(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in _tensors(model))


def record_build(factory: Callable[[], nn.Module]) -> tuple[nn.Module, InitProgram]:
    """Build ``factory()`` on the meta device; return (the meta model, its recorded init program).

    The global RNG is left as the eager build would leave it only once the program is replayed
    (``materialize`` replays every random draw); until then it is untouched. Raises
    MetaInitUnsupported when the factory cannot be built this way.
    """
    recorder = _Recorder()
    rng_state = torch.get_rng_state()
    # No ``with torch.device('meta')`` here: the recorder itself sends new tensors to meta, and
    # Hugging Face would skip its weight init under such a context (there would be nothing to record).
    with recorder:
        model = factory()
    if not isinstance(model, nn.Module):
        raise MetaInitUnsupported(f"the factory returned {type(model).__name__}, not an nn.Module")
    targets: dict[str, _Ref] = {}
    by_param: dict[int, list[str]] = {}
    for name, t in _named_tensors(model):
        if t.is_meta:
            targets[name] = recorder.ref(t)
        if isinstance(t, nn.Parameter):
            by_param.setdefault(id(t), []).append(name)
    for mod_name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.is_meta:
                targets.setdefault(f"{mod_name}.{attr}" if mod_name else attr, recorder.ref(value))
    tied = [names for names in by_param.values() if len(names) > 1]
    return model, InitProgram(recorder.ops, dict(recorder.nbytes), targets, tied, rng_state=rng_state)
