"""The clean trials' variants of `bench.chaos --hangs clean` (bench/cluster/chaos_hangs.py runs them): what
issue 37 lists for false detections, each a run beside a CPU-bound process in which any `hang detected:`
line is a false detection.

Trial `index` of variants V (`--clean-variants`, default all) runs V[index % len(V)] with checkpoint.mode
async in the first round over V and sync in the next, in turn, so that every (variant, mode) pair comes up:

* ``debug``: the debug config's model and batch, 40 steps (chaos_run.STEPS), checkpoints every 10,
  evaluations every 10, snapshots every 2 steps.
* ``wide``: the debug config widened to about 1.2 GB of model and AdamW state in total (bench/snapshot.py
  `wide_model`; split over the 2 ranks), so the checkpoint saves (sync and async in turn) and the
  restores move that state (no in-memory snapshots: the 2 newest steps in /dev/shm do not fit a local
  node's memory, and `relaytrain launch` refuses the job); a step takes about 10 s on 2 shared CPU
  cores, so 6 steps with a checkpoint every 2 and an evaluation every 3 (a trial of about 2 minutes).
* ``compile``: the debug run with `parallel.compile=true`: inductor compiles the first step (and the first
  evaluation) on CPU, which takes tens of seconds cold; graphs in Inductor's caches on the node (an
  earlier run's) take a few.
* ``compile_cold``: the same with Inductor's caches off and an empty cache folder per job (``cold_setup``):
  every graph and kernel compiled from scratch, the longest pauses a compilation makes.
* ``restart``: the debug run with one rank (index % 2) SIGKILLed from outside at a random step; the step
  restarts in place (crash path, crashes.jsonl action restart) and restores from the snapshots: the restarted
  step's start-up must not be called a hang.

A variant whose config changes the losses (wide, compile) gets its own uninterrupted reference run of that
config (`VariantBenches`); debug and restart compare with the debug one.
"""

from __future__ import annotations

import json
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path

import faults
from bench.cluster.chaos_run import EVAL_EVERY, INTERVAL, STEPS, Bench
from bench.cluster.harness import TINY_TOML, write_config
from bench.report import REPO
from bench.snapshot import wide_model

DEBUG_CONFIG = REPO / "configs" / "debug.toml"
CLEAN_VARIANTS = ("debug", "wide", "compile", "restart", "compile_cold", "long")
MODES = ("async", "sync")
LAYER_DELAY_S = 2.5  # the long variant's delay before each layer's forward (hang_stop_long_step's too)
WIDE_STATE_GB = 1.2  # issue 37: the 1.2 GB wide state


@dataclass(frozen=True)
class CleanConfig:
    """What a clean variant's runs and their reference run share (the config file)."""

    name: str  # the reference's folder; variants of one config share it
    steps: int
    interval: int
    eval_every: int
    model: tuple[str, ...] = ()  # `--model.KEY=VALUE` flags over the debug config's model
    compile: bool = False


DEBUG = CleanConfig("debug", STEPS, INTERVAL, EVAL_EVERY)
CONFIGS = {
    "debug": DEBUG,
    "restart": DEBUG,
    "wide": CleanConfig("wide", 6, 2, 3, tuple(wide_model(WIDE_STATE_GB))),
    "compile": CleanConfig("compile", STEPS, INTERVAL, EVAL_EVERY, compile=True),
    "compile_cold": CleanConfig("compile", STEPS, INTERVAL, EVAL_EVERY, compile=True),  # compile's reference
    # the long-step hang trial's (chaos_hangs_judge.LONG_STEP): the debug run, 8 steps of 20 s and more
    "long": CleanConfig("long", 8, 4, 4),
}


def clean_variant(index: int, variants: tuple[str, ...] = CLEAN_VARIANTS) -> tuple[str, str]:
    """(variant, checkpoint.mode) of clean trial `index`."""
    unknown = [v for v in variants if v not in CONFIGS]
    if not variants or unknown:
        raise ValueError(f"no clean variant {', '.join(unknown) or '(none)'}; the variants: "
                         f"{', '.join(CLEAN_VARIANTS)}")  # fmt: skip
    return variants[index % len(variants)], MODES[(index // len(variants)) % len(MODES)]


def cold_setup(variant: str, base: Path) -> str:
    """The batch shell's line that makes `variant`'s compiles cold ("" for the others): Inductor's caches
    off, and a cache folder of the job's own under `base` (the bench's folder), so no kernel built by an
    earlier run is found either. The trial removes it (`remove_cold_folder`)."""
    if variant != "compile_cold":
        return ""
    folder = cold_folder(base, "$SLURM_JOB_ID")
    return f"export TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 TORCHINDUCTOR_CACHE_DIR={folder}"


def variant_setup(variant: str, base: Path) -> str:
    """The batch shell's line that makes `variant` what it says ("" for none): compile_cold's cold caches;
    the long variant's steps, slowed as the long-step hang trial's (LAYER_DELAY_S before each layer)."""
    if variant == "long":
        return faults.setup_line(layer_delay_s=LAYER_DELAY_S)
    return cold_setup(variant, base)


def cold_folder(base: Path, job: str) -> Path:
    return base / f"inductor-{job}"


def remove_cold_folder(base: Path, job: str) -> None:
    """Job `job`'s cold cache folder, gone: its kernels' generated .py files are no bench source."""
    if job:
        shutil.rmtree(cold_folder(base, job), ignore_errors=True)


def parse_variants(text: str) -> tuple[str, ...]:
    """`--clean-variants wide,restart` -> ("wide", "restart"); ValueError naming the unknown ones."""
    variants = tuple(v.strip() for v in text.split(",") if v.strip())
    clean_variant(0, variants)
    return variants


def model_toml(config: CleanConfig = DEBUG) -> str:
    """The debug config's [model] and batch (widened by `config.model`), and [parallel] compile when on:
    in place of the chaos runs' tiny model (harness.CONFIG)."""
    debug = tomllib.loads(DEBUG_CONFIG.read_text())
    model = dict(debug["model"])
    for flag in config.model:
        key, value = flag.removeprefix("--model.").split("=", 1)
        model[key] = tomllib.loads(f"v = {value}")["v"]
    batch = {k: debug["train"][k] for k in ("seq_len", "global_batch_size", "micro_batch_size")}

    def table(name: str, values: dict) -> str:
        return f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())

    compiled = "\n" + table("parallel", {"compile": True}) if config.compile else ""
    return table("model", model) + compiled + "\n" + table("train", batch)


def write_clean_config(bench: Bench, config: CleanConfig) -> None:
    """`bench`'s config file (its trials' and its reference run's) for `config`."""
    write_config(bench.config, "reference", bench.runs, config.steps, config.eval_every, config.interval)
    bench.config.write_text(bench.config.read_text().replace(TINY_TOML, model_toml(config)))


class VariantBenches:
    """A chaos_run.Bench per clean config, each with its own reference run, made on first use; the
    debug config's is the bench the hang trials use."""

    def __init__(self, debug: Bench):
        self.benches = {DEBUG.name: debug}
        self.referenced: set[str] = set()  # the configs whose reference run is done
        self.base, self.cluster = debug.base, debug.cluster

    def __call__(self, variant: str) -> Bench:
        config = CONFIGS[variant]
        if config.name not in self.benches:
            (self.base / config.name).mkdir(parents=True, exist_ok=True)
            bench = Bench(self.base / config.name, self.cluster)
            write_clean_config(bench, config)
            self.benches[config.name] = bench
        if config.name not in self.referenced:
            self.benches[config.name].run_reference()
            self.referenced.add(config.name)
        return self.benches[config.name]
