"""Logits processors on every node of a draft tree, and the seeded (Gumbel-coupled) scores.

A tree node's next-token logits depend on the tokens before it: the request's committed output
and the node's own path of draft tokens. Each row of a logits matrix here is one node (or one
frontier node of a growing draft tree), and `paths[row]` holds that node's draft tokens after the
committed output (the root, already committed, excluded). The same function processes the
target's rows when verifying and the draft's rows when drafting, so greedy speculation equals
plain greedy decoding with the same processors and sampled speculation samples the target's
processed distribution.

vLLM's semantics and order: min_tokens masks EOS and stop ids while the row's output position
is below `min_tokens`; logit_bias is added; repetition_penalty divides positive (multiplies
negative) logits of tokens seen in the prompt or output; frequency_penalty subtracts
count x penalty and presence_penalty subtracts the penalty once, both over output tokens.

A grammar (`SamplingParams.structured`) gives each row the tokens its node's grammar state
allows (`allowed`, computed by `shared.grammar`): every other token's logit becomes -inf, after
the processors above, so both sides sample the target's masked distribution.

Drafts may have a reduced output head: `column_of[full id]` is the logits column of each token
(-1 where the head has none); None means columns are token ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from shared.values.sampling import SamplingParams, TokenHistory, gumbel_noise, processed_probs


def tree_paths(parents: Sequence[int], tokens: Sequence[int]) -> list[list[int]]:
    """Each node's draft tokens after the root (parents in topological order, node 0 the root)."""
    paths: list[list[int]] = [[]]
    for node in range(1, len(parents)):
        paths.append([*paths[int(parents[node])], int(tokens[node])])
    return paths


def _columns(
    ids: torch.Tensor, column_of: torch.Tensor | None, num_cols: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[k] full ids -> ([k] columns, [k] bool: the id has a column)."""
    if column_of is None:
        keep = ids < num_cols
        return ids.clamp_max(num_cols - 1), keep
    inside = ids < len(column_of)
    cols = column_of[ids.clamp_max(len(column_of) - 1)]
    keep = inside & (cols >= 0)
    return cols.clamp_min(0), keep


def seen_counts(
    history: TokenHistory,
    paths: Sequence[Sequence[int]],
    num_cols: int,
    column_of: torch.Tensor | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The columns a penalty can touch and what it reads there: ([S] long, the columns of every
    token in the prompt, the output or a row's path; [N, S] float32, how often each occurs in the
    output plus the row's path; [S] bool, whether it occurs in the prompt). S is at most the
    tokens seen, so penalizing costs that, not the vocabulary, per row."""
    output = torch.tensor(history.output, dtype=torch.long, device=device)
    prompt = torch.tensor(history.prompt, dtype=torch.long, device=device)
    flat = torch.tensor([t for path in paths for t in path], dtype=torch.long, device=device)
    rows = torch.tensor(
        [row for row, path in enumerate(paths) for _ in path], dtype=torch.long, device=device
    )
    parts = [_columns(ids, column_of, num_cols) for ids in (output, prompt, flat)]
    (out_cols, out_keep), (prompt_cols, prompt_keep), (path_cols, path_keep) = parts
    kept = [out_cols[out_keep], prompt_cols[prompt_keep], path_cols[path_keep]]
    columns, index = torch.unique(torch.cat(kept), return_inverse=True)  # [S], [kept]
    out_at, prompt_at, path_at = index.split([len(k) for k in kept])
    counts = torch.bincount(out_at, minlength=len(columns)).float()  # [S]
    counts = counts.expand(len(paths), len(columns)).clone()  # [N, S]
    counts.index_put_(
        (rows[path_keep], path_at), torch.ones_like(path_at, dtype=torch.float32), accumulate=True
    )
    in_prompt = torch.zeros(len(columns), dtype=torch.bool, device=device)
    in_prompt[prompt_at] = True
    return columns, counts, in_prompt


def process_logits(
    logits: torch.Tensor,  # [N, C] one row per node
    params: SamplingParams,
    history: TokenHistory | None,
    paths: Sequence[Sequence[int]],  # [N] each row's draft tokens after the committed output
    column_of: torch.Tensor | None = None,  # [V] long: full id -> column, -1 where none
    allowed: torch.Tensor | None = None,  # [N, V'] bool by full id: the grammar's tokens per row
) -> torch.Tensor:
    """[N, C] float32 logits after min_tokens, logit_bias, the penalties and the grammar's mask
    (the input itself when the request has none of these)."""
    if not params.has_processors:
        return logits if allowed is None else mask_logits(logits.float(), allowed, column_of)
    if len(paths) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows but {len(paths)} paths")
    if history is None and (params.needs_counts or params.min_tokens):
        raise ValueError("this request's processors need its token history")
    num_rows, num_cols = logits.shape
    device = logits.device
    x = logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=device)
        cols, keep = _columns(ids, column_of, num_cols)
        x[:, cols[keep]] += bias[keep]
    if params.needs_counts:
        assert history is not None
        columns, counts, in_prompt = seen_counts(history, paths, num_cols, column_of, device)
        seen = counts > 0  # [N, S]
        y = x[:, columns]  # [N, S]
        if params.repetition_penalty != 1.0:
            penalty = params.repetition_penalty
            repeated = seen | in_prompt[None, :]
            y = torch.where(repeated, torch.where(y > 0, y / penalty, y * penalty), y)
        if params.frequency_penalty:
            y -= params.frequency_penalty * counts
        if params.presence_penalty:
            y -= params.presence_penalty * seen.float()
        x[:, columns] = y
    if params.min_tokens and history is not None and history.end_ids:
        blocked = [
            row
            for row, path in enumerate(paths)
            if history.output_len + len(path) < params.min_tokens
        ]
        ids = torch.tensor(history.end_ids, dtype=torch.long, device=device)
        cols, keep = _columns(ids, column_of, num_cols)
        if blocked and bool(keep.any()):
            rows = torch.tensor(blocked, dtype=torch.long, device=device)
            x[rows[:, None], cols[keep][None, :]] = float("-inf")
    return x if allowed is None else mask_logits(x, allowed, column_of)


