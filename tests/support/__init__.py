"""Helpers shared by the test packages: `ranks` (real gloo rank groups), `s3` (canonical checkpoints in the real S3
for the S3 strategy), `objects` (WeightVersion and ModelLoad bodies, apply/get/wait, checkpoints published for e2e),
`agents` (Node objects, WeightReplicas, node agent processes), `operators` (the operator process), `consumers` (engine
Pods and attaching consumer processes), `workers` (a Worker service's identity, manifest and clock), `kube_fakes`
(fake WeightReplica and Lease APIs under a NodeAgent) and `helm` (the real helm binary against the chart)."""
