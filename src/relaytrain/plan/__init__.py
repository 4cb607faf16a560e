"""The memory model and the estimates `relaytrain plan` prints, before a job waits in the queue.

Pure estimates from the config and the layout: memory per GPU (gpu_memory, with activation_memory and
pipeline_memory), host memory per node (host_memory, snapshot_memory), step time (step_time), the plan
and its checks (checks), and the analytical plan beside the fake-tensor step of the real build
(compare; the step itself: relaytrain.parallel.simulate). Nothing here talks to Slurm: what the
partition says (host memory from `sinfo`) is passed in by relaytrain.slurm.partition_plans.
"""
