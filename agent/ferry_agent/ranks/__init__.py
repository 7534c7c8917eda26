"""The ranks of one replica: which tensors each holds (`sharding`), how they agree on a version and a source
(`agreement`: the collectives), the agreed cold start every rank runs (`cold_start`), the process of one rank
(`worker`: `python -m ferry_agent.ranks.worker`) and the node agent's side of those processes (`supervisor`)."""
