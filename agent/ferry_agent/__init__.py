"""The Ferry node agent (`python -m ferry_agent`): loads the WeightReplicas assigned to its node and serves them
to peers and to the node's pods.

- `node_agent`: the process's loop: reconcile this node's WeightReplicas (load, serve, retire) over `kube/`.
- `strategies/`: how a rank's bytes arrive (the chain; peer, object storage, local seed file).
- `ranks/`: the ranks of one replica: sharding, agreement, the rank processes and their supervisor.
- `transport/`: NIXL, the per-rank Worker gRPC service and who may call it.
- `store/`: the node's checkpoint store and a rank's resident weights.
- `kube/`: the Kubernetes API side: the node's replicas (watch, status writes), their Leases, retries, the source
  registry, a load's reads.
- `attach/`: sealed host memory offered to the node's engine pods.

The Kubernetes API is reached from `node_agent`, `ranks.worker`, `kube/`, `transport.worker_auth` and `attach/`;
the strategies see it only through the callables they are given.
"""
