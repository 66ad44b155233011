"""Activation checkpointing that keeps module buffers exactly as without checkpointing.

A standalone library module: it imports torch and the standard library only, so it works after
``pip install bnadapt`` with nothing of the service installed, and can be copied alone.

- :func:`checkpoint` -- the functional form, like
  ``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)``.
- :func:`checkpoint_wrapper` / :class:`CheckpointWrapper` -- wraps one module. Takes both
  fairscale's signature ``checkpoint_wrapper(module, offload_to_cpu=False)`` and
  torch.distributed's ``checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
  checkpoint_fn=None, **checkpoint_fn_kwargs)``; ``state_dict`` keys stay those of the
  unwrapped module.
- :func:`apply_checkpointing` -- wraps, in place, the submodules that ``check_fn`` selects.
- :func:`apply_activation_checkpointing` -- torch.distributed's form of the same, with its
  ``auto_wrap_policy`` callables.
- :func:`disable_checkpointing` -- fairscale's switch: wrapped modules run plainly inside it.

Works under ``torch.compile`` (any backend, whole model or block by block, ``fullgraph=True``,
no graph break added; NOTE [ Under torch.compile ]) and under ``torch.func.functional_call``
with any parameter and buffer values (NOTE [ Parameters in the recomputation ]). Limits, shared
with torch's own checkpoint: ``torch.func.grad``/``vjp`` reject the saved-tensor hooks every
non-reentrant checkpoint uses; under ``torch.compile``, ``offload_to_cpu`` breaks the graph
(dynamo cannot trace saved-tensor hooks; that part runs eagerly, still exact), and dropout in a
region recomputes a different mask on the eager backend only (torch's op drops
``preserve_rng_state`` there and leaves the RNG to inductor).

What cannot keep the guarantee is refused with a ``ValueError`` or ``TypeError`` that says what
to use instead: the reentrant variant (``CheckpointImpl.REENTRANT``, ``use_reentrant=True``) and
a ``checkpoint_fn`` of one's own. See NOTE [ Buffers and the recomputation ] for the guarantee
and how it is kept.

Where the code lives (a decision, not an accident): this file is the library. The service's
packages (``service``, ``workers``, ``api_schemas``) stay top-level in the same distribution
for now, and import this module as ``bnadapt.checkpoint``. Nothing here may import them.

One module on purpose, like torch's own checkpoint.py: a user may take this file alone, and its
NOTE blocks map it.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import Any, NamedTuple, Protocol, TypeVar, cast

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils import checkpoint as _torch_checkpoint

__all__ = [
    "CheckpointImpl",
    "CheckpointWrapper",
    "apply_activation_checkpointing",
    "apply_checkpointing",
    "checkpoint",
    "checkpoint_wrapper",
    "disable_checkpointing",
]

# NOTE [ Buffers and the recomputation ]
#
# The guarantee: buffers are updated by the first forward and never by the recomputation,
# whatever the grad mode. After any sequence of calls, the outputs, the gradients and the whole
# state_dict of a model run through this module are bitwise equal (torch.equal) to those of the
# same model run without checkpointing. It holds for any module that changes its buffers in
# forward: BatchNorm's running statistics and num_batches_tracked, InstanceNorm with
# track_running_stats, spectral norm's power iteration, an EMA buffer of one's own.
#
# Why torch's checkpoint breaks it: the recomputation during backward runs forward a second
# time, so every in-place buffer update happens twice. Switching updates off during the
# recomputation (fairscale's track_running_stats trick) changes which tensors are saved, and the
# non-reentrant checkpoint rejects that; updating only in the recomputation (fairscale) misses
# forward-only passes such as BN adaptation under no_grad.
#
# How it is kept, on top of torch's non-reentrant checkpoint, through its context_fn:
# 1. First forward (forward context): it runs on the real buffers, so they are updated exactly
#    as without checkpointing. Before any module of the region runs, we record its training
#    flag and a clone of each of its buffers (_CallState.capture). A wrapped module's whole
#    tree is recorded when torch asks for the contexts, right before the region runs (nothing
#    runs in between), so the guarantee covers the modules registered under it (as
#    state_dict does); one it calls without registering it (kept in a plain list, or passed
#    in as an argument) is not recorded. A plain function passed to checkpoint has no tree:
#    the modules it reaches are recorded when first called, through a global forward pre-hook
#    that is registered only while its first forward runs and ignores other threads. (Global
#    hooks would make torch.compile warn about, and retrace, compiled modules run inside a
#    wrapped one; that is why wrappers do without.)
# 2. Recomputation (recompute context): every recorded module gets its recorded training flag
#    and fresh throwaway clones of its recorded buffers in place of the real ones, so it
#    computes exactly what the first forward computed (later calls may have moved the real
#    buffers, or switched train/eval, in between). On exit the real buffer objects and flags
#    are put back, whatever happened: the recomputation may stop early (torch's early_stop
#    skips trailing ops that save nothing) or raise. Swapping objects rather than copying
#    values matters: tensors saved for backward by the recomputation may alias those clones,
#    and must keep the values they were computed with.
# 3. No grad mode: nothing will be recomputed, so the function is called directly; this is the
#    BN adaptation loop, and it costs nothing extra.
#
# Buffers that do not exist yet when the call starts (a Lazy module materialises them in its
# first forward) have no recorded value: the recomputation gets clones of their current values
# instead. They are still never updated twice; the recomputed output is exact whenever it does
# not depend on those buffers' values, as for LazyBatchNorm in train mode.
#
# One order of calls is the exception, by design: an eval-mode call saves BatchNorm's running
# statistics for backward by reference, and torch updates them inside the kernel in later
# train-mode calls, which no version counter sees; so unwrapped, that call's backward reads
# the updated statistics, not those its forward used. The wrapper's recomputation uses the
# latter: its gradient is that of the function the forward computed.
#
# The records cost one clone of the region's buffers per call, freed with the autograd graph;
# for BatchNorm that is a few floats per channel, against whole activation maps saved. BatchNorm
# in train mode skips them: NOTE [ BatchNorm in train mode ].

# NOTE [ Parameters in the recomputation ]
#
# The recomputation must also see the parameters the first forward saw. They can differ from
# the module's own by the time backward runs: torch.func.functional_call (and
# stateless.reparametrize) puts other tensors into the module's _parameters for the duration of
# the call only, and restores the real ones before backward. Recomputing with those would
# compute with the wrong weights and send the gradients to them instead of to the tensors the
# caller passed. So _CallState also records each module's _parameters entries (the tensor
# objects themselves, not clones: they must stay the autograd leaves or nodes of the caller's
# graph), and the recomputation swaps them in beside the buffers, and back out on exit.
# A buffer that requires grad is kept the same way, by object, not copied: the gradient goes
# to it, so the recomputation must read it, as it reads parameters.

# NOTE [ The cost of a call ]
#
# Everything above runs in Python once per checkpointed call, in the forward and again in the
# recomputation, on top of torch's own checkpoint. Where a step's operators are large (a CPU
# train step at batch 32) that is lost in the noise; where they are tiny, as in an eager CUDA
# step of a small model, which waits on the CPU that launches its kernels, it is not: every
# microsecond is on the critical path. Inside a step the caches are cold (the operators in
# between refill them), and there a line costs several times what it costs in a warm loop
# (bench/history/2026-12-05-checkpoint-wrapper-per-call-cost-cut.md); the first code to touch
# a module pays for it, whatever it reads there. So what counts is how much gets touched, not
# how many operations run, and the common case is kept short:
# - one record per module (module, flag, parameters, buffer record), made in one plain loop
#   that reads each module once, and gone over in one loop by the recomputation (a pass per
#   field through map and attrgetter, faster in a warm loop, was slower in a step);
# - the recorded parameters are not compared with the module's at the recomputation: the
#   recorded dict stands in for the module's _parameters (one assignment there and one back);
# - BatchNorm in train mode records nothing: its cached scratch is found by its three buffer
#   objects, and its recomputation swaps one dict;
# - the call's state is itself torch's context_fn and the recomputation's context, one object
#   per call, and the wrapper merges its options once.
# bench/checkpoint/wrapper.py (`launch`, figure `checkpoint-launch-bound` in bench/RESULTS.md)
# measures what is left per block call: most of it is reading every module of the block twice,
# once in each pass, which the guarantee needs (a model switched to eval, or parameters swapped
# by functional_call, between forward and backward).

# NOTE [ Under torch.compile ]
#
# Dynamo traces torch's non-reentrant checkpoint as a higher-order op and accepts no context_fn
# but torch's own selective-checkpoint ones, so the context managers above cannot be used when
# torch.compiler.is_compiling(). Measured with torch 2.13, the plain op is no answer either:
# under aot_eager and inductor the recomputation happens inside AOT's joint graph, which
# applies buffer mutations once, but under the eager backend the op runs torch's checkpoint on
# the traced region, whose recomputation updates the buffers again (and fails its own
# saved-input version check). So a region whose root module is known is traced in functional
# form instead, one that is right on every backend:
#   snapshot = clone of each buffer of the root's tree (outside the region)
#   region(snapshot, *args): work = clones of snapshot; out = functional_call(root, work, args)
#                            return out, work          # its inputs are never written
#   out, updated = torch checkpoint(region, snapshot, *args)
#   buffer.copy_(updated) for each buffer (outside the region: once, whatever recomputes)
# Recomputation, wherever it happens, starts again from the snapshot, so it computes what the
# first forward computed and writes only throwaway clones. The snapshot itself is taken in a
# selective checkpoint that must save its clones: otherwise AOT's partitioner finds it cheaper
# to save the buffer (a graph input) and clone it again in backward, and a second forward
# before that backward has written the buffer by then (torch's autograd then fails its version
# check; torch's own checkpoint fails so under compile whenever two forwards share a
# backward). Parameters are inputs of the traced region, so the recomputation uses the
# forward's (NOTE [ Parameters in the recomputation ]) without recording them. Training flags
# are read while tracing and baked into the graph.
# A plain function (no root module) has no buffers we can name before it runs: it gets
# torch's op as is (buffers updated once under aot_eager and inductor; under the eager backend
# torch's own error if the region updates buffers).

_WRAPPED_NAME = "_checkpoint_wrapped_module"
_T = TypeVar("_T")


# torch._foreach_clone clones a list in one dispatch (a clone each from Python costs its
# dispatch again); some torch releases that bnadapt supports (2.11) lack it.
_FOREACH_CLONE: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = getattr(
    torch, "_foreach_clone", None
)


def _clone_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A clone of each of ``tensors``, in one call where torch has one."""
    if _FOREACH_CLONE is not None:
        return _FOREACH_CLONE(tensors)
    return [tensor.clone() for tensor in tensors]


