"""Node-local delivery of resident weights to engine pods: sealed memfd chunks (`memstore`), the attach socket
server (`server`), the Pods it serves (`pods`), and the agent's hook (`service`). The wire format and the
consumer side are `ferry.client`."""
