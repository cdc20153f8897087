"""Turn rows of logits into tokens: greedy, or temperature / top-k / top-p / min-p with a seed.

A step's rows are sampled in one call (sample_rows): each request's penalties and logit bias (process),
its grammar's mask (grammar.apply_masks), then its sampler, all on a copy made only when some row is
processed, so logprobs read the model's own logits.

The random stream of a seeded request depends only on (seed, position), so a stream
resumed on another replica after a failover draws the same tokens it would have drawn.

Sampling never sorts the vocabulary (151,936 logits a row for Qwen: a sort cost ~25 ms a row, more
than the model's step).  A row with top_p, top_k or min_p takes its CANDIDATES most likely tokens
(one partial selection, all rows at once) and normalizes them against the whole vocabulary's
logsumexp; when those candidates hold the nucleus (their mass reaches top_p, top_k is within them,
or min_p's threshold falls inside them) the row is finished among them, which is exact; otherwise it
tries again with WIDEST candidates (a flat row), and only then takes `flat_filter` (the same cut, found by
binning the whole row's probabilities; the sort of `filter_logits` is the reference, and tests compare them).
Either way the token is drawn by inverse CDF over the kept tokens in token-id order with the row's one
uniform draw, so the same seed gives the same token on either path (up to float rounding at a bucket's edge).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Sequence, Set

import torch

from meshkernels import cpu_ops
from services.engine.core.request import EngineTokenLogprob, Request, SamplingParams
from services.engine.runtime import grammar


def step_generator(seed: int | None, position: int) -> torch.Generator | None:
    """The generator of a seeded row's draw at `position`: a hash of both, so no two seeds (uint64) share a
    stream (an earlier `(seed * k + position) mod 2^63-1` gave seeds 1 and 2^63 the same text)."""
    if seed is None:
        return None
    key = hashlib.blake2b(seed.to_bytes(8, "little") + position.to_bytes(8, "little"), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(key, "little"))


def process(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int],
            ended_by: Collection[int]) -> torch.Tensor:
    """One row's logits as the request's processors leave them (a new tensor; `logits` is kept for
    logprobs): min_tokens bans `ended_by` (end-of-sequence and stop ids) until that many are out;
    logit_bias adds; repetition_penalty divides positive logits (multiplies negative ones) of tokens in
    the prompt or output; frequency and presence penalties subtract count x frequency + presence for
    each token generated so far (OpenAI's definition); bad_words_ids end where they would be completed.
    logits: (V,) float32."""
    out = logits.clone()
    vocab = out.shape[0]
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64)
        out.index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias], dtype=out.dtype))
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.int64)
        if seen.numel():
            values = out[seen]
            out[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.int64), minlength=vocab).to(out.dtype)
        out -= counts * params.frequency_penalty + (counts > 0).to(out.dtype) * params.presence_penalty
    if params.min_tokens and len(output_ids) < params.min_tokens and ended_by:
        out[torch.tensor(sorted(ended_by), dtype=torch.int64)] = float("-inf")
    for *before, last in params.bad_words_ids:       # a bad word's last token, where the rest was just generated
        if last < vocab and (not before or list(output_ids[-len(before):]) == before):
            out[last] = float("-inf")
    return out


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Scaled and masked logits; masked entries are -inf.  logits: (V,) float32."""
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already reaches top_p; the first always stays.
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        # Tokens whose probability is below min_p x the most likely one's (after temperature).
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return scaled


def flat_filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """filter_logits without sorting the vocabulary, for a row whose nucleus reaches past WIDEST candidates (a
    flat row: the sort of 151,936 logits cost ~10 ms, 20x this).  top_p's cut is found by binning: the row's
    probabilities go into BINS buckets by value with their mass, the bucket where the mass from the top reaches
    top_p is the band the cut lies in, binned again while it holds more than BAND tokens, then sorted alone for
    the exact cut.  The tokens the sort keeps, but for those at the cut whose cumulative mass rounds the other way
    in float32 (a few of ~1e-5 each: the two sum in different orders) and ties (the sort's order among them is
    arbitrary too).  logits: (V,) float32."""
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        probs = torch.softmax(scaled, dim=-1)
        lo, hi = 0.0, float(probs.max()) * (1 + 1e-6)    # the cut is in [lo, hi); mass(p >= hi) = above
        above = 0.0
        band = probs
        for _ in range(8):                                # each pass narrows [lo, hi) BINS-fold
            if band.numel() <= BAND or hi <= lo:
                break
            width = (hi - lo) / BINS
            bucket = ((band - lo) / width).long().clamp_(0, BINS - 1)
            mass = torch.zeros(BINS, dtype=torch.float64).index_add_(0, bucket, band.double())
            from_top = above + mass.flip(0).cumsum(0).flip(0)    # mass of buckets b and above
            b = int((from_top >= params.top_p).nonzero().max()) if bool((from_top >= params.top_p).any()) else 0
            above = float(from_top[b + 1]) if b + 1 < BINS else above
            lo, hi = lo + b * width, lo + (b + 1) * width
            band = band[bucket == b]
        ordered = torch.sort(band, descending=True).values    # the band, most likely first
        before = above + (ordered.double().cumsum(dim=-1) - ordered.double())
        kept = ordered[before < params.top_p]
        cut = float(kept[-1]) if kept.numel() else hi
        scaled = scaled.masked_fill(probs < cut, float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return scaled


BINS = 4096          # flat_filter's buckets a pass
BAND = 4096          # flat_filter sorts the tokens near top_p's cut once they are this few


CANDIDATES = 256     # the first guess at a row's nucleus (top_p 0.95 at temperature 0.7 keeps tens of tokens)
WIDEST = 4096        # the second (a flat row: a 152k sort costs ~25 ms, a 4,096-token selection ~1 ms)


def _draw(params: SamplingParams, position: int) -> float:
    return float(torch.rand((), generator=step_generator(params.seed, position)))


def inverse_cdf(ids: torch.Tensor, weights: torch.Tensor, u: float) -> int:
    """The token of `ids` (ascending) whose bucket of the cumulative `weights` holds u x total: never one
    of weight 0, so a masked token is never chosen."""
    cdf = weights.cumsum(dim=-1)
    k = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if k >= cdf.numel():                     # u * total rounded up to the total itself
        k = int(torch.nonzero(weights > 0).max())
    return int(ids[k])


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """logits: (V,) float32 for one sequence; position: index of the token being generated."""
    if params.greedy:
        return int(torch.argmax(logits))
    return _draw_rows(logits.unsqueeze(0), [params], [position])[0]


def reference_sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """What `sample` computes, the plain way: filter the whole vocabulary (a sort for top_p), then the
    inverse CDF over it.  The tests hold the fast path to it."""
    if params.greedy:
        return int(torch.argmax(logits))
    return _draw_filtered(filter_logits(logits, params), params, position)


def _draw_filtered(filtered: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token of a filtered row (-inf: out) by inverse CDF in token-id order, with the position's draw."""
    probs = torch.softmax(filtered, dim=-1)
    return inverse_cdf(torch.arange(probs.numel()), probs, _draw(params, position))


def _draw_rows(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> list[int]:
    """logits: (R, V) float32, every row sampled (none greedy)."""
    vocab = logits.shape[-1]
    out = [0] * len(params)
    narrowed = [i for i, p in enumerate(params) if (0.0 < p.top_p < 1.0) or (0 < p.top_k < vocab) or p.min_p > 0]
    whole = sorted(set(range(len(params))) - set(narrowed))
    if whole:                                # temperature alone: the whole vocabulary, in id order
        tokens = _whole(logits[whole], [params[i] for i in whole], [_draw(params[i], positions[i]) for i in whole])
        for i, token in zip(whole, tokens, strict=True):
            out[i] = token
    wider = CANDIDATES
    while narrowed:                          # a row whose nucleus reaches past its candidates tries again
        chosen = [params[i] for i in narrowed]           # with 16x as many, then takes the sort
        rows = logits if len(narrowed) == len(params) else logits[narrowed]
        tokens = _among(rows, chosen, [_draw(params[i], positions[i]) for i in narrowed], wider)
        for row, i in enumerate(narrowed):
            out[i] = tokens[row]
        narrowed = [i for row, i in enumerate(narrowed) if tokens[row] < 0]
        wider *= 16
        if wider > WIDEST or wider >= vocab:
            for i in narrowed:
                out[i] = _draw_filtered(flat_filter(logits[i], params[i]), params[i], positions[i])
            break
    return out


def _fused(logits: torch.Tensor) -> bool:
    """Whether the CPU library's sampling ops take these logits (else the torch path)."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_ops.load()


def _whole(logits: torch.Tensor, params: Sequence[SamplingParams], draws: Sequence[float]) -> list[int]:
    """Temperature-only rows: the inverse CDF of softmax(logits / T) over the whole vocabulary, in id order."""
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    if _fused(logits):
        out = torch.empty(len(params), dtype=torch.int64)
        torch.ops.infermesh.sample_whole(logits.contiguous(), temps, torch.tensor(draws, dtype=torch.float32), out)
        return out.tolist()
    probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
    ids = torch.arange(logits.shape[-1])
    return [inverse_cdf(ids, probs[row], u) for row, u in enumerate(draws)]


def candidates(logits: torch.Tensor, temps: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's k most likely tokens, most likely first: (values (R, k) = logit / T, -inf past a row's
    candidates; ids (R, k), -1 there; lse (R,) = logsumexp(logits / T) over the whole vocabulary).  The CPU
    library's sample_candidates where it runs (it may return fewer than k: every token a row's candidates
    leave out is e^-20 as likely as its first), else `candidates_reference`."""
    if not _fused(logits):
        return candidates_reference(logits, temps, k)
    rows = logits.shape[0]
    values, ids = torch.empty(rows, k), torch.empty(rows, k, dtype=torch.int64)
    lse, counts = torch.empty(rows), torch.empty(rows, dtype=torch.int64)
    torch.ops.infermesh.sample_candidates(logits.contiguous(), temps, values, ids, lse, counts)
    return values, ids, lse


def candidates_reference(logits: torch.Tensor, temps: torch.Tensor, k: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`candidates` with torch's topk and logsumexp: always k per row."""
    raw, ids = torch.topk(logits, k, dim=-1)                    # the same order at any temperature
    t = temps.unsqueeze(1)
    return raw / t, ids, torch.logsumexp(logits / t, dim=-1)


def _kept(logits: torch.Tensor, params: Sequence[SamplingParams], count: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's filtered candidates, all rows at once: (ids (R, k) in token-id order, their unnormalized
    weights (0: filtered out), decided (R,): False for a row whose nucleus may reach past them).  The same
    filters as filter_logits, in order: top_k, then top_p over what top_k kept (renormalized), then min_p
    against the most likely.  logits: (R, V)."""
    vocab = logits.shape[-1]
    k = min(vocab, max(count or CANDIDATES, *(p.top_k for p in params)))
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    values, ids, whole_lse = candidates(logits, temps, k)       # (R, k), most likely first
    found = torch.isfinite(values)                               # the library may return fewer than k
    top_k = torch.tensor([p.top_k if 0 < p.top_k < k else k for p in params]).unsqueeze(1)
    cut_k = torch.tensor([0 < p.top_k < vocab for p in params])
    in_k = (torch.arange(k).unsqueeze(0) < top_k) & found        # (R, k)
    # Normalizer: top_k's own set where it cuts, else the whole vocabulary's.
    lse = torch.where(cut_k, torch.logsumexp(values.masked_fill(~in_k, float("-inf")), dim=-1), whole_lse)
    probs = torch.exp(values - lse.unsqueeze(1)).masked_fill(~in_k, 0.0)
    top_p = torch.tensor([p.top_p if 0.0 < p.top_p < 1.0 else 2.0 for p in params])
    in_p = (probs.cumsum(dim=-1) - probs) < top_p.unsqueeze(1)   # the first always stays (its mass before is 0)
    min_p = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params])
    in_min = values >= values[:, :1] + min_p.unsqueeze(1)        # p >= min_p x p_max, in logits
    keep = in_k & in_p & in_min
    # A row is decided among its candidates when they hold the whole vocabulary, top_k cut within them,
    # top_p's mass was reached within them, or min_p's threshold fell within them (with no top_p): the last
    # candidate found is already out.  Else the nucleus may reach past them (the caller widens or sorts).
    last = (found.sum(dim=-1) - 1).clamp(min=0).unsqueeze(1)
    has_p = top_p <= 1.0
    decided = (cut_k | (k >= vocab) | (has_p & ~in_p.gather(1, last).squeeze(1))
               | (~has_p & (min_p > -math.inf) & ~in_min.gather(1, last).squeeze(1)))
    weights = torch.exp(values - values[:, :1]).masked_fill(~keep, 0.0)
    order = torch.argsort(ids.masked_fill(~found, vocab), dim=-1)  # token-id order: the reference's CDF order
    return ids.gather(1, order), weights.gather(1, order), decided


def _among(logits: torch.Tensor, params: Sequence[SamplingParams], draws: Sequence[float],
           count: int = 0) -> list[int]:
    """Each row's token drawn among its most likely candidates (_kept), all rows at once, or -1 for a row
    whose nucleus may reach past them.  logits: (R, V)."""
    ids, weights, decided = _kept(logits, params, count)
    k = ids.shape[1]
    cdf = weights.cumsum(dim=-1)
    u = torch.tensor(draws, dtype=cdf.dtype).unsqueeze(1)
    pick = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    final = (weights > 0).long().cumsum(dim=-1).argmax(dim=-1)   # the last kept: a draw rounded up to the total
    pick = torch.where(pick >= k, final, pick)
    tokens = ids.gather(1, pick.unsqueeze(1)).squeeze(1)
    return torch.where(decided, tokens, -1).tolist()


def distributions(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """(R, V) float32: each row's sampling distribution, what sample_batch draws from (its filters, its
    temperature; a greedy row's argmax with probability 1), for speculative sampling's rule (draft_verify.py).
    The candidates' path where it decides a row, else flat_filter's cut.  logits: (R, V) float32."""
    rows, vocab = logits.shape
    out = torch.zeros(rows, vocab, dtype=torch.float32)
    narrowed: list[int] = []
    for i, p in enumerate(params):
        if p.greedy:
            out[i, int(torch.argmax(logits[i]))] = 1.0
        elif (0.0 < p.top_p < 1.0) or (0 < p.top_k < vocab) or p.min_p > 0:
            narrowed.append(i)
        else:
            out[i] = torch.softmax(logits[i].float() / p.temperature, dim=-1)
    for count in (CANDIDATES, WIDEST):          # as _draw_rows: the candidates, 16x as many, then flat_filter
        if not narrowed or count >= vocab:
            break
        ids, weights, decided = _kept(logits[narrowed], [params[i] for i in narrowed], count)
        for row, i in enumerate(narrowed):
            if bool(decided[row]):
                out[i].index_add_(0, ids[row].clamp(min=0), weights[row])
                out[i] /= out[i].sum()
        narrowed = [i for row, i in enumerate(narrowed) if not bool(decided[row])]
    for i in narrowed:
        out[i] = torch.softmax(flat_filter(logits[i].float(), params[i]), dim=-1)
    return out


def token_logprob(logits: torch.Tensor, token_id: int, top: int) -> EngineTokenLogprob:
    """Logprob of the chosen token under the unmodified distribution, plus the top alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(logprobs, top)
        alternatives = tuple((int(i), float(v)) for i, v in zip(ids, values, strict=True))
    return EngineTokenLogprob(token_id, float(logprobs[token_id]), alternatives)


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
    """logits: (B, V) float32; one token per row, each row with its own parameters."""
    if not params:
        return []
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    tokens = [0] * len(params)
    if greedy:                               # an argmax over a 152k vocabulary is a pass of its own
        for i, token in zip(greedy, torch.argmax(logits[greedy] if sampled else logits, dim=-1).tolist(),
                            strict=True):
            tokens[i] = token
    if sampled:                              # (every row sampled: no copy of a (rows, vocabulary) matrix)
        rows = logits if len(sampled) == len(params) else logits[sampled]
        drawn = _draw_rows(rows, [params[i] for i in sampled], [positions[i] for i in sampled])
        for i, token in zip(sampled, drawn, strict=True):
            tokens[i] = token
    return tokens


def sample_rows(logits: torch.Tensor, rows: Sequence[tuple[Request, int]], eos_token_ids: Set[int]) -> list[int]:
    """One token per row of a step's output, row k being rows[k] = (request, i): the token at the request's
    next position + i (i > 0: a row that verifies a draft; scheduler.Batch.rows).  logits: (R, V) float32, or
    (R,) token ids when the model took every row's argmax (Batch.greedy).  Each request's penalties and logit
    bias (process; min_tokens bans `eos_token_ids` and its stop ids), its grammar's mask, then its sampler
    (temperature, top-k/p, its seeded stream at that position).  `logits` is left as the model made it."""
    if logits.dim() == 1:
        return logits.tolist()
    scores = logits
    if any(r.sampling.processed for r, _ in rows):
        scores = logits.clone()          # logprobs stay the model's own; sampling sees the processed
        for row, (req, _) in enumerate(rows):
            if req.sampling.penalized:   # (rows with drafts never are: Scheduler._propose)
                scores[row] = process(logits[row], req.sampling, req.prompt_ids, req.resume_ids + req.output_ids,
                                      eos_token_ids | set(req.sampling.stop_token_ids))
        grammar.apply_masks(scores, logits, [(row, r.matcher) for row, (r, _) in enumerate(rows)
                                             if r.matcher is not None])
    return sample_batch(scores, [r.sampling for r, _ in rows], [r.num_generated + i for r, i in rows])
