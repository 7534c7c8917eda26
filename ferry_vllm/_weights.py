"""The part of the vLLM integration that needs no vLLM: feed a version this node serves to a model's
`load_weights`, and refit it to the next version with only the tensors that changed.

vLLM models take checkpoint-named tensors through `model.load_weights(iterable of (name, tensor))` (each
parameter's `weight_loader` shards, fuses and copies them into the live parameters, in place) and return the
names of the parameters they loaded. Ferry serves the checkpoint's own (Hugging Face) names, so they pass through.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ferry.client import Attachment, attach


class LoadsWeights(Protocol):
    """What a vLLM model offers the loader: `load_weights` of (checkpoint name, tensor) pairs."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str] | None: ...


@dataclass(frozen=True)
class Source:
    """The ModelLoad a model's weights come from, through this pod's attach socket."""

    model_load: str
    namespace: str | None = None  # the pod's own when omitted (the only one the agent allows)
    timeout: float = 600  # how long to wait for this node to serve it (the engine may start while it loads)
    socket_dir: str | None = None  # FERRY_SOCKET_DIR, else /run/ferry/pods/$POD_UID
    rank: int | None = None  # a rank's share of a multi-rank replica; all shares when omitted

    KEYS = frozenset({"model_load", "namespace", "timeout", "socket_dir", "rank"})

    def same_model_load(self, other: Source) -> bool:
        """Names the same ModelLoad (a namespace left out is the pod's own)."""
        return self.model_load == other.model_load and (
            self.namespace is None or other.namespace is None or self.namespace == other.namespace
        )

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> Source:
        """From vLLM's `--model-loader-extra-config` (or a weight-transfer init info); `model_load` falls back to
        the `FERRY_MODEL_LOAD` environment variable."""
        config = dict(config or {})
        unknown = sorted(set(config) - cls.KEYS)
        if unknown:
            raise ValueError(f"unknown Ferry settings {unknown}; known: {sorted(cls.KEYS)}")
        name = config.pop("model_load", None) or os.environ.get("FERRY_MODEL_LOAD")
        if not name:
            raise ValueError('name the ModelLoad: --model-loader-extra-config \'{"model_load": "<name>"}\'')
        timeout = float(config.pop("timeout", 600))
        rank = config.pop("rank", None)
        return cls(str(name), timeout=timeout, rank=None if rank is None else int(rank), **config)


@dataclass
class LoadResult:
    version: str
    version_uid: str | None
    sent: list[str] = field(default_factory=list)  # the names fed to `load_weights`
    skipped: list[str] = field(default_factory=list)  # unchanged since the version the model held
    loaded: set[str] | None = None  # what `load_weights` reported (vLLM parameter names)


class Holder:
    """The Ferry version one model holds. It keeps the lease of the version it last loaded (so the node keeps it
    and the pod shows as attached to it) until the next version is loaded and `finish()` is called:
    make-before-break."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.current: Attachment | None = None
        self._previous: Attachment | None = None
        self._loaded_uid: str | None = None  # the version the model holds whole; None after a failed load
        self.last: LoadResult | None = None  # what the last `load` fed (for logs)

    @property
    def version(self) -> str | None:
        return self.current.version if self.current is not None and self._loaded_uid else None

    def load(self, model: LoadsWeights, version: str | None = None, *, only_changed: bool = False) -> LoadResult:
        """Lease `version` (the one this node serves now when None) and feed it to `model.load_weights`.

        `only_changed` (refit): when the model holds exactly the version the new one was compared with (its
        `base_uid`), feed only the tensors whose bytes differ, and nothing when it holds the new version already;
        otherwise all of them. Without it, feed all (vLLM may have dropped the weights: sleep mode, reload)."""
        s = self.source
        new = attach(
            s.model_load, s.namespace, timeout=s.timeout, version=version, rank=s.rank, socket_dir=s.socket_dir
        )
        result = self.last = LoadResult(new.version, new.version_uid)
        if only_changed and new.version_uid is not None and new.version_uid == self._loaded_uid:
            new.close()
            return result
        refit = only_changed and new.base_uid is not None and new.base_uid == self._loaded_uid
        for name, entry in new.entries.items():
            (result.skipped if refit and entry.changed is False else result.sent).append(name)
        self._loaded_uid = None  # until load_weights returns, the model holds no whole version
        try:
            views = new.tensors()
            result.loaded = model.load_weights((name, views[name]) for name in result.sent)
        except BaseException:
            new.close()
            raise
        self._release(self._previous)
        self._previous, self.current = self.current, new
        self._loaded_uid = new.version_uid
        return result

    def finish(self) -> None:
        """Release the version the model held before the last `load` (the model no longer uses it)."""
        self._release(self._previous)
        self._previous = None

    def close(self) -> None:
        self.finish()
        self._release(self.current)
        self.current = None
        self._loaded_uid = None

    @staticmethod
    def _release(attachment: Attachment | None) -> None:
        if attachment is not None:
            attachment.close()


# model -> its Holder: the loader makes it, the refit paths (weight-transfer engine, worker extension) of the same
# worker process find it there and know which version the model holds.
_HOLDERS: weakref.WeakKeyDictionary[Any, Holder] = weakref.WeakKeyDictionary()


def holder_for(model: Any, source: Source | None = None) -> Holder:
    """The model's Holder; made (with `source`) if it has none. A `source` naming another ModelLoad than the
    held one starts over: nothing of the old one is assumed."""
    holder = _HOLDERS.get(model)
    if holder is not None and (source is None or holder.source.same_model_load(source)):
        return holder
    if source is None:
        raise ValueError("this model was not loaded by Ferry: name the ModelLoad (model_load) to refit from")
    if holder is not None:
        holder.close()
    holder = _HOLDERS[model] = Holder(source)
    return holder


def held(model: Any) -> Holder | None:
    """The model's Holder, if Ferry loaded it."""
    return _HOLDERS.get(model)


def check_in_place(quantization: str | None) -> None:
    """Refit feeds tensors to the live parameters' weight loaders with no post-processing after: right only where
    the parameters hold the checkpoint's tensors as they are (no quantization step)."""
    if quantization is not None:
        raise NotImplementedError(
            f"Ferry refits in place, without post-processing: not for a {quantization!r}-quantized model "
            "(reload it with --load-format ferry instead)"
        )


def missing_parameters(model: torch.nn.Module, loaded: set[str] | None) -> list[str]:
    """The model's parameters `load_weights` did not report loading (none known when it reports nothing)."""
    if loaded is None:
        return []
    return sorted({name for name, _ in model.named_parameters()} - loaded)
