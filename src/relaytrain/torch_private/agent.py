"""torchrun's agent, patched in its own process (`relaytrain.job.torchrun`): private names of
``torch.distributed.elastic``, under the rules of this package (`__init__.py`)."""

from __future__ import annotations


def bound_teardown_after_failure(seconds: float, agreed_codes: frozenset[int]) -> None:
    """Once a worker has failed, torchrun ends the others (its poll's ``PContext.close()``): SIGTERM, then
    SIGKILL after ``close``'s default of 30 s, which only its signal path overrides (with
    ``--shutdown-timeout``). Patched in this process: when one of the failed workers' exit codes is not in
    ``agreed_codes``, the others get ``seconds``; after agreed stops alone, the default. Checked: 2.13."""
    import inspect

    from torch.distributed.elastic.multiprocessing.api import PContext

    original = getattr(PContext.close, "relaytrain_original", PContext.close)
    default = inspect.signature(original).parameters["timeout"].default

    def close(self, death_sig=None, timeout=None) -> None:
        if timeout is None:
            codes = [failure.exitcode for failure in getattr(self, "_failures", {}).values()]
            timeout = seconds if any(code not in agreed_codes for code in codes) else default
        original(self, death_sig, timeout)

    close.relaytrain_original = original  # type: ignore[attr-defined]
    PContext.close = close


def replace_dead_workers(replacement_env) -> None:
    """torchrun's agent, in this process: before each poll of its workers, a worker whose process exited
    with a failure is started again alone, with the same command and environment plus
    ``replacement_env(worker_group, local_rank, exit_code, worker_env)``: a dict (each replacement counts
    against ``--max-restarts``); None: leave it to torchrun; False: no restart left, the launcher fails.
    Patches ``LocalElasticAgent._monitor_workers`` and reads the ``SubprocessContext``'s handlers,
    entrypoint, args, envs, stdouts, stderrs and NUMA options (``--start-method`` spawn/fork contexts
    have no handlers: nothing is replaced). Checked: 2.14."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler

    original = getattr(LocalElasticAgent._monitor_workers, "relaytrain_original", None)
    original = original or LocalElasticAgent._monitor_workers

    def monitor(self, worker_group):
        context = self._pcontext
        handlers = getattr(context, "subprocess_handlers", None) or {}
        for local_rank, handler in list(handlers.items()):
            code = handler.proc.poll()
            if not code or self._remaining_restarts <= 0:
                continue
            extra = replacement_env(worker_group, local_rank, code, context.envs[local_rank])
            if extra is False:
                self._remaining_restarts = 0
            if not extra:
                continue
            handlers[local_rank] = get_subprocess_handler(
                entrypoint=context.entrypoint,
                args=context.args[local_rank],
                env={**context.envs[local_rank], **extra},
                stdout=context.stdouts[local_rank],
                stderr=context.stderrs[local_rank],
                local_rank_id=local_rank,
                numa_options=getattr(context, "_numa_options", None),
            )
            worker_group.workers[local_rank].id = handlers[local_rank].proc.pid
            self._remaining_restarts -= 1
        return original(self, worker_group)

    monitor.relaytrain_original = original  # type: ignore[attr-defined]
    LocalElasticAgent._monitor_workers = monitor
