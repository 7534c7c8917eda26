"""Stand-in for vllm.model_executor.model_loader: register_model_loader / get_model_loader as vLLM has them."""

from vllm.model_executor.model_loader.base_loader import BaseModelLoader

_LOAD_FORMAT_TO_MODEL_LOADER: dict = {}


def register_model_loader(load_format: str):
    def _wrapper(model_loader_cls):
        if not issubclass(model_loader_cls, BaseModelLoader):
            raise ValueError("The model loader must be a subclass of `BaseModelLoader`.")
        _LOAD_FORMAT_TO_MODEL_LOADER[load_format] = model_loader_cls
        return model_loader_cls

    return _wrapper


def get_model_loader(load_config) -> BaseModelLoader:
    return _LOAD_FORMAT_TO_MODEL_LOADER[load_config.load_format](load_config)
