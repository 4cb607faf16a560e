"""TrainingState: the one tree of what training is, built in one place for every way it is persisted.

A checkpoint (DCP files plus each rank's ``train_state/rank_<r>.pt``), a snapshot taking it and both
restores read and write this tree through `state_dict` and `load_target` / `load_state_dict`, and
nothing else:

    {"model": merged model state, "optim": flattened optimizer state (when there is any),
     "states": {name: component.state_dict() for every registered component}}

Model and optimizer entries are tensors keyed by the full model's parameter names (`state.py`); a
component is any object with ``state_dict()`` / ``load_state_dict()`` over plain Python values and
tensors (the train state, the data position, the RNG streams, ...). Adding a piece of state to
training is one `register` call (or one entry of the constructor's `components`): every path then
saves and restores it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from relaytrain.checkpoint.state import (
    create_adam_state,
    model_state,
    optimizer_state,
    optimizers_have_state,
    set_model_state,
    set_optimizer_state,
)


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class Reseedable(Protocol):
    """A component whose per-rank state does not map onto another number of ranks (the RNG streams): a
    restore at another world size reseeds it instead of loading it."""

    def reseed(self, step: int, rank: int) -> None: ...


class MissingState(KeyError):
    """A saved tree lacks components this run registered: it was written by a different trainer."""

    def __init__(self, names: list[str]):
        super().__init__(f"no saved state for {', '.join(names)}")
        self.names = names


class TrainingState:
    """This rank's model parts, optimizers and named stateful components; see the module docstring.

    `optimizers`: one for all model parts or one per part."""

    def __init__(
        self,
        model_parts: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        components: dict[str, Stateful] | None = None,
    ):
        self.model_parts = list(model_parts)
        self.optimizers = list(optimizers)
        self._components: dict[str, Stateful] = {}
        for name, component in (components or {}).items():
            self.register(name, component)

    def register(self, name: str, component: Stateful) -> None:
        """Save and restore `component` under `name` with the rest of the training state."""
        if name in self._components:
            raise ValueError(f"a training state component named {name!r} is already registered")
        if not isinstance(component, Stateful):
            raise TypeError(f"{name!r} has no state_dict() / load_state_dict()")
        self._components[name] = component

    @property
    def component_names(self) -> list[str]:
        return list(self._components)

    # -- saving ---------------------------------------------------------------------------------------

    def has_optimizer_state(self) -> bool:
        """Whether this rank's optimizers have stepped. A never-stepped optimizer has no state, and asking
        for it would create some (and change training): the caller agrees on it over all ranks."""
        return optimizers_have_state(self.optimizers)

    def state_dict(self, *, optimizer: bool) -> dict[str, Any]:
        """The tree; the optimizer's entries only with `optimizer` (every rank the same value)."""
        tree: dict[str, Any] = {"model": model_state(self.model_parts)}
        if optimizer:
            tree["optim"] = optimizer_state(self.model_parts, self.optimizers)
        tree["states"] = {name: component.state_dict() for name, component in self._components.items()}
        return tree

    # -- restoring ------------------------------------------------------------------------------------

    def load_target(self, *, optimizer: bool) -> dict[str, Any]:
        """The tensor part of the tree to read a saved one into (in place): "model", and with `optimizer`
        "optim", after giving never-stepped Adam optimizers the state the read overwrites."""
        target: dict[str, Any] = {"model": model_state(self.model_parts)}
        if optimizer:
            create_adam_state(self.optimizers)
            target["optim"] = optimizer_state(self.model_parts, self.optimizers)
        return target

    def missing(self, saved_states: dict[str, Any]) -> list[str]:
        return sorted(set(self._components) - set(saved_states))

    def load_state_dict(self, tree: dict[str, Any], *, reseed_at: tuple[int, int] | None = None) -> None:
        """Load a tree: `load_target`'s entries, read, and the saved "states". `reseed_at` (step, rank):
        the tree was saved at another world size, so `Reseedable` components are reseeded instead."""
        missing = self.missing(tree["states"])
        if missing:
            raise MissingState(missing)
        set_model_state(self.model_parts, tree["model"])
        if "optim" in tree:
            set_optimizer_state(self.model_parts, self.optimizers, tree["optim"])
        for name, component in self._components.items():
            if reseed_at is not None and isinstance(component, Reseedable):
                component.reseed(*reseed_at)
            else:
                component.load_state_dict(tree["states"][name])

    # -- facts for the savers -------------------------------------------------------------------------

    def on_host(self) -> bool:
        return all(p.device.type == "cpu" for part in self.model_parts for p in part.parameters())

    def local_parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for part in self.model_parts for p in part.parameters())
