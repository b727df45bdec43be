"""Turning a user's ``state`` mapping into DCP state dicts and back.

Each top-level entry of ``state`` becomes an :class:`Entry` that knows how to produce what is
saved (``save_state``), what DCP should load into (``load_target``) and how to hand the loaded
values back to the live object (``apply``). All keys are world-size independent:

* modules: ``get_model_state_dict``'s keys and tensors (no ``module.``/``_orig_mod.`` prefixes;
  FSDP2 DTensors stay sharded), with the key mapping cached (:mod:`distckpt.state.module_keys`);
* optimizers: ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``, keyed by
  parameter FQN, matched with the module in ``state`` that owns their parameters;
* ``ZeroRedundancyOptimizer``: see :mod:`distckpt.state.zero`;
* objects with ``state_dict``/``load_state_dict`` (LR schedulers, GradScaler, samplers...);
* tensors (loaded in place) and values (plain ones stored as JSON, others in the encoded form of
  :mod:`distckpt.state.values`; replaced in ``state`` on load).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Set
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim import optimizer as _torch_optimizer

from distckpt._shown import shown
from distckpt.errors import StateMismatchError
from distckpt.state import containers, encoded, module_keys, values
from distckpt.state.scope import Declared

_FLAT_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


def parallel_kind(module: nn.Module) -> str:
    """How ``module`` is parallelized: ``ddp``, ``fsdp2`` or ``plain`` (``+compiled`` if so)."""
    from torch.nn.parallel import DistributedDataParallel

    suffix = "+compiled" if any(n.startswith("_orig_mod") or "._orig_mod" in n for n, _ in module.named_modules()) else ""
    if isinstance(module, (DistributedDataParallel, nn.DataParallel)):
        return "ddp" + suffix
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch
        FSDPModule = ()  # type: ignore[assignment,misc]
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        return "fsdp2" + suffix
    return "plain" + suffix


def dtensor_layout(module: nn.Module) -> str | None:
    """A digest of how ``module``'s DTensor parameters are laid out, or ``None`` if it has none.

    Covers each parameter's FQN, mesh shape and placements, so that FSDP2 on a 1-D mesh, HSDP
    or a 2-D mesh, or other placements at the same world size give different digests (the
    manifest records it; a load compares it to decide whether to verify the state).
    """
    import hashlib

    from torch.distributed.tensor import DTensor

    items = [
        f"{clean_fqn(name)}|{tuple(p.device_mesh.shape)}|{tuple(repr(pl) for pl in p.placements)}"
        for name, p in module.named_parameters()
        if isinstance(p, DTensor)
    ]
    if not items:
        return None
    return hashlib.sha256("\n".join(items).encode()).hexdigest()[:16]


class Entry:
    """One top-level item of ``state``. Subclasses are created by :func:`build_entries`.

    Attributes:
        declared: the scope the user or the object's kind declared (see :mod:`distckpt.state.scope`),
            ``None`` when it is to be detected.
        holder: the ``PerRank``/``Global`` wrapper the value came in, if any.
    """

    kind = "entry"
    #: whether the entry gets a global/per-rank scope (modules and optimizers do not: they are
    #: replicated or sharded by construction)
    scoped = True

    def __init__(self, name: str) -> None:
        self.name = name
        self.declared: str | None = None
        self.holder: Declared | None = None

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind}

    def save_state(self) -> Any:
        raise NotImplementedError

    def peek_state(self) -> Any:
        """The state :meth:`save_state` gives, taken for a look only (the state check after a
        load, ``prepare_staging``'s plan): the object must be left as it was."""
        return self.save_state()

    def load_target(self, saved: Mapping[str, Any]) -> Any:
        """What DCP should fill. ``saved`` is this entry's manifest description."""
        return self.save_state()

    def check(self, loaded: Any) -> None:
        """(each rank, before any entry is applied) Refuse ``loaded`` where :meth:`apply` would:
        checks that change nothing, run for every entry first, so that a refusal leaves every
        object as the read left it (no entry handed its state while a later one refuses)."""

    def apply(self, loaded: Any, state: MutableMapping[str, Any]) -> None:
        raise NotImplementedError

    def left_alone(self) -> None:
        """(each rank, instead of :meth:`apply`) The load read nothing of this entry
        (``strict=False``: missing from the checkpoint or mismatched throughout): undo what
        :meth:`load_target` changed, if anything; the object stays as it was."""


#: Per optimizer, the parameters (ids) whose only state is the zero-gradient step's that a load
#: target is made with (:func:`target_state_dict`): still without state of their own to a second
#: planning of the same load (the local
#: tier plans before the load, a load that falls back plans again) and to the load after a
#: failed one. An optimizer leaves it when a load hands it its values (or leaves it alone).
_TARGET_STATE: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()


@contextmanager
def targets_undone_on_failure() -> Iterator[None]:
    """(each rank, around a whole load) Where the load fails, the optimizers' parameters that
    had no state before it get none from it: a load that fails leaves them without (its
    zero-gradient target's state would otherwise stay, and make their next step differ from a
    fresh one's); nor do data loaders keep an iterator its planning started
    (:data:`_TARGET_ITERATORS`)."""
    before = {id(optim): set(made) for optim, made in _TARGET_STATE.items()}
    loaders_before = set(map(id, _TARGET_ITERATORS))
    try:
        yield
    except BaseException:
        for optim, made in list(_TARGET_STATE.items()):
            new = made - before.get(id(optim), set())
            drop_state(optim, new)
            made -= new
            if not made:
                del _TARGET_STATE[optim]
        for loader in list(_TARGET_ITERATORS):
            if id(loader) not in loaders_before:
                _drop_target_iterator(loader)
        raise


#: Data loaders whose iterator a load target started (torchdata's ``StatefulDataLoader``:
#: ``state_dict()`` on a loader without an iterator starts one, which its next ``iter()`` then
#: returns). Where the load hands the loader nothing (left alone, skipped, or a failed load),
#: that iterator is dropped: it was made with the sampler as it was before the load (its epoch's
#: order, its workers prefetching), and the loader's next epoch would replay it.
#: Each maps to the position the loader held for its next iterator (``next_iter_state``, set by
#: its ``load_state_dict``), which starting the iterator used up: given back with the drop.
_TARGET_ITERATORS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _loader(obj: Any) -> bool:
    """Whether ``obj`` keeps the iterator its ``state_dict()`` starts (torchdata's
    ``StatefulDataLoader``): only such objects are ever looked up in :data:`_TARGET_ITERATORS`
    (any other, unhashable ones included, never is)."""
    return hasattr(obj, "_initial_iter_for_state_dict")


def _starts_an_iterator(obj: Any) -> bool:
    """Whether ``state_dict()`` on ``obj`` would start an iterator the object keeps (a loader
    before its first ``iter()``)."""
    return _loader(obj) and getattr(obj, "_iterator", False) is None


def _sampler_objects(loader: Any) -> list[Any]:
    """The loader's sampler objects: its sampler, its batch sampler and the sampler inside that
    (each once)."""
    batch = getattr(loader, "batch_sampler", None)
    found: dict[int, Any] = {}
    for holder in (getattr(loader, "sampler", None), batch, getattr(batch, "sampler", None)):
        if holder is not None and holder is not loader:
            found[id(holder)] = holder
    return list(found.values())


def _generators(loader: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a loader's new iterator may draw from: its own and its
    samplers' (each once)."""
    found: dict[int, torch.Generator] = {}
    for holder in (loader, *_sampler_objects(loader)):
        try:
            g = getattr(holder, "generator", None)
        except Exception:  # a property that fails: nothing to restore there
            continue
        if isinstance(g, torch.Generator):
            found[id(g)] = g
    return list(found.values())


def _samplers(loader: Any) -> list[Any]:
    """The loader's sampler objects with attributes of their own (``__dict__``): what its
    iterator may change."""
    return [x for x in _sampler_objects(loader) if isinstance(getattr(x, "__dict__", None), dict)]


def _give_back(obj: Any, position: Any) -> None:
    """Drop the iterator ``obj``'s ``state_dict()`` started (if still unused), giving back the
    position it used up."""
    if getattr(obj, "_initial_iter_for_state_dict", False):
        obj._iterator = None  # (its workers, if any, stop as it is collected)
        obj._initial_iter_for_state_dict = False
        obj.next_iter_state = position


def _drop_target_iterator(obj: Any) -> None:
    """Undo the iterator a load target started on ``obj`` (if any, and still unused), giving
    back the position it used up."""
    if _loader(obj) and obj in _TARGET_ITERATORS:
        _give_back(obj, _TARGET_ITERATORS.pop(obj))


def target_of_fresh(optim: Any) -> bool:
    """(at load planning, before the load target is made) Whether ``optim`` holds no state of
    its own: none at all, or only a load target's (:data:`_TARGET_STATE`)."""
    made = _TARGET_STATE.get(optim, set())
    return all(id(p) in made for p, st in optim.state.items() if st)


def made_by_target(optim: Any, fqns: Mapping[int, str]) -> set[str]:
    """The fqns of ``optim``'s parameters whose only state is a load target's."""
    made = _TARGET_STATE.get(optim, set())
    return {fqns[id(p)] for p in optimizer_params(optim) if id(p) in made and id(p) in fqns}


def drop_state(optim: Any, ids: Set[int]) -> None:
    """Remove the state of ``optim``'s parameters whose ids are in ``ids``."""
    if ids:
        for p in optimizer_params(optim):
            if id(p) in ids:
                optim.state.pop(p, None)


def state_fqn(key: str) -> str:
    """The parameter fqn of an optimizer's flat state key ``state.<fqn>.<name>`` (relative)."""
    return key[len("state.") :].rsplit(".", 1)[0]


def unread_params(loaded: Mapping[str, Any], read: set[str] | None) -> set[str]:
    """The fqns of parameters with state in an optimizer's load target ``loaded`` (flat keys
    ``state.<fqn>.<name>``, relative) none of whose keys the load ``read`` (``None``: all read)."""
    if read is None:
        return set()
    return {state_fqn(k) for k in loaded if k.startswith("state.")} - {state_fqn(k) for k in read if k.startswith("state.")}


class ModuleEntry(Entry):
    kind = "module"
    scoped = False

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__(name)
        self.module = module
        self._raw_of: dict[str, str] | None = None  # FQN -> the module's key, from save_state
        self._extras: dict[str, Any] = {}  # extra states of the load target (load_target -> apply)

    def describe(self) -> dict[str, Any]:
        out = {"kind": self.kind, "parallel": parallel_kind(self.module)}
        layout = dtensor_layout(self.module)
        if layout is not None:
            out["layout"] = layout
        return out

    def save_state(self) -> dict[str, Any]:
        # get_model_state_dict's result, its key mapping cached per module structure.
        sd, self._raw_of = module_keys.state_dict(self.module)
        return sd

    def load_target(self, saved: Mapping[str, Any]) -> Any:
        target = self.save_state()
        # The modules' extra states as they keep them (get_extra_state), to give them back in
        # their own containers and keys: DCP's unflattening makes plain dicts with str keys.
        self._extras = {k: v for k, v in target.items() if k.rpartition(".")[2] == "_extra_state"}
        return target

    def apply(self, loaded: Any, state: MutableMapping[str, Any]) -> None:
        # DCP already copied into the live tensors; this also covers wrappers whose state_dict
        # tensors are not the parameters themselves, and runs the modules' load hooks.
        # Strictness was checked against metadata.
        extras, self._extras = self._extras, {}
        if extras and isinstance(loaded, MutableMapping):
            # ({0: seed, "cache": {}} came back to set_extra_state as {"0": seed}, silently)
            for key, like in extras.items():
                if key in loaded:
                    loaded[key] = containers.restore_containers(loaded[key], like)
        module_keys.load(self.module, loaded, self._raw_of)

    def settle(self) -> None:
        """Bring FSDP2 parameters back to their sharded form before reading or writing state.

        After an eval forward under ``no_grad`` (the root stays unsharded), ``unshard()`` or with
        ``reshard_after_forward=False``, ``module.parameters()`` yields unsharded plain
        Parameters while the optimizer holds the sharded DTensors: torch's optimizer state-dict
        helpers then fail, and a load would fill the sharded parameters while the forward kept
        using stale unsharded copies. ``FSDPModule.reshard()`` is local (no collective) and only
        frees the unsharded copies; the next forward all-gathers them again. (Do not save
        between a forward and its backward: that graph needs the unsharded copies.)
        """
        fsdp_module = _fsdp_module_class()
        if fsdp_module is None:
            return
        for m in self.module.modules():
            if isinstance(m, fsdp_module):
                m.reshard()

    def param_ids(self) -> set[int]:
        return {id(p) for p in self.module.parameters()}

    def param_fqns(self) -> dict[int, str]:
        """id(param) -> FQN as it appears in the saved state (wrapper prefixes stripped)."""
        out: dict[int, str] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            out.setdefault(id(p), clean_fqn(name))
        return out


def _fsdp_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return FSDPModule


def clean_fqn(name: str) -> str:
    """Strip DDP/DataParallel ``module.`` and ``torch.compile`` ``_orig_mod.`` wrapper parts."""
    parts = [p for p in name.split(".") if p not in ("_orig_mod",)]
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def optimizer_params(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optim.param_groups for p in g["params"]]


@contextmanager
def _step_hooks_off(optim: torch.optim.Optimizer) -> Iterator[None]:
    """Set aside ``optim``'s step hooks and the global ones (torch keeps them in ordered dicts),
    restored in their order after."""
    held: list[tuple[dict, dict]] = []
    for owner, attr in (
        (optim, "_optimizer_step_pre_hooks"),
        (optim, "_optimizer_step_post_hooks"),
        (_torch_optimizer, "_global_optimizer_pre_hooks"),
        (_torch_optimizer, "_global_optimizer_post_hooks"),
    ):
        hooks = getattr(owner, attr, None)
        if isinstance(hooks, dict) and hooks:
            held.append((hooks, dict(hooks)))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, items in held:
            hooks.clear()
            hooks.update(items)


def _zero_step(optim: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Give ``params`` (of ``optim``) state by a step with zero gradients and learning rate 0,
    as DCP makes the load target of an optimizer without state; the optimizer's other
    parameters get no gradient, so the step leaves their state alone. SparseAdam refuses dense
    gradients (DCP's step failed with a bare RuntimeError): it gets empty sparse ones."""
    every = optimizer_params(optim)
    grads = [p.grad for p in every]
    lrs = [(g, g["lr"]) for g in optim.param_groups if "lr" in g]
    sparse = isinstance(optim, torch.optim.SparseAdam)
    try:
        for p in every:
            p.grad = None
        for p in params:
            zero = torch.zeros_like(p)
            p.grad = zero.to_sparse() if sparse else zero
        for g, lr in lrs:
            g["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
        # The user's step hooks (an EMA update, a step counter) must not see a step the load
        # takes to make its target: set aside while it runs (also where a subclass's step
        # reaches a hooked super().step()); the class's step, not an LR scheduler's wrapper of it.
        with _step_hooks_off(optim):
            type(optim).step(optim)
    finally:
        for g, lr in lrs:
            g["lr"] = lr
        for p, g in zip(every, grads):
            p.grad = g


def target_state_dict(
    module: torch.nn.Module, optim: torch.optim.Optimizer, fqns: Mapping[int, str], held: Set[str] | None = None
) -> dict[str, Any]:
    """(each rank, at load planning) DCP's flat state dict of ``optim`` as a load target.

    Parameters without state get the state of a step with zero gradients
    (:func:`_zero_step`), recorded in :data:`_TARGET_STATE`: in an optimizer without state of
    its own, every parameter that takes gradients (as DCP's target); in any optimizer, those
    whose state the checkpoint holds (``held``, fqns; the load's selected keys) and that take
    gradients. An optimizer that had stepped but held no state for one parameter (frozen until
    now) refused that parameter's saved state as "unexpected", where torch's ``load_state_dict``
    takes it. A frozen parameter gets none: DCP's ``set_optimizer_state_dict`` skips it, so
    state read for it was dropped while the load reported it read (its saved state stays
    "unexpected", as it was).

    DCP makes the target of an optimizer without state by a step with zero gradients, but skips
    that step (a target with no state at all) where any parameter holds a gradient: a
    forward/backward before the resume. A strict load then named every saved moment
    "unexpected"; ``strict=False`` resumed with fresh moments; and at several ranks, one with
    gradients loaded none while the others did, reported clean. The gradients are set aside for
    the target's step and given back after it."""
    params = optimizer_params(optim)
    fresh = target_of_fresh(optim)
    need = [
        p for p in params
        if not optim.state.get(p) and p.requires_grad and (fresh or (held is not None and fqns.get(id(p)) in held))
    ]  # fmt: skip
    if need:
        try:
            _zero_step(optim, need)
        except TypeError as exc:  # (a step that needs a closure: LBFGS)
            raise TypeError(
                f"cannot load optimizer state into {type(optim).__name__}: its load target is made by a step with zero "
                f"gradients, which failed: {exc}"
            ) from exc
        made = {id(p) for p in need if optim.state.get(p)}
        if made:
            _TARGET_STATE.setdefault(optim, set()).update(made)
    if optim.state:
        return get_optimizer_state_dict(module, optim, options=_FLAT_OPTIM)
    grads = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        return get_optimizer_state_dict(module, optim, options=_FLAT_OPTIM)
    finally:
        for p, g in zip(params, grads):
            p.grad = g


def group_firsts(optim: torch.optim.Optimizer, fqns: Mapping[int, str]) -> list[str | None]:
    """The fqn of each parameter group's first parameter, in the optimizer's order (``None``
    for an empty group or one led by a parameter of no module in the state)."""
    return [fqns.get(id(g["params"][0])) if g["params"] else None for g in optim.param_groups]


def flat_param_groups(optim: torch.optim.Optimizer, fqns: Mapping[int, str]) -> dict[str, Any]:
    """``param_groups.<fqn>.<hyper-parameter>`` for every parameter, as DCP's flat format has it."""
    out: dict[str, Any] = {}
    for group in optim.param_groups:
        for p in group["params"]:
            for k, v in group.items():
                if k != "params":
                    out[f"param_groups.{fqns[id(p)]}.{k}"] = v
    return out


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot be compared are not the same
        return False


def check_param_groups(
    optim: torch.optim.Optimizer, fqns: Mapping[int, str], flat: dict[str, Any], name: str, read: Set[str] | None = None
) -> None:
    """(each rank, at load) Refuse loading hyper-parameters into groups whose parameters were
    saved with different ones: the groups changed since the save (a new weight-decay split), and
    each group takes its first parameter's values, so the others' would be replaced silently
    (DCP does the same). Only values read from the checkpoint count (``read``: the keys read, all
    of ``flat`` where ``None``): a parameter added since, or excluded, holds the optimizer's own
    value, and is given the value read for its group in ``flat`` (every parameter of a group
    then carries it, whichever a group takes its values from).

    Raises:
        StateMismatchError: naming the entry, the group, the hyper-parameter and two parameters'
            values (in ``.kinds``).
    """
    for index, group in enumerate(optim.param_groups):
        params = [fqns[id(p)] for p in group["params"] if id(p) in fqns]
        for k in group:
            if k == "params":
                continue
            first = None
            for fqn in params:
                key = f"param_groups.{fqn}.{k}"
                if key not in flat or (read is not None and key not in read):
                    continue
                if first is None:
                    first = (fqn, flat[key])
                elif not _same(first[1], flat[key]):
                    held = f"different {k} for parameters of group {index} ({shown(first[1])} for {first[0]}, {shown(flat[key])} for {fqn})"
                    given = (
                        "one group of them (the groups changed since the save: a load would give them all the first "
                        f"one's; build the optimizer with the saved groups, or keep the new values with exclude='{name}.param_groups.*')"
                    )
                    raise StateMismatchError([], [], {}, kinds={f"{name}.param_groups": (held, given)})
            if first is not None:
                for fqn in params:
                    if f"param_groups.{fqn}.{k}" in flat:
                        flat[f"param_groups.{fqn}.{k}"] = first[1]


def load_flat_param_groups(optim: torch.optim.Optimizer, fqns: Mapping[int, str], flat: Mapping[str, Any]) -> None:
    """Set each group's hyper-parameters from the flat form (the group's first parameter)."""
    for group in optim.param_groups:
        if not group["params"]:
            continue
        first = fqns[id(group["params"][0])]
        for k in list(group):
            key = f"param_groups.{first}.{k}"
            if k != "params" and key in flat:
                group[k] = flat[key]


class OptimizerEntry(Entry):
    """A regular optimizer (also over FSDP2 DTensor parameters)."""

    kind = "optimizer"
    scoped = False

    def __init__(self, name: str, optim: torch.optim.Optimizer, module: ModuleEntry) -> None:
        super().__init__(name)
        self.optim = optim
        self.module = module
        # Keys of the load target (``state.<fqn>.<name>``) of parameters the checkpoint holds no
        # state for, with the target's values (see :meth:`set_stateless`).
        self.stateless: dict[str, Any] = {}
        self.read: set[str] | None = None  # the keys (relative) the load reads; None: all
        # The fqns of parameters with no state of their own when the load began: their load
        # target is made by a step with zero gradients (step counts 1, moments 0), whose state
        # must not outlive the load for parameters the load gives nothing.
        self.made: set[str] = set()
        # The fqns of parameters the checkpoint holds state for (set by the load's planning
        # before :meth:`load_target`; None: unknown).
        self.held: set[str] | None = None

    def set_stateless(self, target: Mapping[str, Any], saved_keys: Iterable[str]) -> list[str]:
        """(each rank, at load planning) The keys of ``target`` (this entry's flat load target,
        keys relative to the entry) of parameters the saved optimizer held (the checkpoint has
        their ``param_groups.<fqn>.*``) but held no state for (no ``state.<fqn>.*`` among
        ``saved_keys``, the checkpoint's keys of this entry, relative too): parameters that never
        had a gradient (a layer the forward skipped). The load target of a fresh optimizer (DCP's,
        made by a step with zero gradients) holds state for every parameter, which a strict load
        reported missing: the checkpoint could not be resumed. They are neither read nor missing,
        and have no state after the load, as at the save. (A parameter the saved optimizer did
        not hold at all stays missing.) Returns the keys set aside."""

        def fqn(key: str, prefix: str) -> str:
            return key[len(prefix) :].rsplit(".", 1)[0]

        saved = list(saved_keys)
        held = {fqn(k, "state.") for k in saved if k.startswith("state.")}
        grouped = {fqn(k, "param_groups.") for k in saved if k.startswith("param_groups.")}
        self.stateless = {
            k: v for k, v in target.items() if k.startswith("state.") and fqn(k, "state.") in grouped - held
        }
        return list(self.stateless)

    @property
    def facing(self) -> torch.optim.Optimizer:
        """The optimizer the user holds (an LR scheduler's ``optimizer``): :attr:`optim` here."""
        return self.optim

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "module": self.module.name,
            "class": type(self.optim).__name__,
            "initialized": bool(self.optim.state),
            # Each group's first parameter, in order: an LR scheduler's per-group lists follow
            # the groups by position (a load judges its scheduler against them).
            "groups": group_firsts(self.facing, self.module.param_fqns()),
        }

    def save_state(self) -> dict[str, Any]:
        if not self.optim.state:
            # get_optimizer_state_dict would run a zero-grad step() to create state; saving must
            # never change the optimizer, so an optimizer that has not stepped saves its groups.
            return flat_param_groups(self.optim, self.module.param_fqns())
        try:
            return get_optimizer_state_dict(self.module.module, self.optim, options=_FLAT_OPTIM)
        except NotImplementedError as exc:
            # DCP flattens optimizer state of tensors, ints, floats and dicts only: LBFGS keeps
            # lists (its history); torch's error named no entry and no key.
            raise TypeError(f"state[{self.name!r}] cannot be saved: {_unflattenable(self.optim)}; {exc}") from None

    def load_target(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        fqns = self.module.param_fqns()
        if not saved.get("initialized", True):
            self.made = made_by_target(self.optim, fqns)
            return flat_param_groups(self.optim, fqns)
        target = target_state_dict(self.module.module, self.optim, fqns, self.held)
        self.made = made_by_target(self.optim, fqns)
        return target

    def drop_named(self, optim: torch.optim.Optimizer, names: Set[str]) -> None:
        """Remove the state of ``optim``'s parameters whose fqns are in ``names``."""
        if names:
            fqns = self.module.param_fqns()
            drop_state(optim, {id(p) for p in optimizer_params(optim) if fqns.get(id(p)) in names})

    def left_alone(self) -> None:
        self.drop_named(self.optim, self.made)  # (the zero-gradient step's state of the load target)
        _TARGET_STATE.pop(self.optim, None)

    def check(self, loaded: Any) -> None:
        check_param_groups(self.optim, self.module.param_fqns(), loaded, self.name, self.read)

    def apply(self, loaded: Any, state: MutableMapping[str, Any]) -> None:
        self.check(loaded)
        _TARGET_STATE.pop(self.optim, None)  # (what it holds from here on is the checkpoint's)
        if any(k.startswith("state.") for k in loaded):
            # DCP's set_optimizer_state_dict wants state for every parameter that has some: the
            # target's for those the checkpoint holds none for, removed right after; so is that of
            # parameters the load read nothing for (strict=False: added since the save), where
            # the target's is the zero-gradient step's.
            set_optimizer_state_dict(self.module.module, self.optim, {**loaded, **self.stateless}, options=_FLAT_OPTIM)
            without = {state_fqn(k) for k in self.stateless}
            self.drop_named(self.optim, without | (unread_params(loaded, self.read) & self.made))
        else:
            self.optim.state.clear()
            load_flat_param_groups(self.optim, self.module.param_fqns(), loaded)


class StatefulEntry(Entry):
    """Anything with ``state_dict()`` and ``load_state_dict()``: schedulers, GradScaler, samplers."""

    kind = "stateful"

    def __init__(self, name: str, obj: Stateful) -> None:
        super().__init__(name)
        self.obj = obj
        self._like: dict[str, Any] | None = None  # the object's own state at load: its containers and keys

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "class": type(self.obj).__name__}

    def save_state(self) -> dict[str, Any]:
        sd = self.obj.state_dict()
        if not isinstance(sd, Mapping):
            raise TypeError(f"state[{self.name!r}].state_dict() returned {type(sd).__name__}, not a dict")
        return dict(sd)

    def peek_state(self) -> dict[str, Any]:
        # A loader without an iterator (right after its load_state_dict, or a fresh one) starts
        # one to give its state, built with its sampler as it is now, and its next iter()
        # returns that one: the state check after a load, or prepare_staging, made the user's
        # set_epoch() come too late (the resumed epoch ran the previous epoch's order). It is
        # dropped and what starting it used up given back: the position the next iterator
        # starts from, the generators it drew from (a shuffle's permutation, its base seed; the
        # user's iter() draws them) and its samplers' attributes (a GlobalBatchSampler's batches
        # its workers fetched ahead, a StatefulDistributedSampler's position).
        if not _starts_an_iterator(self.obj):
            return self.save_state()
        position = getattr(self.obj, "next_iter_state", None)
        generators = _generators(self.obj)
        states = [g.get_state() for g in generators]
        samplers = [(x, dict(vars(x))) for x in _samplers(self.obj)]
        try:
            with torch.random.fork_rng(devices=[]):
                return self.save_state()
        finally:  # (also where state_dict() failed half-way)
            _give_back(self.obj, position)
            for g, st in zip(generators, states):
                g.set_state(st)
            for x, fields in samplers:  # (not their load_state_dict: not every one inverts state_dict)
                vars(x).clear()
                vars(x).update(fields)

    def load_target(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        starts = _starts_an_iterator(self.obj)
        position = getattr(self.obj, "next_iter_state", None)  # (what the iterator will use up)
        self._like = self.save_state()
        if starts and getattr(self.obj, "_initial_iter_for_state_dict", False):
            _TARGET_ITERATORS[self.obj] = position
        return self._like

    def left_alone(self) -> None:
        _drop_target_iterator(self.obj)

    def apply(self, loaded: Any, state: MutableMapping[str, Any]) -> None:
        if not loaded and not self.obj.state_dict():
            _drop_target_iterator(self.obj)
            return  # e.g. a disabled GradScaler: nothing saved, nothing to restore
        if self._like is not None:  # DCP's unflattening gives plain dicts with str keys
            loaded = containers.restore_containers(loaded, self._like)
        if _loader(self.obj):
            _TARGET_ITERATORS.pop(self.obj, None)  # (its load_state_dict replaces any iterator)
        self.obj.load_state_dict(loaded)


class TensorEntry(Entry):
    """A tensor (or DTensor): loaded in place."""

    kind = "tensor"

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        super().__init__(name)
        self.tensor = tensor

    def save_state(self) -> torch.Tensor:
        return self.tensor

    def apply(self, loaded: Any, state: MutableMapping[str, Any]) -> None:
        if loaded is not self.tensor:
            self.tensor.copy_(loaded)


class TreeEntry(Entry):
    """A dict/list mixing tensors with plain values; tensors load in place, values are replaced."""

    kind = "tree"

    def __init__(self, name: str, tree: Any) -> None:
        super().__init__(name)
        self.tree = tree

    def save_state(self) -> Any:
        return self.tree

    def apply(self, loaded: Any, state: MutableMapping[str, Any]) -> None:
        if isinstance(self.tree, tuple):
            # Immutable, and a terminal item to DCP (stored whole, its tensors with it): the
            # entry is replaced by the loaded value, its tensors copied into the live ones where
            # they fit (a tuple was left untouched before, silently: nothing to merge into).
            value = _merged_tuple(self.tree, loaded)
            if self.holder is not None:
                self.holder.obj = value
            else:
                state[self.name] = value
            return
        _merge_into(self.tree, loaded)


def _merged_tuple(live: Any, loaded: Any) -> Any:
    """``loaded`` for a live tuple: tensors into the live tensors of the same shape and dtype (in
    place, on the live one's device, where they can be written: not an inference tensor, not one
    whose elements share memory such as an ``expand``), others moved to the live one's device
    (they are read onto the host), tuples rebuilt with the live tuple's type (named ones too),
    except a tuple of plain values saved as the live one's type (a ``torch.Size`` too): as
    loaded; anything else as loaded."""
    if isinstance(live, torch.Tensor) and isinstance(loaded, torch.Tensor):
        if live.shape == loaded.shape and live.dtype == loaded.dtype and _writable(live):
            with torch.no_grad():
                live.copy_(loaded)
            return live
        return loaded if live.is_meta else loaded.to(live.device)
    if isinstance(live, tuple) and not _holds_tensor(live) and (type(loaded) is type(live) or isinstance(loaded, torch.Size)):
        return loaded  # kept as saved (torch.Size is a tuple: rebuilt below, it lost its type)
    if isinstance(live, tuple) and isinstance(loaded, (tuple, list)) and len(live) == len(loaded):
        items = [_merged_tuple(a, b) for a, b in zip(live, loaded)]
        return type(live)(*items) if hasattr(live, "_fields") else tuple(items)
    return loaded


def _writable(tensor: torch.Tensor) -> bool:
    """Whether ``copy_`` into ``tensor`` works: not on the meta device, not an inference tensor
    outside inference mode, no two elements in one place (an ``expand``ed tensor)."""
    if tensor.is_meta or (tensor.is_inference() and not torch.is_inference_mode_enabled()):
        return False
    if tensor.layout != torch.strided:
        return True  # (sparse, nested: no strides to overlap; copy_ as before)
    overlap = getattr(torch, "_debug_has_internal_overlap", None)  # (private: absent, assume none)
    try:
        return overlap is None or overlap(tensor) != 1  # 1: overlapping for sure
    except RuntimeError:
        return True  # cannot tell: copy_ as before


def _holds_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor or a tuple, list or dict holding one (at any depth)."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    return False


def _merged_items(live: list, loaded: list) -> list:
    """The items of a list stored whole: ``loaded``'s, with tensors (also inside tuples) into
    the live ones where the lists match item for item (:func:`_merged_tuple`)."""
    if len(live) != len(loaded):
        return list(loaded)
    return [_merged_tuple(a, b) for a, b in zip(live, loaded)]


def _walked(live: Any) -> bool:
    """Whether what is loaded for ``live`` is merged into it (a dict, or a list DCP walked into)
    rather than replacing it. (DCP stores nothing for an empty dict: its place in a list comes
    back as ``None``, and the live ``{}`` stays.)"""
    return isinstance(live, MutableMapping) or (isinstance(live, list) and not containers.dcp_leaf(live))


def _merge_into(live: Any, loaded: Any) -> None:
    """Tensors of ``loaded`` are the live ones (filled in place); every other value replaces the
    live one. A list DCP stores whole (:func:`~distckpt.state.containers.dcp_leaf`) replaces the
    live list's items (a loss history in a fresh state is ``[]``: it was merged item by item,
    cut to the live length, and stayed ``[]``)."""
    if isinstance(live, MutableMapping) and isinstance(loaded, Mapping):
        for k, v in loaded.items():
            key = k
            if k not in live:  # DCP's flattening turns keys into strings
                key = next((lk for lk in live if str(lk) == k), k)
            if key in live and _walked(live[key]) and not isinstance(v, torch.Tensor):
                _merge_into(live[key], v)
            elif key in live and isinstance(live[key], list) and isinstance(v, list):
                live[key][:] = _merged_items(live[key], v)  # in place: the caller may hold the list
            elif key in live and isinstance(live[key], tuple):
                # Stored whole: its tensors into the live ones (in place, on their device), as a
                # tuple entry's; they were replaced by host copies, the live ones left as they were.
                live[key] = _merged_tuple(live[key], v)
            elif not isinstance(live.get(key), torch.Tensor):
                live[key] = v
    elif isinstance(live, list) and isinstance(loaded, list):
        if containers.dcp_leaf(live):
            live[:] = _merged_items(live, loaded)
            return
        for i, v in enumerate(loaded[: len(live)]):
            if _walked(live[i]):
                _merge_into(live[i], v)
            elif isinstance(live[i], list) and isinstance(v, list):
                live[i][:] = _merged_items(live[i], v)
            elif isinstance(live[i], tuple):
                live[i] = _merged_tuple(live[i], v)
            elif not isinstance(live[i], torch.Tensor):
                live[i] = v


def _unflattenable(optim: torch.optim.Optimizer) -> str:
    """Which state values of ``optim`` DCP's flat optimizer form cannot hold (for the error)."""
    bad = sorted({
        f"{k!r} ({type(v).__name__})"
        for state in optim.state.values() if isinstance(state, Mapping)
        for k, v in state.items() if not isinstance(v, (torch.Tensor, int, float, dict))
    })  # fmt: skip
    where = f"its state holds {', '.join(bad[:5])}" if bad else "its state holds values DCP cannot flatten"
    return f"{type(optim).__name__}: {where}, which torch.distributed.checkpoint's optimizer state cannot hold"


class ValueEntry(Entry):
    """A value without tensors; replaced in ``state`` on load (dicts/lists in place).

    A plain value (exactly int, float, str, bool, None, and lists/tuples/dicts of them) is stored
    as JSON text; any other (a NumPy scalar, a datetime, an Enum ...) as one item in the encoded
    form of :mod:`distckpt.state.encoded` (:class:`~distckpt.state.encoded.TopLevel`; the save
    encodes it or refuses it, naming the key). Either form loads into either: the form is chosen
    per save, by the value.
    """

    kind = "value"

    def __init__(self, name: str, value: Any) -> None:
        super().__init__(name)
        self.value = value

    @property
    def plain(self) -> bool:
        """Whether the value as it is now is stored as JSON text. Judged at each use, not once:
        a load fills a dict in place (``{"epoch": 0}`` takes the saved ``np.int64(3)``), and the
        state check after it re-extracts the value (the JSON encoder refused the NumPy value,
        failing every resume of such a dict as a "cannot be saved")."""
        return values.stores_as_json(self.value)

    def save_state(self) -> str | encoded.TopLevel:
        return values.encode(self.value, self.name) if self.plain else encoded.TopLevel(self.value)

    def describe(self) -> dict[str, Any]:
        # Checked on load and export (values.check_digest): values have no tensor fingerprint.
        # Encoded values are covered by the manifest's value_digests, as every non-tensor item.
        return {"kind": self.kind, "sha256": values.digest(self.save_state())} if self.plain else {"kind": self.kind}

    def apply(self, loaded: Any, state: MutableMapping[str, Any]) -> None:
        # An encoded value arrives decoded by the load planner (which holds the allow-list).
        value = loaded.value if isinstance(loaded, encoded.TopLevel) else values.decode(loaded, self.name)
        live = self.value
        if isinstance(live, dict) and isinstance(value, dict):
            live.clear()
            live.update(value)
        elif isinstance(live, list) and isinstance(value, list):
            live[:] = value
        elif self.holder is not None:
            self.holder.obj = value  # a PerRank/Global wrapper stays in state
            self.value = value
        else:
            state[self.name] = value
            self.value = value


def contains(value: object, kind: type = torch.Tensor) -> bool:
    """Whether ``value`` (nested dicts/lists/tuples) holds an instance of ``kind`` anywhere,
    within :data:`~distckpt.state.containers.LOAD_DEPTH` levels: deeper nesting (or a container
    holding itself) adds nothing, and the save's encoding then refuses it naming the key, where
    this walk died of a bare ``RecursionError``. A container met again is walked again only where
    it is met shallower than before (more levels left to search): a dict holding itself twice, or
    a list holding one list twice 250 times, made the walk exponential."""
    return _contains(value, kind, {}, 0)


def _contains(value: object, kind: type, walked: dict[int, tuple[int, object]], depth: int) -> bool:
    """:func:`contains`; ``walked``: id -> (the shallowest depth it was walked at, the container,
    held so that its id stays its own). A container walked at this depth or shallower found
    nothing there (else the walk had ended), and finds no more now (no more levels left); one on
    the walk's own path (a cycle) is such a container too."""
    if isinstance(value, kind):
        return True
    if not isinstance(value, (Mapping, list, tuple)) or depth > containers.LOAD_DEPTH:
        return False
    before = walked.get(id(value))
    if before is not None and before[0] <= depth:
        return False
    walked[id(value)] = (depth, value)
    items = value.values() if isinstance(value, Mapping) else value
    return any(_contains(v, kind, walked, depth + 1) for v in items)


def same_tensor(local: torch.Tensor) -> tuple:
    """What makes two (local) tensors the very same one, under two keys a tie: equal for
    exactly those. The address of the first element (not the storage's and an offset: two
    storages over the same bytes, numpy arrays' from_numpy() views, are one tensor too), the
    dtype (views of one storage as float32 and float64 at the same element offset and shape are
    other bytes: taken for one tensor, a strict load skipped the second key as filled by its
    "tie", and an export left it out), the shape and the strides."""
    # An empty shard (FSDP2 leaves the last ranks of a short dimension none) has no data
    # pointer to tell tensors apart by (every empty one's is 0), but its storage object is one
    # per tensor, shared by the keys of a tied one: skipping empties made a rank with an empty
    # shard miss the tie the others saw (false "missing key" / "ranks disagree").
    where = local.data_ptr() if local.numel() else ("empty", local.untyped_storage()._cdata, local.storage_offset())
    return (where, local.dtype, tuple(local.shape), tuple(local.stride()))


def tied_duplicates(tensors: Mapping[str, object]) -> dict[str, str]:
    """Key -> the earlier key whose value is the very same tensor (tied weights, e.g. a language
    model's ``lm_head.weight`` and its input embeddings); DTensors compared by local shard."""
    from torch.distributed.tensor import DTensor

    first: dict[tuple, str] = {}
    out: dict[str, str] = {}
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        if local.device.type == "meta":
            continue
        sid = same_tensor(local)
        if sid in first:
            out[key] = first[sid]
        else:
            first[sid] = key
    return out
