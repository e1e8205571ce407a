"""Doctor, kernels layer: which attention backend actually runs, and whether torch.compile
works (or why not).

- attention: `choose_attention` probes the backends as the trainer does; the model's forward
  then runs forced onto the chosen backend (sdpa_kernel raises when it cannot run there) and
  is compared with the math backend, so the reported backend is the one that ran. A fallback
  (the first candidate failed its probe) is a warning: it is the "slow run" of the risk map.
- compile: `maybe_compile` on the model with an example batch (20-30 s cold on a small CPU);
  skipped by --quick. A fall-back to eager is a warning with the compiler's reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from enn_core.doctor.context import DoctorContext
from enn_core.doctor.report import Check, Recorder
from enn_core.errors import EnnError
from enn_core.model import get_attention_backend, set_attention_backend
from enn_core.runtime.kernels import candidates, choose_attention, maybe_compile


def run(ctx: DoctorContext, *, compile_backend: str = "inductor") -> list[Check]:
    rec = Recorder("kernels")
    model: torch.nn.Module | None
    try:
        model = ctx.model()
    except EnnError as e:
        rec.add(
            "attention",
            "skip",
            f"no model to run attention in (model build failed: {str(e)[:120]})",
        )
        model = None
    attention(ctx, rec, model)
    if ctx.quick:
        rec.add("compile", "skip", "skipped by --quick (torch.compile takes 20-30 s cold)")
    elif model is not None:
        compile_check(ctx, rec, model, backend=compile_backend)
    return rec.checks


def attention(ctx: DoctorContext, rec: Recorder, model: torch.nn.Module | None) -> None:
    m = ctx.cfg.model
    dtype = ctx.precision_dtype()
    with rec.timer() as t:
        try:
            decision = choose_attention(
                ctx.cfg.train,
                ctx.device,
                dtype,
                heads=m.heads,
                head_dim=max(1, m.d_model // m.heads),
            )
        except EnnError as e:
            rec.add(
                "attention",
                "fail",
                str(e),
                "set train.attention=auto (or a backend that passed its probe)",
                t(),
            )
            return
        secs = t()
    probes = {n: ("ok" if p["ok"] else p["error"]) for n, p in decision.probes.items()}
    ran = ""
    if model is not None:
        ran, problem = run_forced(ctx, model, decision.backend)
        if problem:
            rec.add(
                "attention",
                "fail",
                f"{decision.backend} chosen but the model's forward on it failed: {problem}",
                "set train.attention=math and report the backend error",
                secs,
                backend=decision.backend,
                probes=probes,
            )
            return
    order, _ = candidates(ctx.device)
    first = order[0] if ctx.cfg.train.attention == "auto" else ctx.cfg.train.attention
    detail = f"{decision.backend} runs ({decision.reason}){ran}"
    if decision.backend != first:
        rec.add(
            "attention",
            "warn",
            f"fallback: {detail}",
            f"{first} failed its probe ({probes.get(first)}); "
            "check the torch/CUDA build or the head size "
            f"(d_model/heads={ctx.cfg.model.d_model // ctx.cfg.model.heads})",
            secs,
            backend=decision.backend,
            probes=probes,
        )
    else:
        rec.add("attention", "ok", detail, seconds=secs, backend=decision.backend, probes=probes)


def run_forced(ctx: DoctorContext, model: torch.nn.Module, backend: str) -> tuple[str, str]:
    """Forward forced onto `backend`, compared with math: (detail, problem or '')."""
    _, rows, _, _ = ctx.sample()
    x = torch.from_numpy(rows).to(ctx.device)
    before = get_attention_backend()
    try:
        with torch.no_grad():
            set_attention_backend(backend)
            got = model(x)
            set_attention_backend("math")
            ref = model(x)
    except RuntimeError as e:
        return "", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        set_attention_backend(before)
    diff = float((got.float() - ref.float()).abs().max())
    if not bool(torch.isfinite(got).all()):
        return "", "non-finite output"
    return f"; model forward on it matches math within {diff:.2g}", ""


def compile_check(
    ctx: DoctorContext,
    rec: Recorder,
    model: torch.nn.Module,
    backend: str | Callable[..., Any] = "inductor",
) -> None:
    _, rows, _, _ = ctx.sample()
    example = torch.from_numpy(rows).to(ctx.device)
    configured = f"train.compile={'true' if ctx.cfg.train.compile else 'false'} in the config"
    with rec.timer() as t:
        _, decision = maybe_compile(model, True, example, backend=backend)
        secs = t()
    torch._dynamo.reset()  # drop the doctor's graphs: the run compiles its own
    if decision.compiled:
        rec.add(
            "compile",
            "ok",
            f"torch.compile works: {decision.backend} graph matched eager on the sample "
            f"in {secs:.1f} s ({configured})",
            seconds=secs,
        )
    else:
        rec.add(
            "compile",
            "warn",
            f"{decision.reason} ({configured})",
            "keep train.compile=false, or fix the compiler (a C compiler on PATH, a writable "
            "TORCHINDUCTOR_CACHE_DIR / TMPDIR)",
            secs,
        )
