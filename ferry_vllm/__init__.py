"""`ferry_vllm`: vLLM gets its weights from this node's Ferry agent (`ferry.client`), at load and at refit.

Installed with the `vllm` extra; vLLM discovers it through the `vllm.general_plugins` entry point, which calls
`register()` in every vLLM process. Importing this package does not import vLLM: only `register()` (and the
modules `loader` and `transfer`, which it imports) do, so the rest of Ferry never depends on vLLM. See
docs/vllm.md for the flags, the pod and what was and was not run against a real vLLM.
"""

from __future__ import annotations

import contextlib
import logging

LOAD_FORMAT = "ferry"
BACKEND = "ferry"

log = logging.getLogger(__name__)


def register() -> None:
    """The `vllm.general_plugins` entry point: load format `ferry` (`--load-format ferry`) and, where this vLLM
    has weight-transfer engines, backend `ferry` (`--weight-transfer-config '{"backend": "ferry"}'`)."""
    from vllm.model_executor.model_loader import register_model_loader

    from ferry_vllm.loader import FerryModelLoader

    register_model_loader(LOAD_FORMAT)(FerryModelLoader)
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # an older vLLM: refit through the worker extension (ferry_vllm.worker) instead
        log.info("this vLLM has no weight-transfer engines; refit with ferry_vllm.worker.FerryWorkerExtension")
        return
    with contextlib.suppress(ValueError):  # registered already: plugins may be loaded more than once a process
        WeightTransferEngineFactory.register_engine(BACKEND, "ferry_vllm.transfer", "FerryWeightTransferEngine")
