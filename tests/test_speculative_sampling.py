"""The speculative-sampling rule keeps the target distribution: a chi-square test over many
draws of a small vocabulary, with drafts drawn from a fixed distribution unlike the target."""
import torch

from dsv41.ops.verify import speculative_tokens

DRAWS = 20000


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square statistic (degrees of freedom: categories - 1)."""
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = probs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                          torch.tensor(stat / 2, dtype=torch.float64)))


def _run(target, draft, k: int, seed: int):
    rng = torch.Generator().manual_seed(seed)
    firsts, seconds = torch.zeros(target.shape[1], dtype=torch.float64), torch.zeros(target.shape[1],
                                                                                      dtype=torch.float64)
    for n in range(DRAWS):
        drafts = [int(torch.multinomial(draft[j], 1, generator=rng)) for j in range(k)]
        gens = lambda j: torch.Generator().manual_seed(seed * 1_000_003 + n * 17 + j)   # noqa: E731
        toks = speculative_tokens(target, draft, drafts, gens)
        firsts[toks[0]] += 1
        if len(toks) > 1 and toks[0] == drafts[0]:
            seconds[toks[1]] += 1
    return firsts, seconds


def test_first_token_follows_the_target_whatever_the_drafter():
    target = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.3, 0.3, 0.2]], dtype=torch.float64)
    draft = torch.tensor([[0.05, 0.15, 0.2, 0.3, 0.3]], dtype=torch.float64)
    firsts, seconds = _run(target, draft, 1, seed=1)
    p = chi_square_p(firsts, target[0])
    assert p > 1e-3, p                                   # stated: rejects a correct sampler 1 time in 1000
    # after an accepted draft the bonus token follows the next row's target
    assert chi_square_p(seconds, target[1]) > 1e-3
    # a sampler that keeps every draft is caught by the same test
    assert chi_square_p(torch.bincount(torch.multinomial(draft[0], DRAWS, replacement=True,
                                                         generator=torch.Generator().manual_seed(2)),
                                       minlength=5).double(), target[0]) < 1e-6


def test_identical_draft_and_target_accept_every_draft():
    target = torch.tensor([[0.25, 0.25, 0.5], [0.2, 0.3, 0.5], [0.6, 0.2, 0.2]], dtype=torch.float64)
    gens = lambda j: torch.Generator().manual_seed(j)   # noqa: E731
    assert speculative_tokens(target, target[:2], [2, 1], gens)[:2] == [2, 1]
