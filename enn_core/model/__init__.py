"""The ENN model (no ranks, no meshes): `build_model(model_cfg, data_spec) -> ENN`, one builder
per preset (BUILDERS)."""

from enn_core.model.custom import ModelSpec
from enn_core.model.enn import (
    BUILDERS,
    ENN,
    PRESETS,
    CustomENN,
    PriorSize,
    SpatioTemporalENN,
    TabularENN,
    build_model,
    label_statistics,
)
from enn_core.model.layers import (
    get_attention_backend,
    set_attention_backend,
    use_attention_backend,
)
from enn_core.model_code import BUILTIN, ModelCode

__all__ = [
    "BUILDERS",
    "BUILTIN",
    "ENN",
    "CustomENN",
    "ModelCode",
    "ModelSpec",
    "PRESETS",
    "PriorSize",
    "SpatioTemporalENN",
    "TabularENN",
    "build_model",
    "get_attention_backend",
    "label_statistics",
    "set_attention_backend",
    "use_attention_backend",
]
