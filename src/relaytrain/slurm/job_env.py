"""The environment block of the batch script: the shell lines that load modules, activate an environment
and export what the job step's processes read (threads, NCCL's settings, the Flight Recorder, ROCm's
kernel database, debug switches, the Slurm signal, the config's own variables, the network interface).

Each line is rendered here, quoted for bash; the template writes them in order. ``$run_dir`` and
``$job_id`` are the script's own variables (a sweep point's run directory is chosen at run time).
"""

from __future__ import annotations

import shlex

from relaytrain.config import SlurmConfig

# collectives each rank remembers for the dump after a timeout (torchtitan's)
FLIGHT_RECORDER_ENTRIES = 20000


def activation_lines(s: SlurmConfig) -> list[str]:
    """Modules, then a virtual environment, then a conda environment."""
    lines = [f"module load {shlex.quote(module)}" for module in s.modules]
    if s.venv:
        lines += ["# shellcheck source=/dev/null", f"source {shlex.quote(s.venv + '/bin/activate')}"]
    if s.conda_env:
        lines += ['eval "$(conda shell.bash hook)"', f"conda activate {shlex.quote(s.conda_env)}"]
    return lines


def gpu_lines(s: SlurmConfig, rocm: bool, logs: str, flight_recorder: str) -> list[str]:
    """NCCL's settings where the config sets them (else NCCL's topology detection decides), the Flight
    Recorder (each rank's last collectives written to ``$run_dir/<flight_recorder><rank>`` when one times
    out; read with `torchfrtrace`), and ROCm's node-local kernel database (or every rank locks one file
    on the shared filesystem)."""
    lines = []
    if s.gpus_per_node:
        lines += [f"export NCCL_NET_GDR_LEVEL={s.nccl_net_gdr_level}"] if s.nccl_net_gdr_level >= 0 else []
        lines += [f"export NCCL_IB_GID_INDEX={s.nccl_ib_gid_index}"] if s.nccl_ib_gid_index >= 0 else []
        lines += [
            f'mkdir -p "$run_dir/{logs}"',
            f"export TORCH_NCCL_TRACE_BUFFER_SIZE={FLIGHT_RECORDER_ENTRIES}",
            "export TORCH_NCCL_DUMP_ON_TIMEOUT=1",
            f'export TORCH_NCCL_DEBUG_INFO_TEMP_FILE="$run_dir/{flight_recorder}"',
        ]
    if rocm:
        lines += [
            'export MIOPEN_USER_DB_PATH="/tmp/${USER:-relaytrain}-miopen-$job_id"',
            "export MIOPEN_CUSTOM_CACHE_DIR=$MIOPEN_USER_DB_PATH",
            'mkdir -p "$MIOPEN_USER_DB_PATH"',
        ]
    return lines


# No CUDA_LAUNCH_BLOCKING: it serialises every kernel and can deadlock unbatched send/recv.
DEBUG_EXPORTS = {
    "PYTHONFAULTHANDLER": "1",
    "NCCL_DEBUG": "INFO",
    "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
    "TORCH_CPP_LOG_LEVEL": "INFO",
    "TORCH_SHOW_CPP_STACKTRACES": "1",
}


def environment_lines(s: SlurmConfig, rocm: bool, signal: str, logs: str, flight_recorder: str) -> list[str]:
    """Every line of the environment block, in order. ``signal``: the pre-timeout signal Slurm sends
    ("none": none; a SIGUSR2 is the time limit only when it is this one)."""
    lines = activation_lines(s)
    lines += [f"export OMP_NUM_THREADS={s.cpus_per_task}"] if s.cpus_per_task else []
    lines += gpu_lines(s, rocm, logs, flight_recorder)
    lines += [f"export {k}={v}" for k, v in DEBUG_EXPORTS.items()] if s.debug else []
    lines.append(f"export RELAYTRAIN_SLURM_SIGNAL={signal}")
    lines += [f"export {key}={shlex.quote(str(value))}" for key, value in s.env.items()]
    if s.network_interface:
        name = shlex.quote(s.network_interface)
        lines.append(f"export NCCL_SOCKET_IFNAME={name} GLOO_SOCKET_IFNAME={name}")
    return lines