class _Buffers(NamedTuple):
    """How the recomputation treats one module's buffers, as the call found them."""

    # A BatchNorm in train mode: its scratch buffers, nothing recorded (NOTE [ BatchNorm in
    # train mode ]); None otherwise.
    scratch: dict[str, torch.Tensor | None] | None
    # The names of its buffers with a value (not None, nor a Lazy module's not yet
    # materialised), whose copies are the call's `values` from `first` on, in this order.
    names: tuple[str, ...]
    first: int
    # Its buffers that require grad, themselves: like parameters, the recomputation must read
    # the tensors the gradient goes to, not copies.
    leaves: dict[str, torch.Tensor] | None
    # Whether its class keeps values for the recomputation (NOTE [ Values kept for the
    # recomputation ]).
    keeps: bool


# NOTE [ BatchNorm in train mode ]
#
# In train mode BatchNorm normalises by the batch's own statistics: its output reads the
# running statistics not at all, it only writes them. So its recomputation needs no copy of
# their recorded values, only somewhere harmless to write: each such module gets scratch
# buffers, made once (clones of its buffers as it had them) and reused by every recomputation
# while the module keeps the same buffer objects. That saves the two clones per call (first
# forward and recomputation) that cost most on CUDA, where every clone is a kernel launch on
# the step's critical path. The recomputation hands the scratch over in one assignment: the
# module's _buffers dict is swapped for the scratch dict and back (torch's BatchNorm reaches
# its buffers only through _buffers). Repeated recomputations (retain_graph) write the same
# scratch: nothing reads it, and autograd keeps no version check on BatchNorm's running
# statistics. (Two threads recomputing the same module at once would race on the swap, as
# they would on every other part of a module's state: one module, one backward at a time.)
# Only modules whose forward is torch's own (_BatchNorm's or SyncBatchNorm's), or one whose class
# says it is like it in that respect (_checkpoint_batch_norm_forward, as bnadapt's own
# SyncBatchNorm: in train mode its output reads no running statistic, and it reaches its buffers
# only through _buffers), with exactly its three buffers, none None or lazy, and no forward
# hooks of their own qualify; anything else is recorded and copied as above. Nothing else needs
# checking per call: with track_running_stats switched off, train mode passes no running
# statistics to the kernel (the scratch is not even written), and a running statistic that
# requires grad makes torch's kernel refuse the first forward, before any recomputation (in
# bnadapt's SyncBatchNorm it is only written, under no_grad, and no gradient reaches it).

