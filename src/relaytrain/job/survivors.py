"""The survivors' rounds on the launcher's store: what torchrun's agent and the ranks tell each other when
a rank's process dies and the others stay (``resilience.survivors``, docs/resilience.md).

Under torchrun the agent hosts the TCPStore the workers rendezvous on (``TORCHELASTIC_USE_AGENT_STORE``,
``MASTER_ADDR:MASTER_PORT``): no rank owns it, so any rank, rank 0 included, may die and the store stays.
The agent replaces at most ``REPLACEMENTS_ENV`` workers (its ``--survivor-replacements``, which it puts in
the workers' environment: a rank turns survivors on only when it is set), apart from torchrun's
``--max-restarts`` (its restart of every worker). Every key lives under
``relaytrain-survivors/<restart count>/`` (a restart of every worker starts a fresh set):

* ``enabled``: set by the ranks when the run asks for survivors; the agent replaces a dead worker only then.
* ``failed``: set by a rank whose in-process recovery failed; the agent then ends every worker and fails
  (what restarts a failed job step, the batch driver's restart in place, does the rest).
* ``generation``: a counter, 0 until the first loss. The agent adds 1 when it starts a replacement for a
  dead worker and hands the replacement the new value (``RELAYTRAIN_SURVIVOR_GENERATION``); the
  survivors wait for it to pass theirs. Generation ``g`` builds its process group under ``gen<g>/``.
* ``gen<g>/lost``: ``"<rank> <unix time>"``, the rank the agent replaced and when it saw its process exit.
* ``gen<g>/recovered``: set by the ranks once generation ``g``'s replayed step is done; the agent starts its
  next standby process (``job/standby.py``) only when the newest generation is 0 or recovered.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

GENERATION_ENV = "RELAYTRAIN_SURVIVOR_GENERATION"  # set on a replacement: the round it joins
# Set by relaytrain.job.torchrun for its workers: how many lost ranks it replaces alone (at least 1).
REPLACEMENTS_ENV = "RELAYTRAIN_SURVIVOR_REPLACEMENTS"
_POLL_S = 0.02


def under_agent(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether this process is one of several torchrun workers whose agent hosts the store (the survivors'
    condition)."""
    several = int(environ.get("WORLD_SIZE", "1") or 1) > 1
    return (
        several and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and bool(environ.get("MASTER_PORT"))
    )


class SurvivorRounds:
    """The keys above, on a client of the agent's store (`store`: any torch ``Store``)."""

    def __init__(self, store, restart_count: int):
        from torch.distributed import PrefixStore

        self.base = store
        self.store = PrefixStore(f"relaytrain-survivors/{restart_count}", store)

    @classmethod
    def connect(cls, host: str, port: int, restart_count: int, timeout_s: float) -> SurvivorRounds:
        from torch.distributed import TCPStore

        store = TCPStore(
            host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        return cls(store, restart_count)

    @classmethod
    def from_env(cls, timeout_s: float, environ: dict[str, str] | os._Environ = os.environ) -> SurvivorRounds:
        """A worker's client of its agent's store (`under_agent` must hold)."""
        restarts = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        return cls.connect(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), restarts, timeout_s)

    def _flag(self, key: str) -> bool:
        return self.store.check([key])

    def enable(self) -> None:
        self.store.set("enabled", "1")

    def enabled(self) -> bool:
        return self._flag("enabled")

    def fail(self, why: str) -> None:
        self.store.set("failed", why)

    def failed(self) -> bool:
        return self._flag("failed")

    def generation(self) -> int:
        return int(self.store.add("generation", 0))

    def open_generation(self, lost_rank: int, seen_at: float) -> int:
        """The agent, when it replaces `lost_rank`'s process: the new generation's number."""
        generation = int(self.store.add("generation", 1))
        self.store.set(f"gen{generation}/lost", f"{lost_rank} {seen_at!r}")
        return generation

    def mark_recovered(self, generation: int) -> None:
        self.store.set(f"gen{generation}/recovered", "1")

    def settled(self) -> bool:
        """No round under way: no loss yet, or the newest round's replayed step done."""
        generation = self.generation()
        return generation == 0 or self._flag(f"gen{generation}/recovered")

    def lost(self, generation: int) -> tuple[int, float]:
        rank, seen = self.store.get(f"gen{generation}/lost").decode().split()
        return int(rank), float(seen)

    def wait_generation(self, after: int, timeout_s: float) -> int | None:
        """The first generation above `after` the agent opens within `timeout_s`, else None."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            generation = self.generation()
            if generation > after:
                return generation
            time.sleep(_POLL_S)
        return None

    def group_store(self, generation: int):
        """The store generation `generation` builds its default process group on."""
        from torch.distributed import PrefixStore

        return PrefixStore(f"gen{generation}", self.store)


def sever_group_connections(store_port: int) -> int:
    """Shut down this process's TCP connections but those to or from the store at `store_port` (gloo's
    pairs: the default group's and every subgroup's), so that each rank blocked in a collective with this
    one fails at once. A survivor of a lost rank calls it first (resilience/rank/survivors.py): with gloo only
    the dead rank's neighbours in a ring see its sockets close, the other ranks wait on the neighbours,
    and neither destroying nor aborting a gloo group closes its pairs while anything still holds it.
    `shutdown(2)` on a duplicate of each descriptor: the socket ends, the owner's descriptor stays valid.
    Returns how many it shut down."""
    severed = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:  # closed meanwhile, or not a socket after all
            continue
        with sock:
            try:
                if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                if store_port in (sock.getpeername()[1], sock.getsockname()[1]):
                    continue
                sock.shutdown(socket.SHUT_RDWR)
                severed += 1
            except OSError:  # not connected (a listening socket)
                continue
    return severed
