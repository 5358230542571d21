"""The data-parallel memory plan (``memory/distributed.py``) and ``megatrain estimate --world-size``."""

from __future__ import annotations

import json

import pytest

from megatrain_hf.cli.estimate import estimate_main
from megatrain_hf.core.layout import lay_out
from megatrain_hf.memory import PRESETS, plan_memory
from megatrain_hf.memory.distributed import plan_ranks
from megatrain_hf.memory.plan import _DTYPE_BY_NAME, LORA_TARGETS, _layout
from megatrain_hf.errors import MegatrainConfigError


def _plan(**kw):
    return plan_memory(PRESETS["llama-7b"], seq_len=4096, micro_batch=1, **kw)


def test_one_rank_is_the_single_gpu_plan():
    plan = _plan()
    ranks = plan_ranks(plan, 1)
    assert ranks.rank_bytes == (plan.host_total,) and ranks.host_bytes == (plan.host_total,)
    assert ranks.gpu_bytes == plan.gpu_total


def test_ranks_hold_their_units_once_plus_receive_slots():
    plan = _plan()
    ranks = plan_ranks(plan, 4, nodes=2)
    units = [lay_out(u.specs(_DTYPE_BY_NAME["bf16"])) for u in _layout(plan.shape, None, LORA_TARGETS)]
    largest_remote = [max(s.n_train for u, s in enumerate(units) if u % 4 != r and s.n_train) for r in range(4)]
    for r in range(4):
        assert ranks.slot_bytes[r] >= 8 * 4 * largest_remote[r]  # 3 master + 5 gradient slots, fp32
    owned = sum(ranks.rank_bytes) - sum(ranks.slot_bytes)
    assert owned == plan.host_total  # every unit's state once over the ranks (untied: no replica)
    assert ranks.host_bytes == (ranks.rank_bytes[0] + ranks.rank_bytes[1], ranks.rank_bytes[2] + ranks.rank_bytes[3])


def test_bad_world_sizes_are_refused_with_the_fix():
    with pytest.raises(MegatrainConfigError, match="divides world_size=3"):
        plan_ranks(_plan(), 3, nodes=2)
    with pytest.raises(MegatrainConfigError, match="world_size=0"):
        plan_ranks(_plan(), 0)


def test_estimate_prints_per_rank_and_per_host(capsys):
    assert estimate_main(["--model", "llama-7b", "--world-size", "4", "--nodes", "2", "--host-gib", "512"]) == 0
    out = capsys.readouterr().out
    assert "DATA PARALLEL: 4 ranks on 2 host(s)" in out and "host 1" in out and "each GPU" in out
    assert estimate_main(["--model", "llama-7b", "--world-size", "2", "--json", "--host-gib", "512"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["ranks"]["rank_bytes"]) == 2 and data["fits_host"] is True
    assert estimate_main(["--model", "llama-7b", "--world-size", "3", "--nodes", "2"]) == 2
