"""LoRA adapters on the Wan DiT through peft (adaptive_load.lora): base weights frozen, adapters on named projections.

peft wraps every targeted nn.Linear in its lora.Linear, which adds B(A(dropout(x))) * alpha / r to the base output.
Two of the DiT's projections are nn.Linear subclasses whose input is not the input their weight multiplies:
- the attention output projection `o` (RowsLinear) may take a list of per-group attention outputs;
- the FFN's second linear `ffn.2` (GeluLinear) takes the pre-activation h and applies gelu(h) @ W inside one op.
peft's own layer would run the adapter on the list or on h (wrong: the adapter must see what W sees), so they get the
layers below, registered with peft's custom-module mapping; everything else is peft's lora.Linear as is.
"""
import re

import torch
import torch.nn.functional as F
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora.layer import Linear as LoraLinear

from ds_adaptiveload.model.gelu_linear import GeluLinear, gelu_linear
from ds_adaptiveload.model.packed_ops import RowsLinear
from ds_adaptiveload.model.packing import merge

ADAPTER = "default"  # peft's adapter name: state-dict keys read ...lora_A.default.weight


class _InputLoraLinear(LoraLinear):
    """peft's lora.Linear with the adapter applied to adapter_input(x), what the base weight multiplies."""

    def adapter_input(self, x):
        raise NotImplementedError

    def adapter_output(self, name: str, x) -> torch.Tensor:
        a = self.adapter_input(x)
        lora_a = self.lora_A[name]
        return self.lora_B[name](lora_a(self.lora_dropout[name](a.to(lora_a.weight.dtype))))

    def forward(self, x, *args, **kwargs):
        if self.disable_adapters or self.merged or kwargs.get("adapter_names") is not None:
            return super().forward(x, *args, **kwargs)
        result = self.base_layer(x)
        for name in self.active_adapters:
            if name in self.lora_A:
                result = result + (self.adapter_output(name, x) * self.scaling[name]).to(result.dtype)
        return result


class RowsLoraLinear(_InputLoraLinear):
    """LoRA for RowsLinear (the attention output projection): a list of parts is merged into [T, in] for the adapter."""

    def adapter_input(self, x):
        return merge(x).flatten(1) if isinstance(x, (list, tuple)) else x


class GeluLoraLinear(_InputLoraLinear):
    """LoRA for GeluLinear (the FFN's second linear): the adapter sees gelu(h), as the base weight does."""

    def adapter_input(self, h):
        return F.gelu(h, approximate="tanh")

    def adapter_output(self, name: str, h) -> torch.Tensor:
        lora_a = self.lora_A[name]
        partitioned = hasattr(lora_a.weight, "ds_id")  # ZeRO-3 gathers a weight only inside its module's call
        if isinstance(self.lora_dropout[name], torch.nn.Identity) and not partitioned:
            # A(gelu(h)) through the gelu_linear op: it keeps h (which the base op keeps too) and recomputes gelu(h)
            # in backward, where A(gelu(h)) would keep a [T, ffn_dim] tensor more per block.
            return self.lora_B[name](gelu_linear(h.to(lora_a.weight.dtype), lora_a.weight, None))
        return super().adapter_output(name, h)


CUSTOM_LAYERS = {RowsLinear: RowsLoraLinear, GeluLinear: GeluLoraLinear}


def target_pattern(settings) -> str:
    """The regular expression peft matches full module names against: the settings' projections in every block, and
    head.head for the target "head"."""
    blocks = [re.escape(m) for m in settings.modules() if m != "head"]
    parts = ([r"blocks\.\d+\.(" + "|".join(blocks) + ")"] if blocks else []) + \
        ([r"head\.head"] if "head" in settings.modules() else [])
    return "|".join(parts)


def peft_config(settings) -> LoraConfig:
    """peft's LoraConfig for adaptive_load.lora (train/config.LoraSettings)."""
    cfg = LoraConfig(r=settings.rank, lora_alpha=settings.alpha if settings.alpha is not None else settings.rank,
                     lora_dropout=settings.dropout, target_modules=target_pattern(settings), bias="none")
    cfg._register_custom_module(CUSTOM_LAYERS)
    return cfg


def apply_lora(model: torch.nn.Module, settings) -> torch.nn.Module:
    """Freeze every weight of `model`, then add trainable adapters (in place; returns the model). Run before
    deepspeed.initialize, which is then given the trainable parameters only (train/engine.build_engine)."""
    model.requires_grad_(False)
    inject_adapter_in_model(peft_config(settings), model, adapter_name=ADAPTER)
    return model


def is_adapter(name: str) -> bool:
    """A parameter name of an adapter weight (lora_A / lora_B)."""
    return ".lora_A." in name or ".lora_B." in name


def adapter_state(model: torch.nn.Module) -> dict:
    """The adapter weights as {name: tensor} (the module's own names)."""
    return {n: p for n, p in model.named_parameters() if is_adapter(n)}