_BATCH_NORM_FORWARDS = frozenset(
    {nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward}
)
_BATCH_NORM_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
# The class attributes (set to True) by which a module class, as bnadapt's SyncBatchNorm,
# declares what the wrapper may rely on: a BatchNorm forward (NOTE [ BatchNorm in train mode ]),
# values kept for the recomputation (NOTE [ Values kept for the recomputation ]).
_DECLARES_BATCH_NORM_FORWARD = "_checkpoint_batch_norm_forward"
_DECLARES_KEPT_VALUES = "_checkpoint_keeps_values"


def _is_batch_norm_forward(kind: type[nn.Module]) -> bool:
    return kind.forward in _BATCH_NORM_FORWARDS or bool(
        getattr(kind, _DECLARES_BATCH_NORM_FORWARD, False)
    )


def _keeps_values(kind: type[nn.Module]) -> bool:
    return getattr(kind, _DECLARES_KEPT_VALUES, False) is True


# NOTE [ Values kept for the recomputation ]
#
# Some values of a first forward must not be computed again by the recomputation: a
# synchronized BatchNorm's global statistics come out of a collective that every rank joins
# (bnadapt/sync_batchnorm.py), and a recomputation that ran it again would cost one more
# collective per layer and step (fairscale's SyncBatchNorm saves its first forward's statistics
# for its recomputation for the same reason). Such a module's class declares
# `_checkpoint_keeps_values = True` and computes those values through
# _kept_for_recomputation(module, compute):
# - outside any checkpointed call, and under torch.compile, it returns compute();
# - in a first forward, it returns compute() and keeps the value with every checkpointed call
#   under way on this thread (an outer call's recomputation will need it as much as the inner
#   call's own), in the order of the module's calls;
# - in a recomputation, it returns the value the first forward kept for the module's k-th call
#   of that call (counted afresh by each recomputation: retain_graph recomputes again, early
#   stop recomputes a prefix), computing nothing: the same tensor object, so the recomputation
#   normalises with exactly the first forward's statistics. Where calls are nested (a wrapped
#   block inside a wrapped block), the outermost call under recomputation answers, and the
#   inner call, which runs its first forward inside it, keeps what it answered.
# Only calls whose recorded modules include such a class take part: the wrapper notes it when
# it makes the module's buffer record (the class is read once per module for BatchNorm's
# scratch, NOTE [ BatchNorm in train mode ]), and only then enters a context in the first
# forward and marks the recomputation on this thread's stack (_KEEPING); every other call
# costs nothing more. The kept values live as long as the call's state, that is as long as
# its autograd graph. A module the call does not record (not registered under the wrapped
# module) computes in the recomputation again, as before: its values are not kept.


class _Scratch(NamedTuple):
    """A qualifying BatchNorm's scratch (NOTE [ BatchNorm in train mode ]): the type and the
    three buffer objects it was made for, and the record that hands it to the recomputation."""

    kind: type[nn.Module]
    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor
    record: _Buffers


# By id of module; the entry goes when the module does.
_SCRATCH: dict[int, _Scratch] = {}


def _new_scratch(module: nn.Module, buffers: dict[str, torch.Tensor | None]) -> _Buffers | None:
    """The record of NOTE [ BatchNorm in train mode ] for ``module`` with ``buffers``, its
    scratch made and cached; None for a forward other than torch's BatchNorm's, other buffers
    than its three, or one of them None or lazy. The per-call path checks only what can change
    for the same module and buffer objects (forward hooks)."""
    if not _is_batch_norm_forward(type(module)) or tuple(buffers) != _BATCH_NORM_BUFFERS:
        return None
    mean, var, count = buffers.values()
    if mean is None or var is None or count is None or any(map(is_lazy, (mean, var, count))):
        return None
    scratch: dict[str, torch.Tensor | None] = {
        name: value.detach().clone()
        for name, value in zip(_BATCH_NORM_BUFFERS, (mean, var, count), strict=True)
    }
    key = id(module)
    if key not in _SCRATCH:
        weakref.finalize(module, _SCRATCH.pop, key, None)
    record = _Buffers(scratch, (), 0, None, _keeps_values(type(module)))
    _SCRATCH[key] = _Scratch(type(module), mean, var, count, record)
    return record


def _throwaway_copies(
    real: dict[str, torch.Tensor | None],
    buffers: dict[str, torch.Tensor | None],
    names: tuple[str, ...],
    leaves: dict[str, torch.Tensor] | None,
) -> None:
    """In a module's ``real`` _buffers, a throwaway copy of each of its ``buffers`` with no
    recorded value (not yet materialised when the call reached it, or registered since)."""
    for name, value in buffers.items():
        if name not in names and not (leaves and name in leaves):
            real[name] = None if value is None else value.clone()


# One module as a call found it: the module, its training flag, its _parameters entries (a
# copy, None where it had none) and its buffer record (None where it had no buffers: the
# recomputation looks whether it has some since).
_Record = tuple[nn.Module, bool, "dict[str, Any] | None", "_Buffers | None"]

# Per recomputation entered: the training flags it changed, with their real values; the
# _buffers dicts it changed, with copies of their real contents; and the modules' attribute
# dicts whose _parameters or _buffers it replaced, with the name and the dict they had.
_Changes = tuple[
    list[tuple[nn.Module, bool]],
    list[tuple[dict[str, Any], dict[str, Any]]],
    list[tuple[dict[str, Any], str, dict[str, Any]]],
]


