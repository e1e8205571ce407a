"""Precision policy: fp32, bf16 or fp16 autocast, chosen from config and device support.

`choose_precision(train_cfg, device)` returns the decision with its reason. Master weights
stay fp32; autocast covers the model body only: the model's head (enn_core.model.layers.
FP32Head) and the losses (enn_core.losses) switch autocast off and compute in fp32. fp16
uses a gradient scaler; bf16 does not need one (fp32's exponent range).

    decision = choose_precision(cfg.train, device)
    scaler = decision.grad_scaler()          # None unless fp16
    with decision.autocast():
        pred = model(x)
    loss = loss_fn(pred, y)                  # fp32 whatever the autocast
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from enn_core.errors import ConfigError

if TYPE_CHECKING:
    from enn_core.config.train import TrainConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionDecision:
    name: str  # "fp32" | "bf16" | "fp16"
    dtype: torch.dtype
    reason: str
    use_grad_scaler: bool
    device_type: str

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """The autocast context of the forward pass (a no-op for fp32)."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """A gradient scaler for fp16, None otherwise."""
        return torch.amp.GradScaler(self.device_type) if self.use_grad_scaler else None

    def as_record(self) -> dict[str, str | bool]:
        return {
            "precision": self.name,
            "precision_reason": self.reason,
            "grad_scaler": self.use_grad_scaler,
        }


Decision = PrecisionDecision


@contextlib.contextmanager
def fp32_region(device_type: str) -> Iterator[None]:
    """Autocast off (for the head and the loss); cast inputs with .float() inside."""
    if torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type=device_type, enabled=False):
            yield
    else:
        yield


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 instructions (avx512_bf16 / amx); else bf16 is emulated."""
    probe = getattr(torch.backends.cpu, "get_cpu_capability", None)
    cap = probe() if probe else ""
    flags = ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            flags = f.read(1 << 16)
    return "avx512_bf16" in flags or "amx_bf16" in flags or "AMX" in str(cap)


def choose_precision(train_cfg: TrainConfig, device: torch.device | str) -> PrecisionDecision:
    """fp32 / bf16 / fp16 from train.precision and what the device supports, with the reason."""
    device = torch.device(device)
    asked = train_cfg.precision
    if device.type == "cuda":
        return _cuda(asked, device)
    if device.type != "cpu":
        if asked not in ("auto", "fp32"):
            raise ConfigError(
                f"train.precision={asked} on device {device}: only fp32 is supported there; "
                "set train.precision=fp32"
            )
        return PrecisionDecision(
            "fp32", torch.float32, f"device {device.type}: fp32 only", False, device.type
        )
    if asked in ("auto", "fp32"):
        why = (
            "train.precision=fp32"
            if asked == "fp32"
            else "auto on CPU: fp32 (autocast is opt-in on CPU; set train.precision=bf16 to use it)"
        )
        return PrecisionDecision("fp32", torch.float32, why, False, "cpu")
    if asked == "bf16":
        native = (
            "native bf16 instructions"
            if cpu_has_native_bf16()
            else "no native bf16 instructions (emulated, may be slower)"
        )
        return PrecisionDecision(
            "bf16", torch.bfloat16, f"train.precision=bf16 on CPU ({native})", False, "cpu"
        )
    return PrecisionDecision(
        "fp16",
        torch.float16,
        "train.precision=fp16 on CPU (emulated; gradient scaler on)",
        True,
        "cpu",
    )


def _cuda(asked: str, device: torch.device) -> PrecisionDecision:
    bf16_ok = torch.cuda.is_bf16_supported()
    name = torch.cuda.get_device_name(device)
    if asked == "fp32":
        return PrecisionDecision("fp32", torch.float32, "train.precision=fp32", False, "cuda")
    if asked == "bf16" and not bf16_ok:
        raise ConfigError(
            f"train.precision=bf16 but {name} has no bf16 support; set train.precision=fp16 or fp32"
        )
    if asked == "bf16" or (asked == "auto" and bf16_ok):
        why = "train.precision=bf16" if asked == "bf16" else f"auto: {name} supports bf16"
        return PrecisionDecision("bf16", torch.bfloat16, why, False, "cuda")
    why = "train.precision=fp16" if asked == "fp16" else f"auto: {name} lacks bf16, fp16"
    return PrecisionDecision("fp16", torch.float16, why + " with gradient scaler", True, "cuda")
