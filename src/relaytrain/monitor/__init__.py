"""Monitoring: metrics sinks, MFU, memory, step timing, rank logs, profiler, GPU sampler, reports.

Names are imported lazily so that ``python -m relaytrain.monitor.gpu_monitor`` (started next to
every training job) does not pay for importing torch.
"""

from __future__ import annotations

from relaytrain.lazy import lazy_getattr

_EXPORTS = {
    "MetricsLogger": "relaytrain.monitor.metrics",
    "StepTimer": "relaytrain.monitor.timer",
    "setup_logging": "relaytrain.monitor.logs",
    "memory_stats": "relaytrain.monitor.memory",
    "window_memory_stats": "relaytrain.monitor.memory",
    "peak_flops_per_device": "relaytrain.monitor.mfu",
    "mfu": "relaytrain.monitor.mfu",
    "throughput": "relaytrain.monitor.mfu",
    "StepProfiler": "relaytrain.monitor.profiler",
    "record_memory_history": "relaytrain.monitor.profiler",
    "dump_memory_snapshot": "relaytrain.monitor.profiler",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)
