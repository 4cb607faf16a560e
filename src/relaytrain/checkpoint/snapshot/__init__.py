"""In-memory snapshots: each rank's training state in node-local memory and on a peer node, restored
before the DCP checkpoint after a crash (see docs/checkpointing.md, "Snapshots")."""
