"""How resident bytes move between nodes: NIXL agents and their READs (`nixl`), the per-rank Worker gRPC service
that hands out manifests and read leases (`worker_service`, stubs in `proto`), and who may call it
(`worker_auth`: pod-bound worker tokens, TokenReview, the replicas a reader's node is assigned)."""
