"""Ferry's test suite: `unit`, `cluster` (real apiserver and S3), `e2e` (operator and agents as processes) and
`pods` (the chart as real pods); the helpers they share are `tests.support`."""
