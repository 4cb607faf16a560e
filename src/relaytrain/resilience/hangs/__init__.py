"""Hangs: the node's hang watcher (its own process), the driver's hang monitor, the pure judgement, the
stacks, the record and the report."""
