"""torchrun's agent, patched in its own process (`relaytrain.job.torchrun`): private names of
``torch.distributed.elastic``, under the rules of this package (`__init__.py`)."""

from __future__ import annotations

import os


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


def replace_dead_workers(policy) -> None:
    """torchrun's agent, in this process: before each poll of its workers, a worker whose process exited
    with a failure is replaced alone, with the same command and environment plus
    ``policy.replacement_env(worker_group, local_rank, exit_code, worker_env)``: a dict (the policy
    counts its replacements against a budget of its own, ``policy.replacements_left()``: torchrun's
    ``--max-restarts``, its restart of every worker, is left alone); None: leave it to torchrun; False:
    the launcher fails, with no restart of every worker either. The replacement is the context's standby
    process when one is alive (``become``: it gets the rank's whole environment, as torchrun's handler
    would give it, and its output files), else a new process from torchrun's handler;
    ``policy.replaced(worker_group, local_rank, pid, standby)`` is told which (``standby``: the standby
    used, or None).

    While replacements are left and the context has no standby,
    ``policy.standby(worker_group, command, env)`` may start one (a ``job.standby.Standby``; `command`:
    the workers' own, `env`: the agent's environment with what every local worker's shares), and
    ``policy.standby_ready(standby)`` hears when it is ready; not when the local workers' commands differ
    or run under NUMA binding (both per local rank). A standby that exits unused is reported
    (``policy.standby_exited(standby)``) and none is started again for that context. The standby is ended
    with the workers (``LocalElasticAgent._shutdown``: the job's end, a failure, a restart of every
    worker), once the group has a result, and when no replacement is left.

    Patches ``LocalElasticAgent._monitor_workers`` and ``_shutdown``, reads the ``SubprocessContext``'s
    handlers, entrypoint, args, envs, stdouts, stderrs and NUMA options, and builds a
    ``SubprocessHandler`` around the standby's process (its ``proc``, ``local_rank_id``, ``_stdout`` and
    ``_stderr``: ``close`` signals its session). ``--start-method`` spawn/fork contexts have no
    handlers: nothing is replaced. Checked: 2.14."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        SubprocessHandler,
        get_subprocess_handler,
    )

    original = getattr(LocalElasticAgent._monitor_workers, "relaytrain_original", None)
    original = original or LocalElasticAgent._monitor_workers
    shutdown = getattr(LocalElasticAgent._shutdown, "relaytrain_original", None)
    shutdown = shutdown or LocalElasticAgent._shutdown

    def end_standby(context) -> None:
        standby = getattr(context, _STANDBY, None)
        if standby:
            setattr(context, _STANDBY, None)
            standby.end()

    def keep_standby(context, group) -> None:
        standby = getattr(context, _STANDBY, None)
        if standby is False:
            return
        if standby is not None:
            if standby.proc.poll() is not None:
                policy.standby_exited(standby)
                standby.end()
                setattr(context, _STANDBY, False)
            elif standby.ready_after is None and standby.ready():
                policy.standby_ready(standby)
            return
        spec = getattr(context, _STANDBY_SPEC, None)
        if spec is None:  # the context's command and environment do not change: worked out once
            ranks = sorted(context.args)
            if getattr(context, "_numa_options", None) or any(
                context.args[r] != context.args[ranks[0]] for r in ranks
            ):
                setattr(context, _STANDBY, False)
                return
            envs = [context.envs[r] for r in ranks]
            shared = {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs[1:])}
            command = [context.entrypoint, *(str(a) for a in context.args[ranks[0]])]
            spec = (command, {**os.environ, **shared})
            setattr(context, _STANDBY_SPEC, spec)
        setattr(context, _STANDBY, policy.standby(group, *spec))

    def take_standby(context, local_rank: int, env: dict[str, str]):
        standby = getattr(context, _STANDBY, None)
        setattr(context, _STANDBY, None)
        if not standby or standby.proc.poll() is not None:
            if standby:
                standby.end()
            return None
        standby.ready()  # up to date for `policy.replaced`
        try:
            standby.become({**os.environ, **env}, context.stdouts[local_rank], context.stderrs[local_rank])
        except OSError:  # it died meanwhile
            standby.end()
            return None
        handler = SubprocessHandler.__new__(SubprocessHandler)
        handler.proc, handler.local_rank_id = standby.proc, local_rank
        handler._stdout = handler._stderr = None
        return standby, handler

    def monitor(self, worker_group):
        context = self._pcontext
        handlers = getattr(context, "subprocess_handlers", None) or {}
        for local_rank, handler in list(handlers.items()):
            code = handler.proc.poll()
            if not code:
                continue
            extra = policy.replacement_env(worker_group, local_rank, code, context.envs[local_rank])
            if extra is False:
                self._remaining_restarts = 0
            if not extra:
                continue
            env = {**context.envs[local_rank], **extra}
            taken = take_standby(context, local_rank, env)
            standby, handlers[local_rank] = taken or (None, None)
            if standby is None:
                handlers[local_rank] = get_subprocess_handler(
                    entrypoint=context.entrypoint,
                    args=context.args[local_rank],
                    env=env,
                    stdout=context.stdouts[local_rank],
                    stderr=context.stderrs[local_rank],
                    local_rank_id=local_rank,
                    numa_options=getattr(context, "_numa_options", None),
                )
            worker_group.workers[local_rank].id = handlers[local_rank].proc.pid
            policy.replaced(worker_group, local_rank, handlers[local_rank].proc.pid, standby)
        if handlers and policy.replacements_left() > 0:
            keep_standby(context, worker_group)
        elif handlers:
            end_standby(context)  # no replacement is left to make
        result = original(self, worker_group)
        if result.state != WorkerState.HEALTHY:
            end_standby(context)
        return result

    def shut_down(self, *args, **kwargs) -> None:
        if self._pcontext is not None:
            end_standby(self._pcontext)
        shutdown(self, *args, **kwargs)

    monitor.relaytrain_original = original  # type: ignore[attr-defined]
    shut_down.relaytrain_original = shutdown  # type: ignore[attr-defined]
    LocalElasticAgent._monitor_workers = monitor
    LocalElasticAgent._shutdown = shut_down


_STANDBY = "relaytrain_standby"  # the context's standby: None (none yet), False (none for it), or one
_STANDBY_SPEC = "relaytrain_standby_spec"  # (command, environment) a standby of the context starts with
