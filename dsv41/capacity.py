"""A deployment's capacity contract: how much one DP group's step and request table hold.

These are serving limits, not the model's math: the seed's contract on FLASH is 32 requests per DP
group, 6 rows per decode request (1 target + 5 drafts: 192 decode rows) and 4,096 prefill rows per
step. The engines, the scheduler, the command line's range checks and ``--plan`` read them here; a
checkpoint keeps them in its ``config.json``'s ``dsv41`` section (``checkpoint.config_json``).
"""
from __future__ import annotations

from dataclasses import dataclass

from dsv41.config import ConfigError, ModelConfig

# past these a step asks for gigabytes of metadata or hangs enumerating rows; each holds FLASH's value
# with room (a request's drafts past tens are never accepted: acceptance falls geometrically)
LIMITS = {"max_batch_per_dp": 65536, "decode_rows_per_request": 64, "prefill_max_tokens": 1 << 24}


@dataclass(frozen=True)
class Capacity:
    """Per DP group: the requests it holds at once, the rows a decode step gives each of them, and
    the rows a prefill step feeds (``--max-num-batched-tokens`` is at most this)."""
    max_batch_per_dp: int = 32
    decode_rows_per_request: int = 6     # 1 target + 5 draft rows
    prefill_max_tokens: int = 4096

    @property
    def decode_max_tokens(self) -> int:
        """Rows of a decode step per DP group."""
        return self.max_batch_per_dp * self.decode_rows_per_request

    @property
    def max_drafts(self) -> int:
        """Drafts a request may verify in one decode step."""
        return self.decode_rows_per_request - 1

    def step_limit(self, phase: str) -> int:
        """Rows a step of this phase may feed per DP group."""
        return self.prefill_max_tokens if phase == "prefill" else self.decode_max_tokens

    def validate(self) -> Capacity:
        """Raise ConfigError naming the field and its range."""
        for name, top in LIMITS.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= top:
                raise ConfigError(f"capacity.{name}: must be in [1, {top}], got {v}", name)
        return self


FLASH_CAPACITY = Capacity().validate()
CAPACITIES = {"tiny": Capacity(max_batch_per_dp=8, prefill_max_tokens=512).validate(),
              "small": Capacity(max_batch_per_dp=16, prefill_max_tokens=2048).validate(),
              "flash": FLASH_CAPACITY}


def capacity_of(cfg: ModelConfig, checkpoint=None) -> Capacity:
    """The capacity a model runs with: an opened checkpoint folder's (its config.json), else the
    preset's its name starts with (``tiny``, ``flash-L4-E8``: a reduction keeps its preset's), else
    FLASH's. A weight source without limits of its own (drawn weights) runs with the preset's."""
    held = getattr(checkpoint, "capacity", None)
    if held is not None:
        return held
    return CAPACITIES.get(cfg.name.split("-")[0], FLASH_CAPACITY)
