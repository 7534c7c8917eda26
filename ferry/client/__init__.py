"""`ferry.client`: an engine process gets the weights its node's Ferry agent serves, zero-copy.

Needs only the standard library and torch. `attach()` leases a version through this pod's Unix socket
(`FERRY_SOCKET_DIR`, default `/run/ferry/pods/$POD_UID`), maps its sealed memory read-only, and gives
`tensors()` (views, no copy) and `load_into(module)` (in-place `copy_`). See docs/consumers.md.
"""

from ferry.client._attach import AttachError, Attachment, LoadResult, attach, request, socket_path

__all__ = ["AttachError", "Attachment", "LoadResult", "attach", "request", "socket_path"]
