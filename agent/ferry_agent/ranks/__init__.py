"""The ranks of one replica: which tensors each holds (`sharding`), how they agree on a version and a source
(`agreement`: the collectives), the agreed cold start every rank runs (`cold_start`), the process of one rank
(`worker`: `python -m ferry_agent.ranks.worker`) and the node agent's side of those processes (`supervisor`)."""

# Most rank processes an agent runs, lent and idle together (`--max-rank-processes`): twice an 8-GPU node's GPUs, so
# that a replica on every GPU loads its next version beside the one it serves (make-before-break). Here, not in
# `supervisor`, so that the agent's settings read it without importing the rank processes' modules.
DEFAULT_MAX_RANK_PROCESSES = 16
