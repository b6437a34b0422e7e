"""A hyper-connection site: the 4-lane residual stream's mixes before a sub-layer (collapse with the
delayed pre mix, expand with post/comb after it) and the final collapse before the head."""
from __future__ import annotations

import torch

from dsv41.config import ModelConfig
from dsv41.ops import mhc
from dsv41.ops.packed import matrix

SITES = ("attn", "ffn")


class HyperSite:
    def __init__(self, cfg: ModelConfig, layer: int, site: str, weights, block: str | None = None):
        """block: the weight-name prefix of the block (``layers.L.`` unless given, ``mtp.S.`` for DSpark)."""
        if site not in SITES:
            raise ValueError(f"site: must be one of {SITES}, got {site!r}")
        self.cfg, self.layer, self.site, self.weights = cfg, layer, site, weights
        self.block = block if block is not None else f"layers.{layer}."

    @staticmethod
    def key(layer: int, site: str, name: str) -> str:
        return f"layers.{layer}.hc_{site}_{name}"

    @staticmethod
    def tensors(cfg: ModelConfig, layer: int, site: str, block: str | None = None):
        prefix = block if block is not None else f"layers.{layer}."
        k = lambda n: f"{prefix}hc_{site}_{n}"
        yield k("fn"), (cfg.mix_hc, cfg.hc_dim), "f32", 0.5 * cfg.hc_dim ** -0.5, 0.0
        yield k("scale"), (3,), "f32", 0.1, 1.0
        yield k("base"), (cfg.mix_hc,), "f32", 0.5, 0.0

    def mixes(self, x_hc):
        """(pre, post, comb) of this site from the stream entering it."""
        w, cfg = lambda n: self.weights[f"{self.block}hc_{self.site}_{n}"], self.cfg
        return mhc.hc_mixes(x_hc, matrix(self.weights, f"{self.block}hc_{self.site}_fn"), w("scale"), w("base"),
                            cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)

    pre = staticmethod(mhc.hc_pre)          # (x_hc, pre) -> the collapsed sub-layer input
    post = staticmethod(mhc.hc_post)        # (sub, x_hc, post, comb) -> the new stream
    head = staticmethod(mhc.hc_head)        # (x_hc, last pre) -> the final collapse

    @staticmethod
    def initial_pre(t: int, hc: int) -> torch.Tensor:
        """The pre mix of the first collapse (no earlier site)."""
        return mhc.initial_pre(t, hc)
