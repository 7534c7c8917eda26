"""Node-local delivery of resident weights to engine pods: sealed memfd chunks (`memstore`), the attach socket
server (`server`), the Pods it serves (`pods`), the agent's hook (`service`), and who is attached, written into the
replicas' status (`status`). The wire format and the consumer side are `ferry.client`."""
