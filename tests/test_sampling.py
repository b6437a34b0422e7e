"""Sampling's golden functions: greedy is argmax, draws follow the filtered softmax, seeds
replay, penalties match a hand-worked example, bad settings name their field."""
import math

import pytest
import torch

from dsv41.ops.sampling import RequestGenerator, SamplingParams, filtered_probs, sample

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0, 3.0, -2.0])


def draws(params, n, seed=7, logits=LOGITS):
    gen = RequestGenerator(seed)
    return [sample(logits, params, gen)[0] for _ in range(n)]


def test_greedy_is_argmax_of_the_raw_row():
    torch.manual_seed(0)
    row = torch.randn(129280)
    assert sample(row, SamplingParams(), None)[0] == int(torch.argmax(row))
    # ties: lowest id, as torch.argmax
    assert sample(LOGITS, SamplingParams(), None)[0] == 5 == int(torch.argmax(LOGITS))


def test_top_k_one_is_greedy():
    assert set(draws(SamplingParams(temperature=1.5, top_k=1), 50)) == {5}   # 5 ties with 6
    torch.manual_seed(1)
    row = torch.randn(1000)
    assert set(draws(SamplingParams(temperature=3.0, top_k=1), 20, logits=row)) == \
        {int(torch.argmax(row))}


def _softmax_restricted(keep, temperature):
    w = torch.zeros_like(LOGITS, dtype=torch.float64)
    for i in keep:
        w[i] = math.exp(LOGITS[i].item() / temperature)
    return w / w.sum()


@pytest.mark.parametrize("params, keep", [
    (SamplingParams(temperature=0.7), range(8)),
    (SamplingParams(temperature=1.0, top_k=3), [0, 5, 6]),
    (SamplingParams(temperature=1.0, top_k=1), [5]),
    # p = softmax(LOGITS): ids 5, 6 hold 0.752, id 0 0.138 more: 0.7 needs two, 0.8 three
    (SamplingParams(temperature=1.0, top_p=0.7), [5, 6]),
    (SamplingParams(temperature=1.0, top_p=0.8), [5, 6, 0]),
    (SamplingParams(temperature=1.0, min_p=0.3), [0, 5, 6]),     # e^-1 = 0.37 >= 0.3, e^-2 < 0.3
    (SamplingParams(temperature=2.0, min_p=0.3), [0, 1, 5, 6]),  # at T=2: e^-1 keeps id 1
])
def test_draws_follow_the_filtered_softmax(params, keep):
    expected = _softmax_restricted(keep, params.temperature)
    assert torch.allclose(filtered_probs(LOGITS, params), expected, atol=1e-12)
    n = 8000
    counts = torch.bincount(torch.tensor(draws(params, n)), minlength=8).double() / n
    assert counts[expected == 0].sum() == 0
    # total variation of n draws from an 8-way distribution: about sqrt(8 / n) / 2 = 0.016
    assert 0.5 * (counts - expected).abs().sum() < 0.035


def test_top_p_keeps_the_smallest_set_reaching_p():
    p = torch.softmax(LOGITS.double(), 0)
    mass_56 = (p[5] + p[6]).item()
    kept = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_p=mass_56 - 1e-9)) > 0
    assert kept.nonzero().flatten().tolist() == [5, 6]
    kept = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.01)) > 0
    assert kept.nonzero().flatten().tolist() == [5]    # of two equal tokens, the lower id


def test_same_seed_same_tokens_and_resume_mid_request():
    params = SamplingParams(temperature=1.0)
    assert draws(params, 40, seed=3) == draws(params, 40, seed=3)
    assert draws(params, 40, seed=3) != draws(params, 40, seed=4)
    first = draws(params, 40, seed=3)
    resumed = RequestGenerator(3, drawn=25)          # e.g. the request moved to another executor
    assert [sample(LOGITS, params, resumed)[0] for _ in range(15)] == first[25:]


def test_greedy_draws_nothing():
    gen = RequestGenerator(1)
    sample(LOGITS, SamplingParams(), gen)
    assert gen.drawn == 0


