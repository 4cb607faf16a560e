"""The run directory a training run starts by making: created, with its resolved config written into it."""

from __future__ import annotations

from relaytrain.atomic import write_atomic
from relaytrain.config.loader import config_to_toml
from relaytrain.config.schema import Config
from relaytrain.errors import UserError
from relaytrain.job import RunDir


def prepare_run_dir(cfg: Config, is_main: bool) -> RunDir:
    run = RunDir.of(cfg.run.dir, cfg.run.name)
    if is_main:
        try:
            run.root.mkdir(parents=True, exist_ok=True)
            write_atomic(run.config, config_to_toml(cfg), durable=False)
        except OSError as exc:
            where = run.root
            raise UserError(
                f"cannot write the run directory '{where}' ({exc.strerror}); set run.dir to a writable path"
            ) from None
    return run
