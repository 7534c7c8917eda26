"""Refit over `collective_rpc`, for any vLLM (no weight-transfer engines needed): start vLLM with
`--worker-extension-cls ferry_vllm.worker.FerryWorkerExtension` and call
`llm.collective_rpc("ferry_refit", kwargs={"version": "v2"})` (or `POST /collective_rpc` in dev mode) while
generation is paused. Imports nothing of vLLM: vLLM mixes this class into its worker class.
"""

from __future__ import annotations

from typing import Any

from ferry_vllm._weights import Source, check_in_place, held, holder_for


class FerryWorkerExtension:
    """Methods vLLM adds to each worker; `self.model_runner` and `self.vllm_config` are the worker's."""

    def ferry_refit(
        self,
        version: str | None = None,
        only_changed: bool = True,
        model_load: str | None = None,
        namespace: str | None = None,
    ) -> dict[str, Any]:
        """Move this worker's model to `version` (the one the node serves now if None) in place, feeding only the
        changed tensors, then release the old version. `model_load`: only when not loaded by `--load-format
        ferry`. Returns what was fed, for the caller to log."""
        check_in_place(self.vllm_config.model_config.quantization)
        model = self.model_runner.get_model()
        source = Source.from_config({"model_load": model_load, "namespace": namespace}) if model_load else None
        holder = holder_for(model, source)
        result = holder.load(model, version, only_changed=only_changed)
        holder.finish()
        return {
            "version": result.version,
            "versionUid": result.version_uid,
            "sent": len(result.sent),
            "skipped": len(result.skipped),
        }

    def ferry_version(self) -> str | None:
        """The Ferry version this worker's model holds (None if it holds none whole)."""
        holder = held(self.model_runner.get_model())
        return holder.version if holder else None