def test_penalties_hand_worked():
    """logits [2, -1, 0.5, 1]; prompt [3], output [0, 0, 1].
    repetition 2 on {0, 1, 3}: 2 -> 1, -1 -> -2, 1 -> 0.5; frequency 0.5 x count: id 0 -1, id 1
    -0.5; presence 0.25 on {0, 1}: 1 - 1 - 0.25 = -0.25, -2 - 0.5 - 0.25 = -2.75.
    Result [-0.25, -2.75, 0.5, 0.5]: greedy picks id 2 (tie with 3, lower id)."""
    row = torch.tensor([2.0, -1.0, 0.5, 1.0])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                            temperature=1.0)
    from dsv41.ops.sampling import apply_penalties
    out = apply_penalties(row, params, [0, 0, 1], prompt_ids=[3])
    assert out.tolist() == [-0.25, -2.75, 0.5, 0.5]
    greedy = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    assert sample(row, greedy, None, [0, 0, 1], [3])[0] == 2


def test_logprobs_are_of_the_raw_row():
    params = SamplingParams(temperature=0.5, top_k=2, logprobs=3)
    token, logprob, top = sample(LOGITS, params, RequestGenerator(0))
    raw = torch.log_softmax(LOGITS, 0)
    assert token in (5, 6) and logprob == pytest.approx(raw[token].item())
    assert [i for i, _ in top] == [5, 6, 0]
    assert [v for _, v in top] == pytest.approx([raw[5].item(), raw[6].item(), raw[0].item()])
    assert sample(LOGITS, SamplingParams(), None)[2] == []


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -0.1, r"temperature: expected a value in \[0.0, inf\]"),
    ("temperature", float("nan"), "temperature: expected a finite number"),
    ("top_p", 0.0, r"top_p: expected a value in \(0.0, 1.0\]"),
    ("top_p", 1.5, r"top_p: expected a value in \(0.0, 1.0\]"),
    ("top_k", -1, "top_k: expected an integer >= 0"),
    ("top_k", 2.5, "top_k: expected an integer"),
    ("min_p", 1.1, r"min_p: expected a value in \[0.0, 1.0\]"),
    ("seed", -1, r"seed: expected an integer in \[0, "),
    ("presence_penalty", 2.5, r"presence_penalty: expected a value in \[-2.0, 2.0\]"),
    ("frequency_penalty", -3, r"frequency_penalty: expected a value in \[-2.0, 2.0\]"),
    ("repetition_penalty", 0, r"repetition_penalty: expected a value in \(0.0, inf\]"),
    ("logprobs", 21, r"logprobs: expected an integer in \[0, 20\]"),
    ("logprobs", True, "logprobs: expected an integer"),
    ("max_tokens", 0, "max_tokens: expected an integer >= 1"),
    ("stop_token_ids", [1, -2], r"stop_token_ids\[1\]: expected an integer >= 0"),
    ("stop", ["ok", ""], r"stop\[1\]: expected a non-empty string"),
])
def test_validation_names_field_and_range(field, value, message):
    with pytest.raises(ValueError, match="^" + message):
        SamplingParams(**{field: value})


def test_valid_params_normalise():
    p = SamplingParams(temperature=1, stop="END", stop_token_ids=[1, 2])
    assert p.temperature == 1.0 and p.stop == ("END",) and p.stop_token_ids == (1, 2)
    with pytest.raises(ValueError, match="^generator: "):
        sample(LOGITS, p, None)
    with pytest.raises(ValueError, match="^logits: "):
        sample(LOGITS.view(2, 4), p, RequestGenerator(0))


def test_logit_bias_moves_the_argmax_and_the_draws():
    # 3 and 5 are the biggest (ties: 5); +2 on token 0 makes it the argmax, -100 on 5 leaves 6
    assert sample(LOGITS, SamplingParams(logit_bias={0: 2.0}), None)[0] == 0
    assert sample(LOGITS, SamplingParams(logit_bias={5: -100}), None)[0] == 6
    biased = SamplingParams(temperature=1.0, logit_bias={7: 100.0})
    assert set(draws(biased, 20)) == {7}
    # logprobs stay those of the raw row
    token, lp, _ = sample(LOGITS, SamplingParams(logit_bias={0: 2.0}, logprob=True), None)
    assert lp == pytest.approx(float(torch.log_softmax(LOGITS, -1)[0]))


