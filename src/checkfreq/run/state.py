"""Registered objects ⇄ ``{flat_name: tensor}`` plus a JSON skeleton, with validation on load.

Encoding of the skeleton (plain JSON):
- str/int/float/bool/None as themselves; dicts with string keys as objects;
- a tensor as ``{"__tensor__": name}``;
- a tuple as ``{"__tuple__": [...]}``; a dict with other keys (e.g. optimizer state's ints)
  as ``{"__items__": [[key, value], ...]}``; a NumPy array as ``{"__ndarray__": name}``;
- anything else only with ``allow_pickle=True``: ``{"__pickle__": base64}``.
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from checkfreq.errors import CorruptCheckpointError, StateMismatchError, UnserializableStateError, UsageError
from checkfreq.run import scaler_state
from checkfreq.run.names import held_instead
from checkfreq.run.tensors import storage_ptr
from checkfreq.storage.format import MAX_JSON_DEPTH

_MARKERS = ("__tensor__", "__tuple__", "__items__", "__ndarray__", "__pickle__")
MAX_STATE_DEPTH = MAX_JSON_DEPTH // 2
"""How many containers a value of a skeleton may lie in: written and read with the same bound, in
levels of the skeleton (a tuple takes two, a dict with other than string keys three), well under the JSON depth a
reader parses (the manifest and the rank records wrap the skeleton in a few levels of their own).
Checked by depth, not left to :class:`RecursionError`, which depends on the interpreter's
recursion limit and on the stack already in use."""


@runtime_checkable
class Stateful(Protocol):
    """Anything that can be registered with the Checkpointer."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class _Flattener:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.tensors: dict[str, torch.Tensor] = {}

    def name(self, path: str) -> str:
        name, n = path, 1
        while name in self.tensors:
            name, n = f"{path}#{n}", n + 1
        return name

    def encode(self, value: Any, path: str, depth: int = 0) -> Any:
        if depth > MAX_STATE_DEPTH:
            raise UnserializableStateError(
                f"{path!r} nests containers more than {MAX_STATE_DEPTH} levels deep, deeper than checkfreq stores"
            )
        if isinstance(value, torch.Tensor):  # first: most of a state is tensors
            name = self.name(path)
            plain = type(value) is torch.Tensor and not value.requires_grad  # a state dict's, as a rule
            self.tensors[name] = value if plain else value.detach()
            return {"__tensor__": name}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, np.ndarray):
            name = self.name(path)
            self.tensors[name] = torch.from_numpy(np.ascontiguousarray(value))
            return {"__ndarray__": name}
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return {"__tuple__": [self.encode(v, f"{path}/{i}", depth + 2) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, f"{path}/{i}", depth + 1) for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) and k not in _MARKERS for k in value):
                return {k: self.encode(v, f"{path}/{k}", depth + 1) for k, v in value.items()}
            if all(k is None or isinstance(k, (bool, int, float, str)) for k in value):
                return {"__items__": [[k, self.encode(v, f"{path}/{k}", depth + 3)] for k, v in value.items()]}
        if self.allow_pickle:
            return {"__pickle__": base64.b64encode(pickle.dumps(value)).decode()}
        raise UnserializableStateError(
            f"{path!r} is {with_article(type(value).__qualname__)}, which checkfreq stores only by pickling; "
            "store it as plain values/tensors, or pass allow_pickle=True if you trust every reader"
        )


def with_article(noun: str) -> str:
    """``noun`` after "a" or "an", by its first letter: "an object", "a Tensor"."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def flatten(state: Mapping[str, Any], *, allow_pickle: bool = False) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Split ``{registered_name: state}`` into a JSON skeleton and named tensors."""
    flattener = _Flattener(allow_pickle)
    skeleton = {name: flattener.encode(value, name, 1) for name, value in state.items()}
    return skeleton, flattener.tensors


