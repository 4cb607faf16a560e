"""Starts racing for run.lock, with the interleaving forced: one start is paused inside its window (about
to create run.lock while it is absent, or about to remove a dead holder's lock) and a second start
runs in that window. Left to the scheduler, racers on a small machine run one after another and a
check-then-write lock passes. The pause hooks the file primitives themselves (os.link, os.open, open,
os.rename, os.unlink), so it lands in any implementation of the lock, right or wrong; each test
checks that it landed. Also the NFS reply lost after a link() that worked, and a filesystem without
hard links."""

from __future__ import annotations

import builtins
import errno
import io
import json
import multiprocessing
import os
import traceback
from pathlib import Path

import pytest

from relaytrain.errors import UserError
from relaytrain.job import RunDir
from relaytrain.resilience.run_lock import RunLock, process_start
from test_run_lock import no_job, sleeper, write_lock  # noqa: F401 (fixtures)

RIVAL_WAIT_S = 2.0  # how long the paused start lets its rival run (a right lock keeps the rival
# waiting at the takeover guard, whose patience is 100 turns of 50 ms)


def _race(run_dir: str, go, done, results, answered=None) -> None:
    go.wait()
    try:
        lock = RunLock(RunDir(Path(run_dir))).acquire("relaytrain train")
        results.put(("won", os.getpid()))
        if answered is not None:
            answered.set()
        done.wait()  # hold until every racer has answered
        lock.release()
    except UserError as exc:
        results.put(("refused", str(exc)))
        if answered is not None:
            answered.set()
    except BaseException:
        results.put(("failed", traceback.format_exc()))
        raise


def pause_in_window(run_dir: str, window: str, on_window) -> None:
    """In this (forked) process, call ``on_window()`` once: the first time it is about to create
    run.lock while no run.lock exists (window "create"), or to remove run.lock ("takeover")."""
    target = os.path.abspath(RunDir(Path(run_dir)).lock)
    fired = []

    def hit(path, creating: bool) -> None:
        if fired or os.path.abspath(os.fspath(path)) != target:
            return
        if (window == "create" and creating and not os.path.lexists(target)) or (
            window == "takeover" and not creating
        ):
            fired.append(True)
            on_window()

    real_link, real_open, real_rename, real_replace = os.link, os.open, os.rename, os.replace
    real_unlink, real_remove, real_builtin_open = os.unlink, os.remove, builtins.open

    def link(src, dst, *a, **k):
        hit(dst, True)
        return real_link(src, dst, *a, **k)

    def os_open(path, flags, *a, **k):
        if flags & os.O_CREAT:
            hit(path, True)
        return real_open(path, flags, *a, **k)

    def file_open(file, mode="r", *a, **k):
        if not isinstance(file, int) and any(c in mode for c in "wxa+"):
            hit(file, True)
        return real_builtin_open(file, mode, *a, **k)

    def rename(src, dst, *a, **k):
        hit(dst, True)
        return real_rename(src, dst, *a, **k)

    def replace(src, dst, *a, **k):
        hit(dst, True)
        return real_replace(src, dst, *a, **k)

    def unlink(path, *a, **k):
        hit(path, False)
        return real_unlink(path, *a, **k)

    def remove(path, *a, **k):
        hit(path, False)
        return real_remove(path, *a, **k)

    os.link, os.open, os.rename, os.replace, os.unlink, os.remove = (
        link,
        os_open,
        rename,
        replace,
        unlink,
        remove,
    )
    builtins.open = io.open = file_open


def _paused_racer(run_dir: str, window: str, paused, rival_go, rival_answered, go, done, results) -> None:
    def let_the_rival_run() -> None:
        paused.set()
        rival_go.set()
        rival_answered.wait(RIVAL_WAIT_S)

    pause_in_window(run_dir, window, let_the_rival_run)
    try:
        _race(run_dir, go, done, results)
    finally:
        rival_go.set()  # never paused (a third start took the lock first): the rival runs now


def _start(ctx, target, *args):
    proc = ctx.Process(target=target, args=args)
    proc.start()
    return proc


