"""The ENN model (no ranks, no meshes): `build_model(model_cfg, manifest) -> ENN`."""

from enn_core.model.enn import (
    ENN,
    PRESETS,
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

__all__ = [
    "ENN",
    "PRESETS",
    "SpatioTemporalENN",
    "TabularENN",
    "build_model",
    "get_attention_backend",
    "label_statistics",
    "set_attention_backend",
    "use_attention_backend",
]
