"""Ferry node agent: the peer-to-peer core (strategy chain, resident weights, NIXL transfer, worker gRPC).

Nothing in this package talks to Kubernetes; the agent's CRD wiring feeds it `SourceCandidate`s and
copies `Attempt` records into WeightReplica status.
"""
