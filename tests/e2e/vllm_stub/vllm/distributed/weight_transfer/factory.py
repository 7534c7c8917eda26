"""Stand-in for vllm.distributed.weight_transfer.factory: the lazy registry as vLLM has it."""

import importlib

from vllm.distributed.weight_transfer.base import WeightTransferEngine


class WeightTransferEngineFactory:
    _registry: dict = {}

    @classmethod
    def register_engine(cls, name: str, module_path_or_cls, class_name: str | None = None) -> None:
        if name in cls._registry:
            raise ValueError(f"Weight transfer engine '{name}' is already registered.")
        if isinstance(module_path_or_cls, str):
            if class_name is None:
                raise ValueError("class_name is required when registering with module path")

            def loader():
                return getattr(importlib.import_module(module_path_or_cls), class_name)

            cls._registry[name] = loader
        else:
            cls._registry[name] = lambda: module_path_or_cls

    @classmethod
    def create_engine(cls, config, vllm_config, device, model) -> WeightTransferEngine:
        return cls._registry[config.backend]()(config, vllm_config, device, model)
