"""A job's `peft:` section (torch-free, so the job's schema loads without torch; the adapters themselves:
`workload/adapters.py`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class PeftSettings(BaseModel):
    """A job's `peft:` section: the adapter `peft` wraps the model with (ZO then trains it alone)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["lora", "prefix", "qzo"] = "lora"
    """`lora` (low-rank adapters on `target_modules`), `prefix` (prefix tuning: `num_virtual_tokens`
    trained key/value vectors per layer, no reparameterisation) or `qzo` (QZO: the scales of a `quantization:`
    base's quantized layers, docs/quantized.md)."""
    r: int = Field(8, ge=1)
    """LoRA rank."""
    lora_alpha: float = Field(16.0, gt=0)
    """LoRA scaling numerator (the update is scaled by lora_alpha / r)."""
    target_modules: list[str] | None = None
    """LoRA: the module names (or name suffixes) to adapt; None takes peft's default for the architecture
    (e.g. q_proj and v_proj)."""
    num_virtual_tokens: int = Field(16, ge=1)
    """Prefix tuning: trained virtual tokens per layer."""

    def config(self, task_type: str):
        """The `peft` config object (`LoraConfig` or `PrefixTuningConfig`) for `task_type`."""
        from peft import LoraConfig, PrefixTuningConfig

        if self.method == "qzo":
            raise ValueError("QZO trains a quantized base's scales, not a peft adapter")
        if self.method == "lora":
            return LoraConfig(task_type=task_type, r=self.r, lora_alpha=self.lora_alpha, lora_dropout=0.0,
                              target_modules=self.target_modules)
        return PrefixTuningConfig(task_type=task_type, num_virtual_tokens=self.num_virtual_tokens,
                                  prefix_projection=False)
