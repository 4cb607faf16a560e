"""The compiler's hooks relaytrain publishes a compilation's progress from (job/clock.py): each graph
Dynamo compiles, and each stage of its compilation. Private torch names, under the rules of
``relaytrain.torch_private``: each entry says which torch it was checked on, and
tests/test_torch_private_compiler.py calls it on the installed torch.
"""

from __future__ import annotations


def on_dynamo_compile(start, end) -> None:
    """`torch._dynamo.callback`: `start` and `end` called around each graph Dynamo compiles, registered once
    (again after a `torch._dynamo.reset()` cleared them). Checked: 2.14.1."""
    import torch._dynamo.callback as callbacks  # noqa: PLC0415 - loaded on first use

    if start not in callbacks.callback_handler.start_callbacks:
        callbacks.on_compile_start(start)
        callbacks.on_compile_end(end)


def import_dynamo() -> None:
    """Import ``torch._dynamo`` (its callbacks, which `on_dynamo_compile` loads at a rank's set-up, compile on
    or off): a standby process does it before it waits (job/standby.py). Checked: 2.14.1."""
    import torch._dynamo.callback  # noqa: F401, PLC0415 - loaded on first use


def on_compile_stage(moved) -> None:
    """`torch._dynamo.utils.get_chromium_event_logger`: `moved()` called at each start and end of a timed
    stage of a compilation (`dynamo_timed`: Dynamo's tracing, AOTAutograd's, each Inductor pass, each
    kernel file compiled, the graph cache's look-ups: about 190 in a 6 s compile of a small MLP here, at
    most 1.1 s apart), in the thread that compiles; and (`torch._inductor.async_compile.tqdm`, the
    progress bar of `AsyncCompile.wait`) at each kernel the compile workers finished, so a wait for many
    kernels moves too. The process's one event logger and the bar are wrapped once. Checked: 2.14.1."""
    import torch._inductor.async_compile as async_compile  # noqa: PLC0415 - loaded on first use
    from torch._dynamo.utils import get_chromium_event_logger  # noqa: PLC0415 - loaded on first use

    _count_kernels(async_compile, moved)

    logger = get_chromium_event_logger()
    start, end = logger.log_event_start, logger.log_event_end
    if getattr(start, "relaytrain_moved", None) is moved:
        return
    original_start = getattr(start, "relaytrain_original", start)
    original_end = getattr(end, "relaytrain_original", end)

    def started(*args, **kwargs):
        moved()
        return original_start(*args, **kwargs)

    def ended(*args, **kwargs):
        moved()
        return original_end(*args, **kwargs)

    started.relaytrain_moved = ended.relaytrain_moved = moved
    started.relaytrain_original, ended.relaytrain_original = original_start, original_end
    logger.log_event_start, logger.log_event_end = started, ended


def _count_kernels(async_compile, moved) -> None:
    """`async_compile.tqdm` made a bar whose `update` (one per kernel waited for) calls `moved()` first.
    Checked: 2.14.1."""
    bar = async_compile.tqdm
    if getattr(bar, "relaytrain_moved", None) is moved:
        return
    original = getattr(bar, "relaytrain_original", bar)

    def counted(*args, **kwargs):
        progress = original(*args, **kwargs)
        update = progress.update

        def updated(n=1):
            moved()
            return update(n)

        progress.update = updated
        return progress

    counted.relaytrain_moved, counted.relaytrain_original = moved, original
    async_compile.tqdm = counted
