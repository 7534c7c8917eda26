"""Stand-in for vllm.model_executor.model_loader.base_loader: the abstract methods vLLM's BaseModelLoader has."""

from abc import ABC, abstractmethod


class BaseModelLoader(ABC):
    def __init__(self, load_config):
        self.load_config = load_config

    @abstractmethod
    def download_model(self, model_config) -> None:
        raise NotImplementedError

    @abstractmethod
    def load_weights(self, model, model_config) -> None:
        raise NotImplementedError
