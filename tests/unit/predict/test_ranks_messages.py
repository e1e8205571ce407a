"""What node 1's rank says when a rank on another node died while node 1 waited at the final
barrier: the rank that went away and what is kept, never gloo's raw text (under
TORCH_DISTRIBUTED_DEBUG=DETAIL, "failed to pass monitoredBarrier in 7200000 ms", a timeout
that was never reached)."""

from __future__ import annotations

import types

import pytest

from enn_core.errors import WorkerError
from enn_core.predict import ranks


@pytest.mark.parametrize(
    ("raised", "said"),
    [
        (
            "[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 7200000 ms",
            "but rank 1 went away (its connection closed)",
        ),
        (
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
            "[198.18.4.3]:27041",
            "but the rank at 198.18.4.3 went away (connection closed)",
        ),
        ("something else entirely", "but another rank went away (something else entirely)"),
    ],
)
def test_a_peer_gone_at_the_barrier_is_one_line_naming_it(monkeypatch, raised, said):
    def barrier() -> None:
        raise RuntimeError(raised)

    monkeypatch.setattr(ranks.dist, "barrier", barrier)
    job = types.SimpleNamespace(rank=0, parts_dir="/shared/predict-parts/predict")
    with pytest.raises(WorkerError) as e:
        ranks.wait_for_the_others(job)  # type: ignore[arg-type]
    text = str(e.value)
    assert said in text and "7200000" not in text and "\n" not in text
    assert "the completed parts in /shared/predict-parts/predict are kept" in text
