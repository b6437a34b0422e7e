"""The hyper-connection sites (mixes, pre, post, head) and the RMS norms between them."""
from __future__ import annotations

from dsv41.kernels.cost import Cost, meta, reads
from dsv41.kernels.record import NodeKind
from dsv41.model.finite import ensure_finite
from dsv41.model.dspark import block_prefix
from dsv41.model.hyper import HyperSite
from dsv41.ops.norm import rms_norm


def hc_mixes(st, node, x):
    return st.model.block(node.layer).sites[node.attrs["site"]].mixes(x)


def hc_mixes_cost(ctx, node, x):
    cfg, (t, hc, d) = ctx.cfg, x.shape
    k = lambda n: f"{block_prefix(cfg, node.layer)}hc_{node.attrs['site']}_{n}"
    sinkhorn = 4 * cfg.hc_sinkhorn_iters * t * hc * hc
    return Cost((meta(t, hc), meta(t, hc), meta(t, hc, hc)), weights=reads(k("fn"), k("scale"), k("base")),
                flops={"dense": 2 * t * hc * d * cfg.mix_hc, "vector": 3 * t * hc * d + sinkhorn})


def _pre_weights(st, node, x, mixes):
    """The pre weights: uniform at the first site (no mixes yet), else the site's own."""
    return HyperSite.initial_pre(x.shape[0], st.cfg.hc_mult) if node.attrs.get("initial") else mixes[0][0]


def hc_pre(st, node, x, *mixes):
    return HyperSite.pre(x, _pre_weights(st, node, x, mixes))


def hc_head(st, node, x, mixes):
    return HyperSite.head(x, mixes[0])


def hc_pre_cost(ctx, node, x, *mixes):
    t, hc, d = x.shape
    return Cost(meta(t, d), flops={"vector": 2 * t * hc * d})


def hc_pre_pypto(st, node, x, *mixes):
    return "hc.pre", {"x_hc": x, "pre": _pre_weights(st, node, x, mixes)}, {}, {}, lambda o: o["y"].float()


def hc_post(st, node, sub, x, mixes):
    """The stream handed to the next site, checked finite here (one reduction: model.finite)."""
    _, post, comb = mixes
    return ensure_finite(HyperSite.post(sub, x, post, comb), node.layer, node.attrs["site"], st.cfg.num_hidden_layers)


def hc_post_cost(ctx, node, sub, x, mixes):
    t, hc, d = x.shape
    return Cost(meta(t, hc, d), flops={"vector": 2 * t * hc * hc * d + 3 * t * hc * d})


def hc_post_pypto(st, node, sub, x, mixes):
    return "hc.post", {"sub": sub, "x_hc": x, "post": mixes[1], "comb": mixes[2]}, {}, {}, \
        lambda o: o["out"].float().reshape(x.shape)


def norm(st, node, x):
    return rms_norm(x, st.weights[node.attrs["weight"]], st.cfg.rms_norm_eps)


def norm_cost(ctx, node, x):
    return Cost(meta(*x.shape), weights=reads(node.attrs["weight"]), flops={"vector": 4 * x.numel()})


def norm_pypto(st, node, x):
    return "norm.rms", {"x": x, "w": st.weights[node.attrs["weight"]]}, {"eps": st.cfg.rms_norm_eps}, {}, \
        lambda o: o["y"].float()


def _first_rows(st, node, args):
    return args[0].shape[0]


def norm_parts(cfg, rows, tp, ep):
    return [("norm.rms", dict(T=rows, D=cfg.hidden_size))]


def pre_parts(cfg, rows, tp, ep):
    return [("hc.pre", dict(T=rows, hc=cfg.hc_mult, D=cfg.hidden_size))]


def post_parts(cfg, rows, tp, ep):
    return [("hc.post", dict(T=rows, hc=cfg.hc_mult, D=cfg.hidden_size))]


RECORDS = (
    NodeKind("hc.mixes", hc_mixes, hc_mixes_cost, launches=(3, "mix GEMM, Sinkhorn normalisation, split"),
             comm="none", no_pypto_parts="no pypto kernel for the mix GEMM and Sinkhorn normalisation"),
    NodeKind("hc.pre", hc_pre, hc_pre_cost, launches=(1, "weighted stream reduction"), comm="none",
             pypto=hc_pre_pypto, pypto_parts=pre_parts, sim_rows=_first_rows),
    NodeKind("hc.head", hc_head, hc_pre_cost, launches=(1, "weighted stream reduction"), comm="none",
             pypto=hc_pre_pypto, pypto_parts=pre_parts, sim_rows=_first_rows),
    NodeKind("hc.post", hc_post, hc_post_cost, launches=(1, "weighted stream update"), comm="none",
             pypto=hc_post_pypto, pypto_parts=post_parts, sim_rows=lambda st, node, args: args[1].shape[0]),
    NodeKind("norm.rms", norm, norm_cost, launches=(1, "fused RMSNorm"), comm="none", pypto=norm_pypto,
             pypto_parts=norm_parts, sim_rows=_first_rows),
    NodeKind("norm.final", norm, norm_cost, launches=(1, "fused RMSNorm"), comm="none", pypto=norm_pypto,
             pypto_parts=norm_parts, sim_rows=_first_rows),
)
