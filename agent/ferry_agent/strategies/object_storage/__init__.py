"""The ObjectStorage strategy: a WeightVersion's full + XOR-delta chain replayed from S3 through the node's
checkpoint store (`strategy`), in phases: resolve and validate without changing anything (`plan`), fetch what the
store lacks (`download`), and build the target in one pass per tensor (`build`)."""
