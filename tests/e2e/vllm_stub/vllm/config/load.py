"""Stand-in for vllm.config.load: the two LoadConfig fields ferry_vllm reads."""

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoadConfig:
    load_format: str = "auto"
    model_loader_extra_config: dict[str, Any] = field(default_factory=dict)