def test_min_tokens_keeps_stop_ids_and_eos_from_being_drawn():
    p = SamplingParams(min_tokens=2, eos_token_id=5, stop_token_ids=(6,))
    assert sample(LOGITS, p, None, generated=0)[0] == 0       # 5 and 6 masked: the next best is 0
    assert sample(LOGITS, p, None, generated=1)[0] == 0
    assert sample(LOGITS, p, None, generated=2)[0] == 5       # min_tokens reached: the raw argmax
    # with ignore_eos, EOS is an ordinary token (not masked, not a stop id)
    q = SamplingParams(min_tokens=2, eos_token_id=5, ignore_eos=True)
    assert q.stop_ids == frozenset() and sample(LOGITS, q, None, generated=0)[0] == 5


def test_stops_honour_min_tokens_and_ignore_eos():
    from dsv41.ops.stopping import Stops
    s = Stops(SamplingParams(max_tokens=5, min_tokens=2, eos_token_id=1))
    s.push(1)                                 # before min_tokens: not an end (the sampler keeps it from being drawn)
    assert s.finish is None and s.tokens == [1]
    s.push(7)
    s.push(1)
    assert s.finish == "stop" and s.tokens == [1, 7]
    t = Stops(SamplingParams(max_tokens=3, ignore_eos=True, eos_token_id=1))
    for _ in range(3):
        t.push(1)
    assert t.finish == "length" and t.tokens == [1, 1, 1]


@pytest.mark.parametrize("fields, message", [
    ({"logit_bias": {3: 101}}, r"logit_bias\[3\]: expected a value in \[-100.0, 100.0\]"),
    ({"logit_bias": {-1: 1}}, r"logit_bias\[-1\]: expected an integer >= 0"),
    ({"logit_bias": [1, 2]}, "logit_bias: expected a map of token id to bias"),
    ({"min_tokens": 17}, r"min_tokens: expected an integer in \[0, 16\]"),
    ({"ignore_eos": 1}, "ignore_eos: expected true or false"),
])
def test_new_fields_name_field_and_range(fields, message):
    with pytest.raises(ValueError, match="^" + message):
        SamplingParams(**fields)


def test_stop_strings_count_from_min_tokens_on():
    """A stop string written before min_tokens tokens are out does not end the request later on
    (vLLM looks for stop strings only in text made from then on)."""
    from dsv41.ops.stopping import Stops
    words = {1: "ab", 2: "END", 3: "cd"}
    s = Stops(SamplingParams(max_tokens=9, min_tokens=2, stop=("END",)),
              decode_text=lambda ids: "".join(words[i] for i in ids))
    for t in (2, 1, 3):
        s.push(t)
    assert s.finish is None and s.text == "ENDabcd"
    s.push(2)
    assert s.finish == "stop" and s.text == "ENDabcd"


def test_speculative_sampling_rule_sees_the_row_edits():
    """A verify step of a sampling request with a drafter's distribution draws from the same edited
    rows as a plain step: +100 on token 3 makes every token 3, whatever the drafts."""
    from dsv41.ops.sampling import RowDraw
    from dsv41.engine.layout import StepLayout
    from dsv41.ops.verify import sampled_rule
    p = SamplingParams(temperature=1.0, seed=4, logit_bias={3: 100.0})
    rows = torch.stack([LOGITS] * 3)
    draws = [RowDraw(p, 4, j, generated=j) for j in range(3)]
    uniform = torch.full((2, LOGITS.numel()), 1 / LOGITS.numel(), dtype=torch.float64)
    for drafts in ([1, 2], [3, 5], [3, 3]):
        decided, _ = sampled_rule(rows, draws, StepLayout([0], [3], [drafts], [uniform]), None)
        made = decided[0]
        assert set(made) == {3} and len(made) == 1 + (drafts[0] == 3) + (drafts == [3, 3])