class _CallState:
    """The training flags, parameters and buffer values of every module of one checkpointed
    call, as they were when the call reached that module.

    One record per module in the order recorded (NOTE [ The cost of a call ]). Entered, it is
    the recomputation's context: recorded flags, parameters and throwaway buffers in, the real
    ones back on exit. Torch may recompute the same call more than once (backward with
    retain_graph=True), so it is a plain class, reusable, not a generator."""

    __slots__ = (
        "_context_fn",
        "_cursors",
        "_kept",
        "_root",
        "_saved",
        "keeps",
        "records",
        "seen",
        "values",
    )

    def __init__(self, root: nn.Module | None = None, context_fn: ContextFn | None = None) -> None:
        # The region's root module, recorded when torch asks for the contexts (None: a plain
        # function, whose modules are recorded as it reaches them), and the caller's contexts.
        self._root = root
        self._context_fn = context_fn
        # None is "seen" from the start: a None in a module's _modules is no module.
        self.seen: set[nn.Module | None] = {None}
        self.records: list[_Record] = []
        # Copies of the recorded buffers, in the order of the records' names.
        self.values: list[torch.Tensor] = []
        # What each recomputation entered changed, to put back on exit.
        self._saved: list[_Changes] = []
        # NOTE [ Values kept for the recomputation ]: whether a recorded module keeps values,
        # the values its first forward kept by module, and how many of them the recomputation
        # under way has taken (made when it starts).
        self.keeps = False
        self._kept: dict[nn.Module, list[Any]] | None = None
        self._cursors: dict[nn.Module, int] | None = None

    def contexts(self) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        """The context_fn handed to torch's checkpoint: the first forward's context and the
        recomputation's, the caller's own entered inside ours."""
        forward: AbstractContextManager[Any] = _NOTHING
        if self._root is None:
            forward = _FirstForward(self)
        else:
            self.capture(self._root)
            if self.keeps:
                forward = _Keeping(self)
        recompute: AbstractContextManager[Any] = self
        if self._context_fn is not None:
            user_forward, user_recompute = self._context_fn()
            forward, recompute = _Both(forward, user_forward), _Both(recompute, user_recompute)
        return forward, recompute

    def capture(self, root: nn.Module) -> None:
        # Each call records a whole tree, so a module already recorded had its tree recorded
        # with it (as root.modules(), without building the names it would build).
        seen = self.seen
        if root in seen:
            return
        seen.add(root)
        found = [root]
        records = self.records
        first = len(self.values)
        tensors: list[torch.Tensor] = []
        # One plain loop, each module read once: inside a step, where the caches are cold,
        # that costs less than a pass per field (NOTE [ The cost of a call ]).
        try:
            for module in found:  # grows as it goes: breadth first
                children = module._modules
                if children:
                    for child in children.values():
                        if child not in seen:
                            seen.add(child)
                            found.append(child)  # type: ignore[arg-type]
                parameters = module._parameters
                then = parameters.copy() if parameters else None
                training = module.training
                buffers = module._buffers
                if not buffers:
                    records.append((module, training, then, None))
                    continue
                if training and not (module._forward_hooks or module._forward_pre_hooks):
                    # NOTE [ BatchNorm in train mode ]: the same module with the same buffer
                    # objects has the scratch made for them.
                    known = _SCRATCH.get(id(module))
                    record = (
                        known.record
                        if known is not None
                        and known.kind is type(module)
                        and len(buffers) == 3
                        and buffers.get("running_mean") is known.running_mean
                        and buffers.get("running_var") is known.running_var
                        and buffers.get("num_batches_tracked") is known.num_batches_tracked
                        else _new_scratch(module, buffers)
                    )
                    if record is not None:
                        if record.keeps:
                            self.keeps = True
                        records.append((module, training, then, record))
                        continue
                names: tuple[str, ...] = ()
                leaves = None
                start = first + len(tensors)
                keeps = getattr(type(module), _DECLARES_KEPT_VALUES, False) is True
                if keeps:
                    self.keeps = True
                for name, buf in buffers.items():
                    if buf is None or is_lazy(buf):
                        continue
                    if buf.requires_grad:
                        leaves = {} if leaves is None else leaves
                        leaves[name] = buf
                    else:
                        names += (name,)
                        tensors.append(buf)
                records.append(
                    (module, training, then, _Buffers(None, names, start, leaves, keeps))
                )
        except AttributeError:
            # A TorchScript module's _parameters and _buffers are views of its C++ state,
            # without the dict methods read here: say so, rather than what was missing.
            _refuse_torchscript(found)
            raise
        if tensors:
            # One call for all the copies: a clone each from Python costs its dispatch again.
            self.values.extend(_clone_all(tensors))

    def __enter__(self) -> None:
        flags: list[tuple[nn.Module, bool]] = []
        dicts: list[tuple[dict[str, Any], dict[str, Any]]] = []
        swaps: list[tuple[dict[str, Any], str, dict[str, Any]]] = []
        # Pushed first, each change noted before it is made: should a copy fail (out of
        # memory), what was changed is put back before the error goes on.
        self._saved.append((flags, dicts, swaps))
        try:
            values = self.values
            copies = _clone_all(values) if values else values
            # One pass, each module read once (NOTE [ The cost of a call ]). Module.__setattr__
            # costs microseconds (it looks through parameters, buffers and submodules first),
            # so a flag is set only where it differs. The recorded parameters go in without
            # being compared first: the recorded dict stands in for the module's _parameters,
            # one assignment there and one back, which costs less than comparing the entries.
            for module, training, then, record in self.records:
                if module.training != training:
                    flags.append((module, module.training))
                    module.training = training
                if then is not None:
                    attributes = module.__dict__
                    swaps.append((attributes, "_parameters", attributes["_parameters"]))
                    attributes["_parameters"] = then
                real = module._buffers
                if record is None:
                    if real:  # registered since the call
                        buffers = real.copy()
                        dicts.append((real, buffers))
                        _throwaway_copies(real, buffers, (), None)
                    continue
                if record.scratch is not None:
                    # Torch's BatchNorm forward only reads its buffers through _buffers: the
                    # scratch dict stands in for the module's own, swapped back on exit.
                    attributes = module.__dict__
                    swaps.append((attributes, "_buffers", real))
                    attributes["_buffers"] = record.scratch
                    continue
                buffers = real.copy()
                dicts.append((real, buffers))
                names, leaves = record.names, record.leaves
                first = record.first
                for offset, name in enumerate(names):
                    real[name] = copies[first + offset]
                if leaves:
                    real.update(leaves)
                if len(real) != len(names) + (len(leaves) if leaves else 0):
                    _throwaway_copies(real, buffers, names, leaves)
        except BaseException as exc:
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise
        if self.keeps:
            self._cursors = {}
            _KEEPING.calls.append(self)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.keeps:
            _stop_keeping(self)
        flags, dicts, swaps = self._saved.pop()
        for module, training in flags:
            module.training = training
        for real, contents in dicts:
            real.clear()
            real.update(contents)
        for attributes, name, value in swaps:
            attributes[name] = value

    @property
    def recomputing(self) -> bool:
        return bool(self._saved)

    def keep(self, module: nn.Module, value: Any) -> None:
        """Keep ``value``, computed by ``module``'s next call in the first forward."""
        if self._kept is None:
            self._kept = {}
        self._kept.setdefault(module, []).append(value)

    def recall(self, module: nn.Module) -> Any:
        """The value kept for ``module``'s next call in this recomputation; _NOT_KEPT where the
        first forward kept none for it."""
        kept = None if self._kept is None else self._kept.get(module)
        cursors = self._cursors
        taken = 0 if cursors is None else cursors.get(module, 0)
        if kept is None or cursors is None or taken >= len(kept):
            return _NOT_KEPT
        cursors[module] = taken + 1
        return kept[taken]


