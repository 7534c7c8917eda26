"""Ferry's development and test harness, kept out of the runtime package `ferry`: a real one-machine control plane
(`localcluster`), real kubelet nodes for it (`localnodes`), the daemonless dev images they run (`localimages`),
`make demo` (`demo`) and a standalone P2P source for tests and benchmarks (`source_main`). Nothing in ferry,
ferry_operator, ferry_agent or ferry_vllm imports it; its own dependencies (`cryptography` for the per-run
certificates) come with the `test` extra."""
