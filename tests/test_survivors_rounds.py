"""resilience.survivors without processes to kill: the rounds on a store as the launcher and a rank see
them, the fallback's mark when no round comes, and the connections a survivor shuts down (the end to end
path: tests/test_survivors.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest
from torch.distributed import TCPStore

from relaytrain.config.schema import ResilienceConfig
from relaytrain.job.survivors import SurvivorRounds
from relaytrain.resilience.rank import survivors as rank_survivors
from relaytrain.resilience.rank.survivors import Survivors

from conftest import child_env


@pytest.fixture
def agent(monkeypatch):
    """The agent's store on a free port and a worker's environment under it; no connection is shut."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    severed = []
    monkeypatch.setattr(rank_survivors, "sever_group_connections", severed.append)
    monkeypatch.setattr(rank_survivors, "DETECT_WAIT_S", 0.3)
    environ = {"WORLD_SIZE": "4", "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1"}
    environ |= {"MASTER_PORT": str(store.port), "RELAYTRAIN_SURVIVOR_REPLACEMENTS": "3"}
    yield SurvivorRounds.connect("127.0.0.1", store.port, 0, 5.0), environ, severed


def test_a_lost_rank_s_round_is_joined_and_without_one_the_rank_falls_back(agent):
    launcher, environ, severed = agent
    rank = Survivors(ResilienceConfig(survivors=True), environ)
    assert rank.on and launcher.enabled() and rank.replacement_store() is None and launcher.settled()
    assert launcher.open_generation(2, 100.0) == 1
    assert not launcher.settled()  # a round under way: the agent starts no standby process
    lost = rank.caught(RuntimeError("Connection closed by peer"), step=6)
    assert (lost.generation, lost.lost_rank, lost.lost_step) == (1, 2, 7) and severed == [
        int(environ["MASTER_PORT"])
    ]
    replacement = Survivors(
        ResilienceConfig(survivors=True), {**environ, "RELAYTRAIN_SURVIVOR_GENERATION": "1"}
    )
    assert replacement.recovery.lost_rank == 2 and replacement.replacement_store() is not None
    events = []
    replacement.step_done(7, lambda *args, **fields: events.append(args))
    assert events == [("recovery", 7)] and launcher.settled()  # its replayed step done: the next standby
    # No round after the next failure: not a lost rank; the round is marked failed for the launcher.
    rank.generation = 1
    assert rank.caught(RuntimeError("a bug"), step=9) is None and launcher.failed()
    assert rank.caught(SystemExit(75), step=9) is None and len(severed) == 2  # a stop is never caught


def test_off_or_outside_an_agent_nothing_is_asked_of_a_store(agent):
    _launcher, environ, _severed = agent
    assert not Survivors(ResilienceConfig(survivors=False), environ).on
    outside = Survivors(ResilienceConfig(survivors=True), {**environ, "TORCHELASTIC_USE_AGENT_STORE": ""})
    assert not outside.on and outside.caught(RuntimeError("x"), 3) is None
    # A launcher with no replacement budget (torchrun itself, or relaytrain's without
    # --survivor-replacements) starts no replacement: off, not a 120 s wait to fall back. Its restarts of
    # every worker are not replacements.
    no_budget = {k: v for k, v in environ.items() if k != "RELAYTRAIN_SURVIVOR_REPLACEMENTS"}
    assert not Survivors(ResilienceConfig(survivors=True), {**no_budget, "TORCHELASTIC_MAX_RESTARTS": "3"}).on


SEVER = textwrap.dedent("""
    import socket
    from relaytrain.job.survivors import sever_group_connections
    def pair(server):
        client = socket.create_connection(server.getsockname())
        return client, server.accept()[0]
    store, peer = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    (store_client, store_side), (peer_client, peer_side) = pair(store), pair(peer)
    print(sever_group_connections(store.getsockname()[1]))
    print(repr(peer_side.recv(1)))  # the shut connection's far end reads its end at once
    store_client.sendall(b"k"); print(repr(store_side.recv(1)))  # the store's still works
""")


def test_a_survivor_shuts_its_connections_but_the_store_s():
    done = subprocess.run(
        [sys.executable, "-c", SEVER], env=child_env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "b''", "b'k'"]  # the peer's two ends; listening sockets left


def test_the_launcher_replaces_up_to_its_own_budget_then_ends_every_worker(agent, capsys):
    """relaytrain's torchrun (job/torchrun.py): without --survivor-replacements it is torchrun (no store
    asked, nothing replaced); with N it replaces N lost ranks of a survivors run, not agreed stops, and
    the next loss ends every worker (False: no restart of every worker either)."""
    from relaytrain.job.torchrun import _Replacements, own_options

    launcher, environ, _severed = agent
    ns = types.SimpleNamespace
    workers = [ns(global_rank=0, id=10), ns(global_rank=1, id=11)]
    group = ns(master_addr="127.0.0.1", master_port=int(environ["MASTER_PORT"]), workers=workers)
    env = {"TORCHELASTIC_RESTART_COUNT": "0"}
    plain = _Replacements(0)
    assert plain.replacement_env(group, 1, -9, env) is None and not plain.rounds
    assert not plain.replacements_left()
    policy = _Replacements(1)
    assert policy.replacement_env(group, 1, -9, env) is None  # the ranks never asked for survivors
    launcher.enable()
    assert policy.replacement_env(group, 1, 75, env) is None  # an agreed stop
    assert policy.replacement_env(group, 1, -9, env) == {"RELAYTRAIN_SURVIVOR_GENERATION": "1"}
    assert policy.replacements_left() == 0
    assert policy.replacement_env(group, 0, -9, env) is False
    assert policy.replacement_env(group, 1, -9, env) is False and launcher.generation() == 1
    err = capsys.readouterr().err
    assert err.count("ending every worker") == 1, err
    assert "rank 0 (pid 10) exited -9 and no replacement is left (--survivor-replacements used up)" in err
    # The option is relaytrain's, first; torchrun's own arguments, --max_restarts included, pass as given.
    torchrun = ["--standalone", "--max_restarts=0", "-m", "relaytrain.cli", "train"]
    assert own_options(["--survivor-replacements=2", *torchrun]) == (2, torchrun)
    assert own_options(["--survivor-replacements", "3", *torchrun]) == (3, torchrun)
    assert own_options(torchrun) == (0, torchrun)
    with pytest.raises(SystemExit) as bad:
        own_options(["--survivor-replacements=0", *torchrun])
    assert bad.value.code == 2 and "takes a whole number of 1 or more" in capsys.readouterr().err