class _KeepingCalls(threading.local):
    """This thread's checkpointed calls under way whose modules keep values, innermost last
    (NOTE [ Values kept for the recomputation ])."""

    def __init__(self) -> None:
        self.calls: list[_CallState] = []


_KEEPING = _KeepingCalls()
_NOT_KEPT: Any = object()


class _Keeping:
    """The first forward's context of a call whose modules keep values: the call is under way
    on this thread while its region runs."""

    __slots__ = ("_state",)

    def __init__(self, state: _CallState) -> None:
        self._state = state

    def __enter__(self) -> None:
        _KEEPING.calls.append(self._state)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _stop_keeping(self._state)


def _stop_keeping(state: _CallState) -> None:
    """``state``'s call off this thread's stack of calls under way, if it is on top."""
    calls = _KEEPING.calls
    if calls and calls[-1] is state:
        calls.pop()


def _kept_for_recomputation(module: nn.Module, compute: Callable[[], _T]) -> _T:
    """NOTE [ Values kept for the recomputation ]: ``compute()``, in a first forward kept with
    the checkpointed calls under way; in a recomputation, what the first forward computed for
    this call of ``module``, without computing it again."""
    calls = _KEEPING.calls
    if not calls or torch.compiler.is_compiling():
        return compute()
    source = next((call for call in calls if call.recomputing), None)
    value = _NOT_KEPT if source is None else source.recall(module)
    if value is _NOT_KEPT:
        value = compute()
    for call in calls:
        if not call.recomputing:
            call.keep(module, value)
    return cast(_T, value)


def _refuse_torchscript(modules: Iterable[nn.Module]) -> None:
    """Raise a TypeError that says what to do if any of ``modules`` is a TorchScript module."""
    for module in modules:
        if isinstance(module, torch.jit.ScriptModule):
            raise TypeError(
                f"bnadapt's checkpoint cannot keep the buffers of a TorchScript module exact "
                f"({type(module).__name__}: its state lives in C++, out of the wrapper's reach; "
                "TorchScript is deprecated in torch): checkpoint the eager module, and use "
                "torch.compile if you want it compiled"
            )


class _FirstForward:
    """Context of the first forward of a plain function: records the modules it reaches
    before they run (a region with a root module is recorded before it starts)."""

    def __init__(self, state: _CallState) -> None:
        self._state = state
        self._owner = threading.get_ident()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> None:
        self._handles.append(
            nn.modules.module.register_module_forward_pre_hook(self.on_forward_pre)
        )
        # Its modules are not known yet: whether they keep values shows as they run.
        _KEEPING.calls.append(self._state)

    def on_forward_pre(self, module: nn.Module, args: Any) -> None:
        # Under torch.compile this hook is traced into the graphs of compiled modules that run
        # inside the region; it must neither break them (threading.get_ident would) nor record
        # anything, since those modules run as compiled code. See NOTE [ Under torch.compile ].
        if torch.compiler.is_compiling():
            return
        if threading.get_ident() == self._owner:
            self._state.capture(module)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._handles:
            self._handles.pop().remove()
        calls = _KEEPING.calls
        if calls and calls[-1] is self._state:
            calls.pop()


class _Both:
    """Two context managers entered as one (ours outside, the caller's inside)."""

    def __init__(self, outer: AbstractContextManager[Any], inner: AbstractContextManager[Any]):
        self._outer = outer
        self._inner = inner

    def __enter__(self) -> None:
        self._outer.__enter__()
        try:
            self._inner.__enter__()
        except BaseException as exc:
            self._outer.__exit__(type(exc), exc, exc.__traceback__)
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        try:
            suppressed = bool(self._inner.__exit__(exc_type, exc, tb))
        finally:
            self._outer.__exit__(exc_type, exc, tb)
        return suppressed


ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]


def _root_module(function: Callable[..., Any]) -> nn.Module | None:
    if isinstance(function, nn.Module):
        return function
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = False,
    context_fn: ContextFn | None = None,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    **kwargs: Any,
) -> Any:
    """Call ``function(*args, **kwargs)`` without keeping its activations for backward.

    Like ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, and keeps NOTE
    [ Buffers and the recomputation ]: buffers change once, in this call, never when backward
    recomputes it. ``context_fn``, if given, is entered inside ours in both passes.
    """
    if use_reentrant:
        raise ValueError(
            "bnadapt's checkpoint is non-reentrant only (the reentrant variant offers no place "
            "to tell the recomputation apart, so buffers would be updated twice); drop "
            "use_reentrant=True or pass use_reentrant=False"
        )
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    options = {
        "preserve_rng_state": preserve_rng_state,
        "determinism_check": determinism_check,
        "debug": debug,
        "early_stop": early_stop,
    }
    return _checkpointed(function, _root_module(function), args, kwargs, context_fn, options)


# Entered as the first forward's context where the region's root module is known: the root's
# tree is recorded when torch asks for the contexts, right before the region runs.
_NOTHING = nullcontext()


def _checkpointed(
    function: Callable[..., Any],
    root: nn.Module | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    context_fn: ContextFn | None,
    options: dict[str, Any],
) -> Any:
    """:func:`checkpoint` with grad enabled, its options checked; ``root`` is the module whose
    call ``function`` is, if any. The wrapper's forward calls it directly."""
    if torch.compiler.is_compiling():
        if context_fn is not None:
            options = {**options, "context_fn": context_fn}
        if root is not None and function is root:
            return _checkpoint_traced(root, args, kwargs, options)
        return _torch_checkpoint.checkpoint(
            function, *args, use_reentrant=False, **options, **kwargs
        )

    state = _CallState(root, context_fn)
    return _torch_checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=state.contexts, **options, **kwargs
    )


