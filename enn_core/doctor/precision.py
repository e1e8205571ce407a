"""Doctor, precision layer: which dtypes the device runs (an autocast forward + backward of a
small layer, checked finite and close to fp32) and what `choose_precision` decides for the
configured train.precision, with its reason.

Emulated reduced precision (bf16 without native CPU instructions, any fp16 on CPU) is a
warning: it runs, usually slower than fp32.
"""

from __future__ import annotations

import torch

from enn_core.doctor.context import DoctorContext
from enn_core.doctor.report import Check, Recorder
from enn_core.errors import EnnError
from enn_core.runtime.precision import DTYPES, choose_precision, cpu_has_native_bf16

TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 1e-2}


def run(ctx: DoctorContext) -> list[Check]:
    rec = Recorder("precision")
    supported(ctx, rec)
    decision(ctx, rec)
    return rec.checks


def probe_dtype(name: str, device: torch.device) -> tuple[bool, str]:
    """Autocast forward + backward of a small linear layer in `name`; (works, detail)."""
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(32, 32).to(device)
    x = torch.randn(16, 32, generator=gen).to(device)
    with torch.no_grad():
        ref = layer(x)
    try:
        if name == "fp32":
            out = layer(x)
        else:
            with torch.autocast(device.type, dtype=DTYPES[name]):
                out = layer(x)
        out.float().square().mean().backward()
    except RuntimeError as e:
        return False, str(e).splitlines()[0][:120]
    err = float((out.detach().float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
    finite = bool(torch.isfinite(out).all()) and all(
        p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in layer.parameters()
    )
    if not finite or err > TOLERANCE[name]:
        return False, f"autocast {name}: relative error {err:.2g} or non-finite"
    return True, f"rel. err {err:.1g}"


def native(name: str, device: torch.device) -> str:
    if device.type == "cuda":
        if name == "bf16":
            return "native" if torch.cuda.is_bf16_supported() else "no bf16 on this GPU"
        return "native"
    if name == "bf16":
        return "native (avx512_bf16/amx)" if cpu_has_native_bf16() else "emulated"
    return "native" if name == "fp32" else "emulated"


def supported(ctx: DoctorContext, rec: Recorder) -> None:
    parts, data = [], {}
    with rec.timer() as t:
        for name in ("fp32", "bf16", "fp16"):
            works, why = probe_dtype(name, ctx.device)
            how = native(name, ctx.device) if works else f"fails ({why})"
            data[name] = {"works": works, "how": how}
            parts.append(f"{name} {how}")
        secs = t()
    extra = ""
    if ctx.device.type == "cuda":
        extra = f"; TF32 matmul {'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}"
    status = "ok" if data["fp32"]["works"] else "fail"
    rec.add(
        "dtypes",
        status,
        f"{ctx.device.type}: " + ", ".join(parts) + extra,
        "" if status == "ok" else "fp32 itself fails on this device: check the torch install",
        secs,
        **data,
    )


def decision(ctx: DoctorContext, rec: Recorder) -> None:
    asked = ctx.cfg.train.precision
    try:
        d = choose_precision(ctx.cfg.train, ctx.device)
    except EnnError as e:
        rec.add(
            "decision", "fail", str(e), "set train.precision=auto (or a dtype listed under dtypes)"
        )
        return
    detail = f"train.precision={asked} -> {d.name} ({d.reason})" + (
        "; gradient scaler on" if d.use_grad_scaler else ""
    )
    emulated = (
        ctx.device.type == "cpu" and d.name != "fp32" and native(d.name, ctx.device) == "emulated"
    )
    if emulated:
        rec.add(
            "decision",
            "warn",
            detail + f"; {d.name} is emulated on this CPU",
            "set train.precision=fp32 (or auto) on this machine: "
            "emulated autocast is slower than fp32",
            precision=d.name,
        )
    elif d.name == "fp16":
        rec.add(
            "decision",
            "warn",
            detail,
            "prefer train.precision=bf16 where supported (no loss scaling, fp32 range)",
            precision=d.name,
        )
    else:
        rec.add("decision", "ok", detail, precision=d.name)
