"""Stand-in for vllm.config.weight_transfer: the backend name the factory selects by."""

from dataclasses import dataclass


@dataclass
class WeightTransferConfig:
    backend: str = "nccl"