def _clones(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The snapshot of NOTE [ Under torch.compile ]."""
    return [t.detach().clone() for t in tensors]


def _save_clones() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """A selective checkpoint that saves every clone: backward never takes the snapshot again
    from a buffer a later forward may have written."""
    # torch leaves create_selective_checkpoint_contexts unannotated.
    contexts: tuple[AbstractContextManager[Any], AbstractContextManager[Any]] = (
        _torch_checkpoint.create_selective_checkpoint_contexts(  # type: ignore[no-untyped-call]
            [torch.ops.aten.clone.default]
        )
    )
    return contexts


def _checkpoint_traced(
    root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], options: dict[str, Any]
) -> Any:
    """NOTE [ Under torch.compile ]: checkpoint ``root(*args, **kwargs)`` in functional form."""
    names, buffers = [], []
    for name, buf in root.named_buffers():
        names.append(name)
        buffers.append(buf)
    snapshot = _torch_checkpoint.checkpoint(
        _clones, *buffers, use_reentrant=False, context_fn=_save_clones
    )

    def region(*flat: Any, **region_kwargs: Any) -> tuple[Any, tuple[torch.Tensor, ...]]:
        work = {name: value.clone() for name, value in zip(names, flat[: len(names)], strict=True)}
        out = torch.func.functional_call(root, work, flat[len(names) :], region_kwargs)
        return out, tuple(work.values())

    out, updated = _torch_checkpoint.checkpoint(
        region, *snapshot, *args, use_reentrant=False, **options, **kwargs
    )
    with torch.no_grad():
        for buf, value in zip(buffers, updated, strict=True):
            buf.copy_(value)
    return out


def _pack_to_cpu(tensor: torch.Tensor) -> tuple[torch.device | None, torch.Tensor]:
    if tensor.device.type == "cpu":
        return None, tensor
    pinned = tensor.device.type == "cuda"
    packed = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pinned)
    packed.copy_(tensor, non_blocking=pinned)
    return tensor.device, packed


def _unpack_from_cpu(packed: tuple[torch.device | None, torch.Tensor]) -> torch.Tensor:
    device, tensor = packed
    if device is None:
        return tensor
    return tensor.to(device, non_blocking=tensor.is_pinned())


def _offload_saved_inputs() -> AbstractContextManager[Any]:
    # Inside a checkpointed region torch's own saved-tensor hooks take precedence, so these see
    # only what the checkpoint itself keeps for backward: the region's inputs.
    return torch.autograd.graph.saved_tensors_hooks(_pack_to_cpu, _unpack_from_cpu)


def _strip_wrapped(key: str, prefix: str) -> str | None:
    """``prefix._checkpoint_wrapped_module.rest`` -> ``prefix.rest``; None if not wrapped."""
    inner = prefix + _WRAPPED_NAME
    if key == inner:
        return prefix[:-1]
    if key.startswith(inner + "."):
        return prefix + key[len(inner) + 1 :]
    return None


def _add_wrapped(key: str, prefix: str) -> str | None:
    """``prefix.rest`` -> ``prefix._checkpoint_wrapped_module.rest``; None if not ours."""
    if key == prefix[:-1]:
        return prefix + _WRAPPED_NAME
    if key.startswith(prefix) and not key.startswith(prefix + _WRAPPED_NAME + "."):
        return prefix + _WRAPPED_NAME + "." + key[len(prefix) :]
    return None


def _strip_state_dict_keys(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]
) -> None:
    # The wrapped module's entries are the last ones added, so popping and re-adding them in
    # order keeps the order of the unwrapped model's state_dict.
    for key in list(state_dict):
        new_key = _strip_wrapped(key, prefix)
        if new_key is not None:
            state_dict[new_key] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for key in list(metadata):
            new_key = _strip_wrapped(key, prefix)
            if new_key is not None:
                metadata[new_key] = metadata.pop(key)


def _add_state_dict_keys(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    for key in list(state_dict):
        new_key = _add_wrapped(key, prefix)
        if new_key is not None:
            state_dict[new_key] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for key in list(metadata):
            new_key = _add_wrapped(key, prefix)
            if new_key is not None and new_key not in metadata:
                metadata[new_key] = metadata[key]


def _strip_incompatible_keys(module: nn.Module, incompatible_keys: Any) -> None:
    # Runs before load_state_dict formats its strict-mode error, so the missing and unexpected
    # keys it reports are the unwrapped model's names.
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        keys[:] = [_unwrapped_name(key) for key in keys]


class CheckpointImpl(enum.Enum):
    """torch.distributed's choice of checkpoint variant. Only ``NO_REENTRANT`` keeps buffers exact;
    torch.distributed's own ``CheckpointImpl`` members are accepted too, by name."""

    REENTRANT = enum.auto()
    NO_REENTRANT = enum.auto()


# The options of torch's non-reentrant checkpoint that the wrapper passes on to :func:`checkpoint`;
# ``use_reentrant`` (False only) is read, not passed.
_PASSED_OPTIONS = frozenset(
    {"preserve_rng_state", "determinism_check", "debug", "early_stop", "context_fn"}
)


def _impl_name(value: object) -> str | None:
    """``"REENTRANT"`` or ``"NO_REENTRANT"`` for a member of our CheckpointImpl or of
    torch.distributed's (not imported here: torch.distributed may be absent); None otherwise."""
    if isinstance(value, enum.Enum) and type(value).__name__ == "CheckpointImpl":
        return value.name
    return None


def _checkpoint_options(
    checkpoint_fn: Callable[..., Any] | None, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The options for :func:`checkpoint` out of torch.distributed's ``checkpoint_fn`` and
    ``**checkpoint_fn_kwargs``; raises where they ask for what breaks the guarantee."""
    options = dict(kwargs)
    if isinstance(checkpoint_fn, functools.partial) and not checkpoint_fn.args:
        options = {**checkpoint_fn.keywords, **options}
        checkpoint_fn = checkpoint_fn.func
    if checkpoint_fn is _torch_checkpoint.checkpoint:
        # torch's own default is the reentrant variant (with a warning), so only an explicit
        # use_reentrant=False maps onto ours.
        if options.get("use_reentrant") is not False:
            raise ValueError(
                "checkpoint_fn=torch.utils.checkpoint.checkpoint runs the reentrant variant "
                f"unless use_reentrant=False (got use_reentrant={options.get('use_reentrant')}), "
                "and the reentrant recomputation updates buffers a second time; pass "
                "use_reentrant=False, or drop checkpoint_fn"
            )
    elif checkpoint_fn is not None and checkpoint_fn is not checkpoint:
        name = getattr(checkpoint_fn, "__qualname__", type(checkpoint_fn).__name__)
        raise ValueError(
            f"checkpoint_fn={name} cannot keep buffers exact: the checkpoint function decides how "
            "the recomputation runs, and only bnadapt's keeps it from updating buffers again. "
            "Drop checkpoint_fn (the wrapper uses bnadapt.checkpoint.checkpoint), or pass "
            "torch.utils.checkpoint.checkpoint with use_reentrant=False"
        )
    if options.pop("use_reentrant", False):
        raise ValueError(
            "use_reentrant=True cannot keep buffers exact (the reentrant recomputation updates "
            "them a second time); drop it, or pass checkpoint_impl=CheckpointImpl.NO_REENTRANT"
        )
    unknown = sorted(options.keys() - _PASSED_OPTIONS)
    if unknown:
        raise TypeError(
            f"unknown checkpoint option(s) {unknown}; the wrapper passes on "
            f"{sorted(_PASSED_OPTIONS)} and use_reentrant=False"
        )
    return options


class CheckpointWrapper(nn.Module):
    """Runs the wrapped module through :func:`checkpoint`.

    Built like torch.distributed's ``CheckpointWrapper(module, checkpoint_impl, checkpoint_fn,
    **checkpoint_fn_kwargs)`` or fairscale's ``checkpoint_wrapper(module, offload_to_cpu)``:
    the second positional argument is a ``CheckpointImpl`` or fairscale's offload flag (read by
    its truth value, as fairscale reads it). ``offload_to_cpu=True`` keeps the saved inputs on
    the CPU (pinned, for CUDA tensors) until backward needs them. ``checkpoint_fn`` may only be
    this module's :func:`checkpoint` or torch's with ``use_reentrant=False``; the keyword
    options ``preserve_rng_state``, ``determinism_check``, ``debug``, ``early_stop`` and
    ``context_fn`` are passed on to it.

    Transparent to checkpoints: ``state_dict``, ``load_state_dict``, ``named_parameters`` and
    ``named_buffers`` use the unwrapped module's names, so weights saved from either load into
    the other with ``strict=True``; keys that still carry the ``_checkpoint_wrapped_module``
    prefix (as torch.distributed's wrapper and FSDP may write them) load too. Attributes not
    found on the wrapper are looked up on the wrapped module.
    """

    def __init__(
        self,
        module: nn.Module,
        checkpoint_impl: CheckpointImpl | bool = CheckpointImpl.NO_REENTRANT,
        checkpoint_fn: Callable[..., Any] | None = None,
        *,
        offload_to_cpu: bool | None = None,
        **checkpoint_fn_kwargs: Any,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"checkpoint_wrapper needs an nn.Module, got {type(module).__name__}")
        _refuse_torchscript(module.modules())
        impl = _impl_name(checkpoint_impl)
        if impl == "REENTRANT":
            raise ValueError(
                "CheckpointImpl.REENTRANT cannot keep buffers exact (the reentrant recomputation "
                "updates them a second time); use CheckpointImpl.NO_REENTRANT, the default"
            )
        if impl is None:
            # fairscale's signature: checkpoint_wrapper(module, offload_to_cpu).
            if isinstance(checkpoint_impl, str):
                raise TypeError(
                    f"checkpoint_impl={checkpoint_impl!r} is a string; pass "
                    "CheckpointImpl.NO_REENTRANT, or a bool for fairscale's offload_to_cpu"
                )
            if offload_to_cpu is not None:
                raise TypeError(
                    "offload_to_cpu given twice: as the second positional argument (fairscale's "
                    "signature) and as a keyword; pass it once"
                )
            offload_to_cpu = bool(checkpoint_impl)
        options = _checkpoint_options(checkpoint_fn, checkpoint_fn_kwargs)
        super().__init__()
        self._checkpoint_wrapped_module = module
        self.checkpoint_impl = CheckpointImpl.NO_REENTRANT
        self.offload_to_cpu = bool(offload_to_cpu)
        # As given, and as _checkpointed takes them: context_fn apart, and torch's defaults
        # (those of :func:`checkpoint` too) for the options not given.
        self._given_options = options
        self._context_fn: ContextFn | None = options.get("context_fn")
        self._options = {k: v for k, v in options.items() if k != "context_fn"}
        # torch leaves these three registration methods unannotated.
        self.register_state_dict_post_hook(_strip_state_dict_keys)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(_add_state_dict_keys)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_post_hook(_strip_incompatible_keys)  # type: ignore[no-untyped-call]

    @property
    def wrapped_module(self) -> nn.Module:
        module = self._modules[_WRAPPED_NAME]
        assert module is not None
        return module

    @property
    def checkpoint_options(self) -> dict[str, Any]:
        """The options passed on to the checkpoint, as given (a copy)."""
        return dict(self._given_options)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Every line here runs per call and, on CUDA, on the step's critical path: the wrapped
        # module is looked up directly, and the options were merged once, in __init__.
        module = self._modules[_WRAPPED_NAME]
        assert module is not None
        if not torch.is_grad_enabled() or _DISABLED.depth:
            return module(*args, **kwargs)
        if self.offload_to_cpu:
            with _offload_saved_inputs():
                return _checkpointed(module, module, args, kwargs, self._context_fn, self._options)
        return _checkpointed(module, module, args, kwargs, self._context_fn, self._options)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.wrapped_module, name)

    def __getitem__(self, key: Any) -> Any:
        return self.wrapped_module[key]  # type: ignore[index]

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            yield _unwrapped_name(name), param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, buf in super().named_buffers(prefix, recurse, remove_duplicate):
            yield _unwrapped_name(name), buf


def _unwrapped_name(name: str) -> str:
    return name.replace(_WRAPPED_NAME + ".", "")


def checkpoint_wrapper(
    module: nn.Module,
    checkpoint_impl: CheckpointImpl | bool = CheckpointImpl.NO_REENTRANT,
    checkpoint_fn: Callable[..., Any] | None = None,
    *,
    offload_to_cpu: bool | None = None,
    **checkpoint_fn_kwargs: Any,
) -> CheckpointWrapper:
    """Wrap ``module`` so its forward is checkpointed and its buffers stay exact.

    Arguments as :class:`CheckpointWrapper`: fairscale's ``checkpoint_wrapper(module,
    offload_to_cpu=False)`` and torch.distributed's ``checkpoint_wrapper(module,
    checkpoint_impl=CheckpointImpl.NO_REENTRANT, checkpoint_fn=None, **checkpoint_fn_kwargs)``
    both work.
    """
    return CheckpointWrapper(
        module,
        checkpoint_impl,
        checkpoint_fn,
        offload_to_cpu=offload_to_cpu,
        **checkpoint_fn_kwargs,
    )


def apply_checkpointing(
    model: nn.Module,
    *,
    check_fn: Callable[[nn.Module], bool],
    offload_to_cpu: bool = False,
) -> nn.Module:
    """Replace, in place, every submodule of ``model`` for which ``check_fn`` is true by its
    :func:`checkpoint_wrapper`; returns ``model``.

    The root itself is never wrapped, selected modules are not searched further, and modules
    already wrapped are left alone, so applying twice wraps nothing twice.
    """
    for name, child in list(model.named_children()):
        if isinstance(child, CheckpointWrapper):
            continue
        if check_fn(child):
            setattr(model, name, checkpoint_wrapper(child, offload_to_cpu=offload_to_cpu))
        else:
            apply_checkpointing(child, check_fn=check_fn, offload_to_cpu=offload_to_cpu)
    return model


class WrapPolicy(Protocol):
    """torch.distributed's auto-wrap policy callable, e.g. ``ModuleWrapPolicy({Block})`` or
    ``functools.partial(size_based_auto_wrap_policy, min_num_params=...)``."""

    def __call__(self, *, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool: ...


def _by_check_fn(check_fn: Callable[[nn.Module], bool]) -> WrapPolicy:
    def policy(*, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or bool(check_fn(module))

    return policy


def _by_targets(targets: dict[nn.Module, dict[str, Any]]) -> WrapPolicy:
    def policy(*, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or module in targets

    return policy


# NOTE [ Auto-wrap order ]
#
# apply_activation_checkpointing walks the tree as torch.distributed's does: depth first, a
# module's children before the module, and a module wrapped when the policy, asked with
# recurse=False, says so for the parameters its wrapped children have not taken
# (nonwrapped_numel). A policy that returns False for recurse=True stops the descent there.
# Unlike torch.distributed's, modules that are already CheckpointWrappers are left alone
# (neither searched nor wrapped again), so applying twice wraps nothing twice.


def _wrap_post_order(
    module: nn.Module,
    policy: WrapPolicy,
    wrap: Callable[..., nn.Module],
    kwargs_of: Callable[[nn.Module], dict[str, Any]],
    is_root: bool,
) -> tuple[nn.Module, int]:
    """NOTE [ Auto-wrap order ]: ``module``, wrapped or not, and the numel its wrappers took."""
    numel = sum(p.numel() for p in module.parameters())
    if isinstance(module, CheckpointWrapper) and not is_root:
        return module, numel
    if not policy(module=module, recurse=True, nonwrapped_numel=numel):
        return module, 0
    taken = 0
    for name, child in list(module.named_children()):
        new_child, child_taken = _wrap_post_order(child, policy, wrap, kwargs_of, is_root=False)
        if new_child is not child:
            setattr(module, name, new_child)
        taken += child_taken
    if not is_root and policy(module=module, recurse=False, nonwrapped_numel=numel - taken):
        return wrap(module, **kwargs_of(module)), numel
    return module, taken


def apply_activation_checkpointing(
    model: nn.Module,
    checkpoint_wrapper_fn: Callable[..., nn.Module] = checkpoint_wrapper,
    check_fn: Callable[[nn.Module], bool] = lambda _: True,
    auto_wrap_policy: WrapPolicy | Any | None = None,
) -> None:
    """torch.distributed's ``apply_activation_checkpointing``: wraps, in place, the submodules
    of ``model`` that ``auto_wrap_policy`` or, without one, ``check_fn`` selects.

    The order is NOTE [ Auto-wrap order ]; the root is never wrapped. ``auto_wrap_policy`` is a
    policy callable (``ModuleWrapPolicy``, a ``functools.partial`` of
    ``size_based_auto_wrap_policy`` or ``lambda_auto_wrap_policy``) or a policy object with
    ``_run_policy`` (``CustomPolicy``), whose per-module keyword arguments go to
    ``checkpoint_wrapper_fn``. ``checkpoint_wrapper_fn`` defaults to this module's
    :func:`checkpoint_wrapper`; a function of one's own is called as given, so it is up to it
    to keep the buffers exact.
    """
    kwargs_of: Callable[[nn.Module], dict[str, Any]] = lambda _: {}  # noqa: E731
    if auto_wrap_policy is None:
        policy = _by_check_fn(check_fn)
    elif callable(auto_wrap_policy):
        policy = auto_wrap_policy
    elif callable(getattr(auto_wrap_policy, "_run_policy", None)):
        # torch.distributed's non-callable policies (CustomPolicy) name their targets up front.
        targets = auto_wrap_policy._run_policy(model, ignored_modules=set(), root_kwargs={})
        policy, kwargs_of = _by_targets(targets), lambda m: targets[m]
    else:
        raise TypeError(
            f"auto_wrap_policy={auto_wrap_policy!r} is neither a policy callable "
            "(module=, recurse=, nonwrapped_numel=) nor a policy object with _run_policy; pass "
            "e.g. ModuleWrapPolicy({Block}), or use check_fn"
        )
    _wrap_post_order(model, policy, checkpoint_wrapper_fn, kwargs_of, is_root=True)


class _DisabledDepth(threading.local):
    depth = 0


_DISABLED = _DisabledDepth()


@contextlib.contextmanager
def disable_checkpointing() -> Iterator[None]:
    """Inside it, on this thread, wrapped modules run without checkpointing (fairscale's
    ``disable_checkpointing``): activations are kept, and there is nothing to recompute."""
    _DISABLED.depth += 1
    try:
        yield
    finally:
        _DISABLED.depth -= 1