def mask_logits(
    logits: torch.Tensor, allowed: torch.Tensor, column_of: torch.Tensor | None = None
) -> torch.Tensor:
    """[N, C] logits with -inf where `allowed` ([N, V'] bool by full token id; ids past V' are
    not allowed) is False; a reduced head's columns read their token's entry."""
    num_cols = logits.shape[1]
    allowed = allowed.to(logits.device)
    if column_of is None:
        keep = torch.zeros(allowed.shape[0], num_cols, dtype=torch.bool, device=logits.device)
        width = min(num_cols, allowed.shape[1])
        keep[:, :width] = allowed[:, :width]
    else:
        ids = torch.full((num_cols,), -1, dtype=torch.long, device=logits.device)
        has = (column_of >= 0).nonzero().flatten()
        ids[column_of[has]] = has
        inside = (ids >= 0) & (ids < allowed.shape[1])
        keep = allowed[:, ids.clamp(0, allowed.shape[1] - 1)] & inside[None, :]
    return logits.masked_fill(~keep, float("-inf"))


def coupled_scores(
    logits: torch.Tensor,  # [N, C] processed logits, one row per node
    params: SamplingParams,
    positions: Sequence[int],  # [N] the output position each row's next token takes
    column_ids: torch.Tensor | None = None,  # [C] long: each column's full id; None: the column
) -> torch.Tensor:
    """[N, C] float64: the processed distribution's log-probabilities, up to a constant per row
    (the logits over the temperature, -inf where min_p, top-k or top-p drop a token), plus the
    request's Gumbel noise of each row's output position. Its argmax is a sample of that
    distribution (Gumbel-max); rows of one position share the noise, so a draft scoring its rows
    this way proposes the token the target will pick wherever the two distributions agree.
    Nothing downstream reads more than each row's order or its softmax, which the constant
    does not change, so no softmax and log over the vocabulary are paid per row."""
    assert params.seed is not None
    scores = logits.to(torch.float64, copy=True).div_(params.temperature)
    if params.has_filters:
        scores = scores.masked_fill(processed_probs(logits, params) == 0, float("-inf"))
    num_cols = logits.shape[1]
    size = num_cols if column_ids is None else int(column_ids.max()) + 1
    columns = None if column_ids is None else column_ids.cpu().numpy()
    distinct = sorted(set(positions))
    rows = []
    for position in distinct:
        full = gumbel_noise(params.seed, position, size)
        rows.append(full if columns is None else full[columns])
    noise = torch.from_numpy(np.stack(rows)).to(scores.device)  # [P, C]
    at = {position: i for i, position in enumerate(distinct)}
    index = torch.tensor([at[p] for p in positions], dtype=torch.long, device=scores.device)
    return scores.add_(noise[index])
