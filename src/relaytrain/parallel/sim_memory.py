"""Per-rank memory of a simulated step: PyTorch's memory trackers, fitted to relaytrain's step.

Two things the stock trackers do not do, and why this module exists:

* DTensor computes the global shape of an op's output by running the op on fake tensors, in the fake
  mode that is active. Under the simulation's own FakeTensorMode those full-size propagation tensors
  would be counted as if allocated: `ignore_sharding_propagation` marks them so the tracker skips them.
* A step runs the model once per micro batch; the stock trackers refuse a second forward of the root
  ("multiple iterative calls"). A root's per-module statistics are reset before each of its micro
  batches; the peak over the whole step is kept.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from relaytrain.torch_private import (
    fsdp_param_group,
    fsdp_ref_type,
    mem_tracker_classes,
    partial_reduce_output,
    sharding_propagation_lock,
)

MemTracker, FSDPMemTracker = mem_tracker_classes()

_local = threading.local()

# Tracker categories -> the categories relaytrain reports.
CATEGORY_OF = {
    "Sharded Param": "parameters",
    "Parameter": "parameters",
    "Buffer": "parameters",
    "Sharded Grad": "gradients",
    "Gradient": "gradients",
    "OptState": "optimizer state",
    "Optstate": "optimizer state",
    "Unsharded Param": "gathered layers",
    "Unsharded Grad": "gathered layers",
    "All Gather": "communication buffers",
    "Reduce Scatter": "communication buffers",
    "Activation": "activations",
    "Inputs": "activations",
    "Temp": "temporaries",
    "Other": "temporaries",
}
CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer state",
    "gathered layers",
    "communication buffers",
    "activations",
    "temporaries",
)


class _PropagationMark:
    """Stands in for ShardingPropagator's lock (a no-op context by default) to flag propagation."""

    def __init__(self, inner):
        self.inner = inner

    def __enter__(self):
        _local.propagating = getattr(_local, "propagating", 0) + 1
        return self.inner.__enter__()

    def __exit__(self, *exc):
        _local.propagating -= 1
        return self.inner.__exit__(*exc)


def ignore_sharding_propagation() -> contextlib.AbstractContextManager:
    """Within: ops that DTensor's sharding propagation runs on its own fake tensors are not the step's."""
    return sharding_propagation_lock(_PropagationMark)


def _propagating() -> bool:
    return getattr(_local, "propagating", 0) > 0


class _StepMixin:
    """Peak moment (phase, micro batch, module) and the propagation filter, for both trackers."""

    def _setup_step(self, roots: list[nn.Module]) -> None:
        self._forwards = {id(r): 0 for r in roots}
        self.micro_batch = -1
        self.in_optimizer = False
        self.peak_at = ""
        self._best = 0

    def _note_root_forward(self, module: nn.Module) -> None:
        """A root's next micro batch: forget its own modules' statistics of the previous one.

        Only its own: a pipeline runs the forward of one micro batch before the backward of an earlier
        one, and an interleaved rank's other stages are still to run backward with theirs."""
        if id(module) in self._forwards and not self._mod_tracker.is_bw:
            self.micro_batch = self._forwards[id(module)]
            self._forwards[id(module)] += 1
            for sub in module.modules():
                if sub in self.memory_tracking:
                    del self.memory_tracking[sub]

    def _update_peak_stats(self, peak_state) -> None:
        super()._update_peak_stats(peak_state)
        total = sum(snap.get("Total", 0) for snap in self._curr_mem_snap.values())
        if total > self._best:
            self._best = total
            if self._in_opt:
                phase = "optimizer step"
            else:
                phase = "backward" if self._mod_tracker.is_bw else "forward"
            inner = max(self._mod_tracker.parents, key=len, default="")
            where = f" in {inner}" if inner and inner != "Global" else ""
            self.peak_at = f"{phase} of micro batch {max(self.micro_batch, 0) + 1}{where}"
            if self._in_opt:
                self.peak_at = phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _propagating() and not any(t == DTensor for t in types):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class FSDPStepTracker(_StepMixin, FSDPMemTracker):
    """FSDPMemTracker over every model part of this rank (interleaved pipelines hold several)."""

    def __init__(self, parts: list[nn.Module], optimizer: torch.optim.Optimizer):
        super().__init__(parts[0], optimizer)
        self._root_mod = nn.ModuleList(parts)
        self._setup_step(parts)

    def _fsdp_state_pre_forward(self, fsdp_mod, orig_fsdp_state_pre_fw):
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)

        def pre_forward(*args, **kwargs):
            self._note_root_forward(fsdp_mod)
            return inner(*args, **kwargs)

        return pre_forward

    def _fsdp_param_group_post_backward(self, fsdp_mod, orig_fsdp_param_group_post_backward):
        """Gradients FSDP holds back, which the stock tracker counts as temporaries, counted as gradients:

        * a pipeline stage holds the reduction until its last microbatch: the gradients accumulate
          unsharded, upcast to the reduce dtype (the stage's unsharded gradients);
        * HSDP holds the all-reduce across replica groups until the last micro batch: the
          reduce-scattered gradients accumulate in FSDP's partial reduce output (the sharded ones)."""
        ref_type = fsdp_ref_type()
        inner = super()._fsdp_param_group_post_backward(fsdp_mod, orig_fsdp_param_group_post_backward)

        def post_backward(*args, **kwargs):
            out = inner(*args, **kwargs)
            group = fsdp_param_group(fsdp_mod)
            if group is None:
                return out
            for param in group.fsdp_params:
                if param.unsharded_accumulated_grad is not None:
                    self._update_and_maybe_create_winfos(
                        param.unsharded_accumulated_grad, ref_type.UNSHARDED_GRAD
                    )
            held = partial_reduce_output(group)
            if held is not None:
                self._update_and_maybe_create_winfos(held, ref_type.SHARDED_GRAD)
            return out

        return post_backward


class PlainStepTracker(_StepMixin, MemTracker):
    """MemTracker for a model without FSDP (one process)."""

    def __init__(self, parts: list[nn.Module], optimizer: torch.optim.Optimizer):
        super().__init__()
        self.track_external(*parts, optimizer)
        self._setup_step(parts)

    def _pre_fw_hook(self, module, inputs) -> None:
        self._note_root_forward(module)
        super()._pre_fw_hook(module, inputs)


def peak_by_category(tracker: _StepMixin) -> tuple[int, dict[str, int]]:
    """(peak bytes, bytes per category at that moment), summed over devices."""
    snapshot = tracker.get_tracker_snapshot("peak")
    out = dict.fromkeys(CATEGORIES, 0)
    total = 0
    for dev_snap in snapshot.values():
        for key, value in dev_snap.items():
            name = str(getattr(key, "value", key))
            if name == "Total":
                total += value
            else:
                out[CATEGORY_OF.get(name, "temporaries")] += value
    return total, out
