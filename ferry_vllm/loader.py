"""`--load-format ferry`: vLLM builds the model, then takes its weights from this node's Ferry agent.

`--model` still names a directory or repository with the config and tokenizer (no weight files are read);
`--model-loader-extra-config '{"model_load": "<ModelLoad>", "namespace": ..., "timeout": ..., "rank": ...}'`
says which ModelLoad. Imports vLLM: loaded by `ferry_vllm.register()` only.
"""

from __future__ import annotations

from torch import nn
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from ferry_vllm._weights import Source, holder_for, missing_parameters


class FerryModelLoader(BaseModelLoader):
    """Each worker (every tensor-parallel rank) maps the node's copy of the version and feeds it, checkpoint
    names as they are, to `model.load_weights`, whose weight loaders slice this rank's shard and copy it to the
    device. vLLM's `load_model` then runs the quantization post-processing, as for files. The version's lease
    is held while the model holds it; the refit paths release it when they load the next."""

    def __init__(self, load_config) -> None:
        super().__init__(load_config)
        self.source = Source.from_config(load_config.model_loader_extra_config)

    def download_model(self, model_config) -> None:
        """Nothing to download: the node's agent holds the weights."""

    def load_weights(self, model: nn.Module, model_config) -> None:
        holder = holder_for(model, self.source)
        result = holder.load(model)
        holder.finish()
        missing = missing_parameters(model, result.loaded) if model_config.quantization is None else []
        if missing:
            raise ValueError(f"Ferry version {result.version} has no weights for {missing}")
