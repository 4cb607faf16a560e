"""Container jobs (`slurm.container_image`, pyxis/enroot): the paths the job needs inside the image, and
what the mode changes, said before anything is queued.

The batch shell runs on the first node outside the image; only the srun step enters it. The step's
processes read the resolved config and write checkpoints and `run_state.json` in the run directory, and
the batch shell reads `run_state.json` there after the step: the run directory must be mounted at the
same path inside (`container_mounts`), or the job cannot save or be requeued. Relative paths of the
config resolve from the step's working directory: `container_workdir`, else the launch directory when
it is mounted (the script passes it as `--container-workdir`).
"""

from __future__ import annotations

from pathlib import Path

from relaytrain.config import Config
from relaytrain.errors import UserError

DOCS = "docs/containers.md"


def parse_mounts(entries: list[str]) -> list[tuple[Path, Path]]:
    """`container_mounts` entries (`SRC:DST[:FLAGS]`, or `PATH` for the same path inside) -> (src, dst)."""
    mounts = []
    for entry in entries:
        for item in entry.split(","):
            parts = item.strip().split(":")
            if parts[0]:
                mounts.append((Path(parts[0]), Path(parts[1] if len(parts) > 1 and parts[1] else parts[0])))
    return mounts


def inside_path(path: Path, mounts: list[tuple[Path, Path]]) -> Path | None:
    """Where `path` (absolute, on the host) appears inside the container; None when no mount holds it."""
    best: tuple[Path, Path] | None = None
    for src, dst in mounts:
        inner = best is None or len(src.parts) > len(best[0].parts)  # the innermost mount wins
        if (path == src or src in path.parents) and inner:
            best = (src, dst)
    if best is None:
        return None
    return best[1] / path.relative_to(best[0])


def step_workdir(cfg: Config, launch_dir: Path) -> str:
    """The step's working directory inside the image: container_workdir, else the launch directory when
    it is mounted at the same path, else '' (the image's own)."""
    s = cfg.slurm
    if s.container_workdir:
        return s.container_workdir
    mounts = parse_mounts(s.container_mounts)
    return str(launch_dir) if inside_path(launch_dir, mounts) == launch_dir else ""


def check_container(cfg: Config, run_dir: Path, launch_dir: Path) -> list[str]:
    """Refuse (UserError) a container job that could not save or be requeued; return the lines the
    launcher prints: warnings for paths the image may lack, how relaytrain runs there, what changes."""
    s = cfg.slurm
    if not s.container_image:
        return []
    mounts = parse_mounts(s.container_mounts)
    top = Path(cfg.run.dir).absolute()
    example = f"--slurm.container_mounts='[\"{top}:{top}\"]'"
    where = f"slurm.container_mounts={s.container_mounts}" if mounts else "slurm.container_mounts is empty"
    for what, path in (("run directory", run_dir), ("checkpoint directory", _absolute(cfg.checkpoint.dir))):
        if path is not None and inside_path(path, mounts) != path:
            raise UserError(
                f"container job: the {what} {path} is not mounted at the same path inside the image "
                f"({where}); the job writes its checkpoints and run_state.json there: add {example}"
            )
    workdir = step_workdir(cfg, launch_dir)
    if not Path(cfg.run.dir).is_absolute() and workdir != str(launch_dir):
        inside = f"{workdir}/{cfg.run.dir}" if workdir else f"{cfg.run.dir} of the image's working directory"
        raise UserError(
            f"container job: run.dir={cfg.run.dir!r} is relative and the job runs in "
            f"{workdir or 'the image working directory'} (slurm.container_workdir), not in the launch "
            f"directory {launch_dir}: it would write to {inside}; launch from "
            f"{workdir or 'a mounted directory'}, leave slurm.container_workdir empty, or make run.dir "
            "absolute"
        )
    lines = []
    for what, text in _data_paths(cfg):
        path = Path(text) if Path(text).is_absolute() else (Path(workdir or launch_dir) / text)
        host = _absolute(text)
        if host is not None and inside_path(host, mounts) != path:
            lines.append(
                f"container warning: {what} {text} is not mounted at {path} inside the image "
                f"({where}); the job finds it only if the image holds it there"
            )
    image = Path(s.container_image).expanduser()
    if s.container_image.startswith(("/", "./", "~")) and not image.exists():
        lines.append(f"container warning: image file {s.container_image} does not exist here")
    lines += [
        f"container: each task runs `relaytrain.job.task ... relaytrain.cli train` with the "
        f"image's python: relaytrain must be installed in the image ({DOCS}; examples/container/Dockerfile); "
        "an image without it fails at the first task with 'No module named relaytrain'",
        "container: left out: the pip freeze summary of the job log (the batch shell is outside the "
        "image); crash recovery and the exit-75 requeue of --command run on the batch shell's python "
        "outside the image and work only where that python imports relaytrain (slurm.venv, conda_env, "
        "modules, or this install on a shared filesystem), else the job log says they were skipped",
    ]
    return lines


def _absolute(path: str) -> Path | None:
    return Path(path).expanduser().absolute() if path else None


def _data_paths(cfg: Config) -> list[tuple[str, str]]:
    paths = [("data source", source) for source in cfg.data.sources]
    if cfg.data.tokenizer != "byte":
        paths.append(("data.tokenizer", cfg.data.tokenizer))
    if cfg.checkpoint.init_from:
        paths.append(("checkpoint.init_from", cfg.checkpoint.init_from))
    return paths
