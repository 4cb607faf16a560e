"""The compiler's hooks of the torch-private seam (relaytrain.torch_private.compiler), called on the installed
torch: tests/test_torch_private.py checks that every entry of the seam is called here or there."""

from __future__ import annotations

from relaytrain import torch_private as tp
from relaytrain.torch_private import compiler as _compiler  # noqa: F401 - tp.compiler below


def test_on_dynamo_compile_calls_each_once_around_a_compiled_graph():
    seen: list[str] = []

    def start(*_args):
        seen.append("start")

    def end(*_args):
        seen.append("end")

    import torch._dynamo

    torch._dynamo.reset()
    tp.compiler.on_dynamo_compile(start, end)
    tp.compiler.on_dynamo_compile(start, end)  # registered once
    torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
    assert seen == ["start", "end"]
    torch._dynamo.reset()


def test_on_compile_stage_calls_moved_at_each_stage_and_each_kernel_waited_for(monkeypatch):
    from concurrent.futures import Future

    import torch._dynamo
    import torch._inductor.async_compile as async_compile

    moves: list[int] = []

    def moved():
        moves.append(1)

    torch._dynamo.reset()
    tp.compiler.on_compile_stage(moved)
    tp.compiler.on_compile_stage(moved)  # wrapped once
    torch.compile(lambda x: x * 3 - 1, backend="eager")(torch.ones(3))
    stages = len(moves)
    assert stages >= 4 and stages % 2 == 0  # each stage's start and end
    done = {f"kernel{i}": Future() for i in range(3)}
    for future in done.values():
        future.set_result(lambda: None)
    monkeypatch.setattr(async_compile, "get_compile_threads", lambda: 2)  # wait() waits on the workers
    async_compile.AsyncCompile().wait(dict(done))
    assert len(moves) - stages == 5, len(moves) - stages  # the wait's start and end, one per kernel
    torch._dynamo.reset()


def test_import_dynamo():
    import sys

    tp.compiler.import_dynamo()
    assert "torch._dynamo.callback" in sys.modules
