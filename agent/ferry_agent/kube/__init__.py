"""The agent's side of the Kubernetes API: surviving an unreachable apiserver (`apiretry`), which WeightReplicas a
target may read from and the replica Lease (`registry`), and the reads a rank's load makes (`sources`)."""
