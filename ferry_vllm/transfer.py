"""Weight-transfer backend `ferry` (`--weight-transfer-config '{"backend": "ferry"}'`): vLLM's refit lifecycle
(`/start_weight_update`, `/update_weights`, `/finish_weight_update`) moves the model to another version this node
serves, in place, feeding only the tensors that changed. Imports vLLM: loaded by the factory when selected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ferry_vllm._weights import Holder, Source, check_in_place, holder_for


@dataclass
class FerryInitInfo(WeightTransferInitInfo):
    """`/init_weight_transfer_engine` `init_info`; optional when the model was loaded with `--load-format ferry`."""

    model_load: str | None = None
    namespace: str | None = None
    timeout: float = 600
    socket_dir: str | None = None
    rank: int | None = None


@dataclass
class FerryUpdateInfo(WeightTransferUpdateInfo):
    """`/update_weights` `update_info`: the WeightVersion to move to (the one this node serves now if None)."""

    version: str | None = None
    only_changed: bool = True


class FerryWeightTransferEngine(WeightTransferEngine[FerryInitInfo, FerryUpdateInfo]):
    """Make-before-break: `update_weights` leases the new version and loads it; `finish_weight_update` releases
    the old one. The trainer side is `ferry publish` plus the ModelLoad's desired version, not this class."""

    init_info_cls = FerryInitInfo
    update_info_cls = FerryUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._holder: Holder | None = None

    def init_transfer_engine(self, init_info: FerryInitInfo) -> None:
        settings = {k: v for k, v in vars(init_info).items() if v is not None}
        self._holder = holder_for(self.model, Source.from_config(settings) if settings.get("model_load") else None)

    def start_weight_update(self) -> None:
        check_in_place(self.model_config.quantization)

    def receive_weights(self, update_info: FerryUpdateInfo) -> None:
        holder = self._holder or holder_for(self.model)
        holder.load(self.model, update_info.version, only_changed=update_info.only_changed)

    def finish_weight_update(self) -> None:
        (self._holder or holder_for(self.model)).finish()

    def shutdown(self) -> None:
        if self._holder is not None:
            self._holder.close()

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        raise NotImplementedError("publish a version with `ferry publish` and move the ModelLoad's desiredVersion")
