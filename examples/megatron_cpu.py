"""Run Megatron-core on a machine without a GPU: its CUDA-only calls, redirected to CPU equivalents.

examples/megatron_gpt.py calls ``patch()`` only when ``torch.cuda.is_available()`` is False, so on a
GPU the example runs Megatron-core unchanged. Nothing in site-packages is edited: the redirections
live in this process only. megatron-core 0.16 calls ``torch.cuda`` directly in many places even with
``use_cpu_initialization=True`` and a gloo process group:

* ``torch.cuda.current_device()`` as a ``device=`` argument (rotary embedding's ``inv_freq``, the
  attention mask and softmax buffers in ``dot_product_attention.py``, the checkpoint savers' status
  tensors): answered with ``"cpu"``;
* ``torch.cuda.synchronize()`` around ``dist_checkpointing`` saves and loads: nothing to wait for;
* the tensor-parallel RNG tracker (``tensor_parallel/random.py``: ``model_parallel_cuda_manual_seed``
  and ``get_cuda_rng_tracker().fork()``) seeds, saves and restores the CUDA generator: it uses the
  CPU generator instead, so the tracker's forks keep their meaning (dropout in a fork draws from the
  tracked state and leaves the default state as it was).
"""

from __future__ import annotations

import torch


def patch() -> None:
    """Redirect the CUDA calls listed above to CPU; idempotent. Call before building the model."""
    if getattr(torch.cuda, "_relaytrain_cpu_patch", False):
        return
    from megatron.core.tensor_parallel import random as tp_random

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.manual_seed = torch.manual_seed
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    tp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: torch.set_rng_state(state)
    torch.cuda._relaytrain_cpu_patch = True
