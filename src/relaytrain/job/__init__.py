"""The in-job layer: what a process knows about the SLURM job it runs in, and the per-task runtime.

The bottom layer of relaytrain: it imports nothing from relaytrain but ``relaytrain.errors``, and
it is the only place that reads ``SLURM_*`` variables inside a job (the launcher in ``relaytrain.slurm``
writes them into sbatch scripts). ``JobFacts`` holds the job's ids, restart count, nodes and end time;
``env`` maps srun's variables to torch's, ``ports`` picks MASTER_PORT, ``netdetect`` the network
interface, and ``task`` is the wrapper every srun task starts through. ``RunDir`` names the files and
folders of a run directory, where every job of a run and every command about it meet; ``jsonl`` is the
one way to append to and read its JSON Lines files (metrics.jsonl, crashes.jsonl, slurm/jobs.jsonl).
"""

from __future__ import annotations

from relaytrain.job.env import apply_slurm_env, expand_nodelist, in_srun_step
from relaytrain.job.facts import FAKE_END_TIME_ENV, JobFacts
from relaytrain.job.rundir import RunDir

__all__ = ["FAKE_END_TIME_ENV", "JobFacts", "RunDir", "apply_slurm_env", "expand_nodelist", "in_srun_step"]