def unflatten(skeleton: Any, tensors: Mapping[str, torch.Tensor], *, allow_pickle: bool = False) -> Any:
    """Rebuild the state from a skeleton and the tensors it references."""

    def decode(node: Any, depth: int) -> Any:
        if depth > MAX_STATE_DEPTH:
            raise ValueError(f"containers nest more than {MAX_STATE_DEPTH} levels deep")
        if isinstance(node, list):
            return [decode(v, depth + 1) for v in node]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            ((marker, payload),) = node.items()
            if marker == "__tensor__":
                return _lookup(tensors, payload)
            if marker == "__ndarray__":
                return _lookup(tensors, payload).numpy()
            if marker == "__tuple__":
                return tuple(decode(v, depth + 2) for v in payload)
            if marker == "__items__":
                return {_key(k): decode(v, depth + 3) for k, v in payload}
            if marker == "__pickle__":
                if not allow_pickle:
                    raise UnserializableStateError(
                        "this checkpoint holds pickled values; "
                        "restore with allow_pickle=True only if you trust its source"
                    )
                return pickle.loads(base64.b64decode(payload))  # opt-in: README "On disk" and docs/reliability.md
        return {k: decode(v, depth + 1) for k, v in node.items()}

    try:
        return decode(skeleton, 0)
    except (TypeError, ValueError, RecursionError) as e:  # a hand-edited or hostile skeleton
        raise CorruptCheckpointError(f"checkpoint skeleton is malformed: {type(e).__name__}: {e}") from None


def _lookup(tensors: Mapping[str, torch.Tensor], name: Any) -> torch.Tensor:
    if not isinstance(name, str) or name not in tensors:
        raise StateMismatchError(f"checkpoint skeleton refers to tensor {name!r}, which is not in its index")
    return tensors[name]


def _key(key: Any) -> Any:
    if isinstance(key, list):
        raise StateMismatchError("checkpoint skeleton has an unhashable dictionary key")
    return key


def check_module_state(name: str, module: torch.nn.Module, state: Mapping[str, Any]) -> None:
    """Raise one error listing every missing/unexpected key and shape/dtype mismatch for ``module``."""
    if not isinstance(state, Mapping):
        raise StateMismatchError(
            f"checkpoint does not fit {name!r}: its state is {with_article(type(state).__name__)}, not a dict"
        )
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    problems = []
    hint = _prefix_hint(missing, unexpected)
    if hint:
        problems.append(hint)
    if missing:
        problems.append(f"missing keys: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {', '.join(unexpected)}")
    for key in sorted(set(expected) & set(state)):
        want, got = expected[key], state[key]
        if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor):
            if want.shape != got.shape:
                problems.append(f"{key}: shape {tuple(got.shape)} in checkpoint, {tuple(want.shape)} in model")
            elif want.dtype != got.dtype:
                problems.append(f"{key}: dtype {got.dtype} in checkpoint, {want.dtype} in model")
    if problems:
        raise StateMismatchError(f"checkpoint does not fit {name!r}: " + "; ".join(problems))


def _prefix_hint(missing: list[str], unexpected: list[str]) -> str | None:
    """What to do when the model's keys and the checkpoint's differ only by a prefix (a wrapper's)."""
    if not missing or len(missing) != len(unexpected):
        return None
    wrappers = "DistributedDataParallel and DataParallel add 'module.', torch.compile '_orig_mod.'"
    prefix = _shared_prefix(unexpected, missing)
    if prefix is not None:  # the checkpoint's keys carry a prefix the model's lack
        return (
            f"every key differs only by the prefix {prefix!r}, which the checkpoint's keys carry: it was saved "
            f"from a wrapped model ({wrappers}); register the model wrapped the same way to restore it, and "
            "register the unwrapped module (model.module, model._orig_mod) in every run so the wrapping does not matter"
        )
    prefix = _shared_prefix(missing, unexpected)
    if prefix is not None:  # the model's keys carry a prefix the checkpoint's lack
        return (
            f"every key differs only by the prefix {prefix!r}, which this model's keys carry: the model is "
            f"wrapped ({wrappers}) and the checkpoint was saved from the unwrapped module; register the "
            "unwrapped module (model.module, model._orig_mod)"
        )
    return None


def _shared_prefix(prefixed: list[str], bare: list[str]) -> str | None:
    """The prefix ending in "." that turns the keys ``bare`` into exactly the keys ``prefixed``, if any."""
    for key in prefixed:
        prefix = key[: -len(bare[0])] if key.endswith(bare[0]) else ""
        if prefix.endswith(".") and {prefix + k for k in bare} == set(prefixed):
            return prefix
    return None