def run_racers(run_dir: Path, window: str | None, racers: int = 2) -> tuple[list, bool]:
    """Race ``racers`` starts for run_dir's lock; with a window, the first is paused in it and the
    second runs meanwhile. (outcomes, did the pause happen)."""
    ctx = multiprocessing.get_context("fork")
    go, done, paused, rival_go, rival_answered = (ctx.Event() for _ in range(5))
    results = ctx.Queue()
    procs = []
    if window is not None:
        args = (str(run_dir), window, paused, rival_go, rival_answered, go, done, results)
        procs.append(_start(ctx, _paused_racer, *args))
        procs.append(_start(ctx, _race, str(run_dir), rival_go, done, results, rival_answered))
    while len(procs) < racers:
        procs.append(_start(ctx, _race, str(run_dir), go, done, results))
    go.set()
    try:
        outcomes = [results.get(timeout=60) for _ in procs]
    finally:
        done.set()
        rival_go.set()
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    return outcomes, paused.is_set()


def assert_one_winner(outcomes: list, *also_named: str) -> None:
    """One start won; each other was refused naming the winner (or ``also_named``)."""
    winners = [pid for kind, pid in outcomes if kind == "won"]
    assert len(winners) == 1, outcomes
    names = (f"(pid {winners[0]} ", *also_named)
    assert all(any(n in text for n in names) for kind, text in outcomes if kind == "refused"), outcomes


@pytest.mark.parametrize("stale", [False, True])
def test_racing_starts_exactly_one_wins(tmp_path, no_job, stale):  # noqa: F811
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if stale:
        write_lock(run_dir, pid=2**22 + 7, pid_start="x:1")  # above pid_max: never a live process
    outcomes, _ = run_racers(run_dir, None, racers=6)
    assert_one_winner(outcomes)


@pytest.mark.parametrize(
    "window, stale",
    [("create", False), ("create", True), ("takeover", True)],
    ids=["create", "create-after-takeover", "takeover"],
)
def test_a_start_inside_anothers_window_does_not_win_too(tmp_path, no_job, window, stale):  # noqa: F811
    """The paused start has seen no lock (or a dead holder's) and is about to create (or remove) it;
    the rival runs to its answer meanwhile. Exactly one of them may hold the lock."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if stale:
        write_lock(run_dir, pid=2**22 + 7, pid_start="x:1")
    outcomes, landed = run_racers(run_dir, window)
    assert landed, "the pause never happened: the lock no longer creates or removes run.lock as hooked"
    assert_one_winner(outcomes)
    assert sorted(p.name for p in run_dir.iterdir()) == []  # released, no private file or guard left


def test_a_link_whose_reply_was_lost_is_ours_by_its_link_count(tmp_path, no_job, monkeypatch):  # noqa: F811
    """NFS: link() worked but its reply was lost; the retransmission says EEXIST. The private file's
    link count (2) says the name is ours."""
    real_link, lost = os.link, []

    def link_with_a_lost_reply(src, dst, *a, **k):
        real_link(src, dst, *a, **k)
        if os.fspath(dst).endswith("run.lock"):
            lost.append(dst)
            raise FileExistsError(errno.EEXIST, "File exists", os.fspath(dst))

    monkeypatch.setattr(os, "link", link_with_a_lost_reply)
    lock = RunLock(RunDir(tmp_path / "run")).acquire("relaytrain train")
    assert len(lost) == 1  # taken at the first try, not by taking over its own lock
    assert json.loads(RunDir(tmp_path / "run").lock.read_text())["token"] == lock.holder.token
    lock.release()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []


def test_a_link_refused_because_another_holds_the_lock_is_not_ours(tmp_path, no_job, sleeper):  # noqa: F811
    other = write_lock(tmp_path / "run", pid=sleeper.pid, pid_start=process_start(sleeper.pid))
    with pytest.raises(UserError, match=f"in use by relaytrain train \\(pid {sleeper.pid} "):
        RunLock(RunDir(tmp_path / "run")).acquire("relaytrain train")
    assert json.loads(RunDir(tmp_path / "run").lock.read_text())["token"] == other.token
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["run.lock"]


@pytest.mark.parametrize("window", ["create", None])
def test_without_hard_links_the_lock_is_created_exclusively(tmp_path, no_job, monkeypatch, window):  # noqa: F811
    """A filesystem without hard links (link() fails with EPERM): O_CREAT|O_EXCL, still one winner."""

    def no_links(src, dst, *a, **k):
        raise PermissionError(errno.EPERM, "Operation not permitted", os.fspath(dst))

    monkeypatch.setattr(os, "link", no_links)  # inherited by the forked racers
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    outcomes, landed = run_racers(run_dir, window, racers=2 if window else 6)
    assert landed or window is None
    # O_CREAT|O_EXCL makes the name before the record is written: a start may see it empty
    assert_one_winner(outcomes, "an unreadable lock (being written)")
