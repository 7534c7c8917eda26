"""Where a node keeps weights: the checkpoint store on disk that object-storage loads go through (`checkpoints`),
and one rank's resident tensors in memory, with their manifest (`resident`). Host memory shared with engine pods
is `ferry_agent.attach.memstore`."""