def type_name(obj: object) -> str:
    """``module.QualifiedName`` of ``obj``'s class, as recorded in a checkpoint."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def check_optimizer_state(
    name: str, optimizer: torch.optim.Optimizer, state: Mapping[str, Any], saved_type: str | None = None
) -> None:
    """Check that ``state`` was written by an optimizer of the same class (``saved_type``, when the
    checkpoint records it: another class's group options and state would fail at its first step),
    with the same parameter groups, and that per-parameter tensors match their parameters' shapes."""
    if saved_type is not None and saved_type != type_name(optimizer):
        raise StateMismatchError(
            f"checkpoint does not fit {name!r}: it was written by a {saved_type}, "
            f"this optimizer is a {type_name(optimizer)}"
        )
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        raise StateMismatchError(
            f"checkpoint does not fit {name!r}: {len(groups) if isinstance(groups, list) else 'no'} "
            f"parameter groups in checkpoint, {len(optimizer.param_groups)} in optimizer"
        )
    params: dict[Any, torch.Tensor] = {}
    for i, (saved, live) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        ids = saved.get("params", []) if isinstance(saved, Mapping) else []
        if len(ids) != len(live["params"]):
            raise StateMismatchError(
                f"checkpoint does not fit {name!r}: group {i} has {len(ids)} parameters in checkpoint, "
                f"{len(live['params'])} in optimizer"
            )
        params.update(zip(ids, live["params"], strict=True))
    problems = []
    for pid, entry in (state.get("state") or {}).items():
        param = params.get(pid)
        if param is None or not isinstance(entry, Mapping):
            problems.append(f"state for unknown parameter {pid!r}")
            continue
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                problems.append(f"parameter {pid} {key}: shape {tuple(value.shape)}, parameter is {tuple(param.shape)}")
    if problems:
        raise StateMismatchError(f"checkpoint does not fit {name!r}: " + "; ".join(problems))


def own_storage(tree: Any) -> Any:
    """Clone the tensors of a restored state: they are views into a mapped or read data section,
    which objects that keep their state's tensors (optimizers, generators) must neither alias nor pin."""
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, np.ndarray):
        return tree.copy()
    if isinstance(tree, dict):
        return {k: own_storage(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(own_storage(v) for v in tree)
    return tree


def _into_live(saved: Any, live: Any, device: torch.device | None = None) -> Any:
    """``saved`` with each tensor copied into the live tensor at the same place of ``live`` (same
    type, dtype and shape), so a restored optimizer keeps its memory; other tensors are cloned, or,
    with a ``device`` that is not the CPU (the parameter's), copied straight there: a fresh
    optimizer's state then never passes through a pageable host copy of its own."""
    if isinstance(saved, torch.Tensor):
        fits = (
            type(saved) is torch.Tensor
            and type(live) is torch.Tensor
            and live.dtype == saved.dtype
            and live.shape == saved.shape
        )
        if not fits:
            if device is not None and device.type != "cpu" and type(saved) is torch.Tensor:
                return saved.to(device)  # from a pinned memory slot at the pinned bandwidth
            return saved.clone()
        with torch.no_grad():
            live.copy_(saved)
        return live
    if isinstance(saved, dict):
        live = live if isinstance(live, dict) else {}
        return {k: _into_live(v, live.get(k)) for k, v in saved.items()}
    if isinstance(saved, (list, tuple)):
        live = live if isinstance(live, (list, tuple)) and len(live) == len(saved) else [None] * len(saved)
        return type(saved)(_into_live(v, w) for v, w in zip(saved, live, strict=True))
    return saved


def _into_optimizer(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> Any:
    """An optimizer's saved state, its tensors in the live ones, else on their parameter's device (the
    ``step`` counters excepted: ``load_state_dict`` decides where those go)."""
    live = optimizer.state_dict()
    devices: dict[Any, torch.device] = {}
    for group, saved_group in zip(optimizer.param_groups, state.get("param_groups") or [], strict=False):
        ids = saved_group.get("params", []) if isinstance(saved_group, Mapping) else []
        devices.update((pid, param.device) for pid, param in zip(ids, group["params"], strict=False))
    own = _into_live({k: v for k, v in state.items() if k != "state"}, live)
    live_state = live.get("state") or {}
    own["state"] = {
        pid: {
            key: _into_live(value, (live_state.get(pid) or {}).get(key), None if key == "step" else devices.get(pid))
            for key, value in entry.items()
        }
        if isinstance(entry, Mapping)
        else _into_live(entry, None)
        for pid, entry in (state.get("state") or {}).items()
    }
    return own


def check_fits(name: str, obj: Any, state: Any, saved_type: str | None = None) -> None:
    """Raise :class:`StateMismatchError` if ``state`` cannot be loaded into a module or optimizer ``obj``
    (an optimizer's class is compared with ``saved_type`` when the checkpoint recorded it).

    Other objects are checked by their own ``load_state_dict``.
    """
    if isinstance(obj, torch.nn.Module):
        check_module_state(name, obj, state)
    elif isinstance(obj, torch.optim.Optimizer):
        check_optimizer_state(name, obj, state, saved_type)


def load_into(name: str, obj: Any, state: Any) -> None:
    """Validate ``state`` against ``obj`` and load it, raising :class:`StateMismatchError` on a mismatch.

    A module copies the values into its tensors; an optimizer's existing state tensors take the
    values in place; every other object gets tensors of its own.
    """
    check_fits(name, obj, state)
    if isinstance(obj, torch.nn.Module):
        obj.load_state_dict(state, strict=True)
        return
    if isinstance(obj, torch.amp.GradScaler):  # its scale and growth tracker may be saved as tensors
        state = scaler_state.loadable(state)
    own = _into_optimizer(obj, state) if isinstance(obj, torch.optim.Optimizer) else own_storage(state)
    try:
        obj.load_state_dict(own)
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise StateMismatchError(f"checkpoint does not fit {name!r}: {e}") from e


def apply_state(
    objects: Mapping[str, Any],
    values: dict[str, Any],
    state: Mapping[str, Any],
    source: str = "the checkpoint",
    path: str = "CHECKPOINT",
) -> None:
    """Load a checkpoint's ``state`` into the registered ``objects`` and ``values``, all or nothing:
    every module and optimizer is checked against it first, and one :class:`StateMismatchError` lists
    every difference of every object, names the checkpoint (``source``: which one, where; ``path``:
    what ``checkfreq export`` takes) and says what to do. The RNG state (``objects["rng"]``) is
    loaded last, so nothing that runs here draws random numbers after it."""
    check_materialized(objects, source)
    missing = sorted(set(objects) - set(state) - {"rng"})
    problems = [f"checkpoint holds no state for {', '.join(missing)}"] if missing else []
    for name in missing:
        held = held_instead(name, set(state) - set(objects))
        if held is not None:
            problems.append(
                f"it holds state under {held!r}, within one letter of {name!r}: the run that wrote it registered that "
                f"object as {held}=; register it as {held}= here to resume from these checkpoints"
            )
    saved_types = (state.get("checkfreq") or {}).get("optimizer_types") or {}
    for name, obj in objects.items():
        if name in state:
            try:
                check_fits(name, obj, state[name], saved_types.get(name))
            except StateMismatchError as e:
                problems.append(str(e))
    if problems:
        raise StateMismatchError(misfit_message(source, path, problems))
    for name, obj in objects.items():
        if name != "rng":
            try:
                load_into(name, obj, state[name])
            except StateMismatchError as e:
                raise StateMismatchError(misfit_message(source, path, [str(e)])) from e
    for name in values:
        if name in state:
            values[name] = own_storage(state[name])
    if "rng" in objects and "rng" in state:
        objects["rng"].load_state_dict(state["rng"])


def check_materialized(objects: Mapping[str, Any], source: str = "the checkpoint") -> None:
    """Raise :class:`UsageError` if a registered module or optimizer holds tensors on the meta
    device: a restore copies into the live tensors, and a copy into a meta tensor does nothing."""
    on_meta = []
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            on_meta += [f"{name}/{k}" for k, t in obj.state_dict().items() if isinstance(t, torch.Tensor) and t.is_meta]
        elif isinstance(obj, torch.optim.Optimizer):
            params = [p for group in obj.param_groups for p in group["params"]]
            on_meta += [f"{name}'s parameter {i}" for i, p in enumerate(params) if p.is_meta]
    if on_meta:
        shown = ", ".join(on_meta[:4]) + (f" and {len(on_meta) - 4} more" if len(on_meta) > 4 else "")
        raise UsageError(
            f"{source} cannot be restored into tensors on the meta device ({shown}): restore() copies the saved "
            "values into the registered objects' own tensors, and a copy into a meta tensor does nothing. "
            "Materialize the model first (model.to_empty(device=...)), build the optimizer over its parameters, "
            "then call restore(); initialise the parameters (reset_parameters()) only when restore() returns 0."
        )


def unclaimed(
    state: Mapping[str, Any], objects: Mapping[str, Any], values: Mapping[str, Any], reserved: frozenset[str]
) -> list[str]:
    """The names a checkpoint's ``state`` holds that no registered object or value takes (its
    reserved entries aside): :func:`apply_state` leaves them where they are, unrestored."""
    return sorted(set(state) - set(objects) - set(values) - reserved)


def unclaimed_message(source: str, names: list[str]) -> str:
    """Why the state under ``names`` was not restored, and how to get it back."""
    listed = ", ".join(repr(n) for n in names)
    return (
        f"{source} holds state for {listed}, which nothing registered takes: not restored. A plain value "
        f"comes back only if it is registered before restore() (values={{{names[0]!r}: default}} or "
        f"ckpt[{names[0]!r}] = default, then restore()); an object, if it is registered under the same name"
    )


def misfit_message(source: str, path: str, problems: list[str]) -> str:
    """Which checkpoint did not fit, every difference, and the ways on."""
    return "\n- ".join([f"{source} does not fit the registered objects:", *problems]) + (
        "\nTo resume from it, register the objects as the run that wrote it did (the same names, model, "
        "optimizer class and parameter groups). A run whose model or optimizer changed on purpose is a new "
        "run: give it a directory of its own. To carry over the weights that still fit, export them "
        f"(checkfreq export {path} --to model.pt --only model) and, before training, load the entries whose "
        "names and shapes match into the new model (model.load_state_dict(those, strict=False))."
    )


def optimizer_owned(tensors: Mapping[str, torch.Tensor], optimizers: Mapping[str, torch.optim.Optimizer]) -> set[str]:
    """Names of ``tensors`` only a registered optimizer's step changes (its parameters and
    state): safe to copy behind the optimizer-step fence."""
    if not optimizers:
        return set()
    return _parameters_and_state(tensors, _optimized(optimizers), optimizers)


def replicated(tensors: Mapping[str, torch.Tensor], objects: Mapping[str, Any]) -> set[str]:
    """Names of ``tensors`` data parallelism keeps the same on every rank: the parameters of
    registered modules and optimizers and the optimizer state. Buffers (BatchNorm statistics),
    plain values and other objects' tensors may differ between ranks."""
    optimizers = {n: o for n, o in objects.items() if isinstance(o, torch.optim.Optimizer)}
    params = [p for o in objects.values() if isinstance(o, torch.nn.Module) for p in o.parameters()]
    return _parameters_and_state(tensors, params + _optimized(optimizers), optimizers)


def _optimized(optimizers: Mapping[str, torch.optim.Optimizer]) -> list[torch.Tensor]:
    return [p for opt in optimizers.values() for g in opt.param_groups for p in g["params"]]


def _parameters_and_state(
    tensors: Mapping[str, torch.Tensor], params: list[torch.Tensor], optimizers: Mapping[str, Any]
) -> set[str]:
    """Names of ``tensors`` that are one of ``params`` or under an optimizer's ``state``."""
    param_ptrs = {storage_ptr(p) for p in params}
    prefixes = tuple(f"{name}/state/" for name in optimizers)
    return {n for n, t in tensors.items() if n.startswith(prefixes) or storage_ptr(t) in param_ptrs}
