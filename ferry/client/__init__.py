"""`ferry.client`: an engine process gets the weights its node's Ferry agent serves, zero-copy.

Needs only the standard library and torch. `attach()` leases a version through this pod's Unix socket
(`FERRY_SOCKET_DIR`, default `/run/ferry/pods/$POD_UID`), maps its sealed memory read-only, and gives
`tensors()` (views, no copy) and `load_into(module)` (in-place `copy_`); `watch()` yields each new version,
and `load_into(module, only_changed=True)` refits only the elements that changed (`stage_refit` + `apply`,
all or nothing). See docs/consumers.md.
"""

from ferry.client._attach import (
    AttachError,
    Attachment,
    LoadResult,
    StagedRefit,
    attach,
    request,
    socket_path,
    watch,
)

__all__ = ["AttachError", "Attachment", "LoadResult", "StagedRefit", "attach", "request", "socket_path", "watch"]
